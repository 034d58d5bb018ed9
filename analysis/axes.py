"""Token positions as a figure's axis: one category per position, named by the position and its token, so a
hover shows the token without a string per cell (a 128 x 128 map's per-cell hover strings were 0.5 MB of its
0.57 MB of JSON, and most of the browser's time drawing it)."""
from __future__ import annotations

from analysis.plain import plotly_text, plotly_texts

MOST_TICKS = 60   # labels drawn along an axis; every position still has its name on hover


def position_names(labels: list[str]) -> list[str]:
    """Unique category names, position first (a repeated token stays apart); the tokens (raw text) drawn as their
    characters (analysis.plain.plotly_text)."""
    return [f"{i}: {plotly_text(t)}" for i, t in enumerate(labels)]


def position_axis(labels: list[str], names: list[str] | None = None) -> dict:
    """Axis settings (for update_xaxes / update_yaxes): categories in position order, labelled by every
    len/MOST_TICKS-th token. labels: the tokens as raw text; names: position_names(labels), when already made."""
    names = names or position_names(labels)
    step = max(1, len(labels) // MOST_TICKS)
    return {"type": "category", "categoryorder": "array", "categoryarray": names,
            "tickvals": names[::step], "ticktext": plotly_texts(labels[::step])}
