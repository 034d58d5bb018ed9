"""A figure as the app's export buttons and the command line write it (analysis.export.write_bundle): what the
pages' figure functions (analysis.pruning_figures, generation_figures, corpus_figures) return."""
from __future__ import annotations

from typing import Callable, NamedTuple

import pandas as pd
import plotly.graph_objects as go


class Bundle(NamedTuple):
    """One figure: its file name, the plotly figure, the table its CSV holds (or a function building it when written:
    the page builds a large one only when CSV is clicked), the settings its sidecar records, and the models it draws
    when more than the page's own ({name: directory}; None: the model the page shows)."""
    name: str
    fig: go.Figure
    table: pd.DataFrame | Callable[[], pd.DataFrame]
    settings: dict
    models: dict | None = None
