"""Pure functions: model + text -> pandas tables -> plotly figures (shared by the app and the exporter)."""
