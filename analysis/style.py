"""A publication style for exported figures: a paper's one- or two-column width, colour-blind-safe colours, one
embedded font, and math written as sub- and superscripts.

- Widths: 3.5 in (one column) and 7 in (two columns, a full page width), in CSS pixels at 96 per inch, which is
  what kaleido's PDF page is measured in; the height keeps the figure's own aspect, within 0.4 to 1.2 of the width.
- Colours: lines and markers take the Okabe-Ito palette (distinct under the common colour-vision deficiencies);
  heatmaps take cividis (sequential, made for deuteranopia) or, when centred on a value, ColorBrewer's RdBu,
  which ColorBrewer marks colour-blind safe.
- Font: Liberation Sans (Arial's metrics), at 8 pt. Chromium embeds the fonts it draws with in a PDF; an SVG
  names its font, so the paper SVG carries the font file itself (an @font-face data URI, about 190 KB).
- Math: kaleido has no MathJax offline, so labels written in TeX's small subset (x_{n,j}, I^{k}, \\alpha, \\sigma)
  become plotly's <sub>/<sup> tags and Unicode Greek, which every renderer draws.
"""
from __future__ import annotations

import base64
import re
from pathlib import Path

import plotly.graph_objects as go

PX_PER_IN = 96
COLUMNS = {"one": 3.5, "two": 7.0}   # inches
OKABE_ITO = ["#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7"]
SEQUENTIAL, DIVERGING = "Cividis", "RdBu"
FONT_FAMILY, FONT_PT = "Liberation Sans", 8
FONT_FILE = Path("/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf")
GREEK = {"alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "epsilon": "ε", "lambda": "λ", "mu": "μ",
         "sigma": "σ", "tau": "τ", "theta": "θ", "pi": "π", "rho": "ρ", "phi": "φ", "omega": "ω", "Sigma": "Σ",
         "Delta": "Δ", "cdot": "·", "times": "×", "le": "≤", "ge": "≥", "to": "→", "sqrt": "√"}


class StyleError(ValueError):
    pass


def tex(label: str) -> str:
    """TeX's small subset to plotly text: _{..} / _x subscripts, ^{..} / ^x superscripts, \\name Greek and
    symbols; anything else is left as written."""
    out = re.sub(r"\\([A-Za-z]+)", lambda m: GREEK.get(m.group(1), m.group(0)), label)
    for mark, tag in (("_", "sub"), (r"\^", "sup")):
        out = re.sub(mark + r"\{([^{}]*)\}", lambda m: f"<{tag}>{m.group(1)}</{tag}>", out)
        # unbraced only after a one-character symbol (x_n, σ_α), so a name such as held_bytes stays as it is
        out = re.sub(r"(?<!\w)(\w)" + mark + r"(\w)(?!\w)", lambda m: f"{m.group(1)}<{tag}>{m.group(2)}</{tag}>", out)
    return out


def _centred(trace) -> bool:
    """A heatmap drawn around a value (zmid set, or a range symmetric about 0): it keeps a diverging scale."""
    return trace.zmid is not None or (trace.zmin is not None and trace.zmax is not None and trace.zmin == -trace.zmax
                                      and trace.zmax > 0)


def paper(fig: go.Figure, column: str = "one") -> go.Figure:
    """A copy of fig in the publication style at a column width ("one" or "two")."""
    if column not in COLUMNS:
        raise StyleError(f"column {column!r}: choose one or two")
    out = go.Figure(fig)
    width = round(COLUMNS[column] * PX_PER_IN)
    aspect = (fig.layout.height or 500) / (fig.layout.width or 700)
    out.update_layout(template="simple_white", width=width, height=round(width * min(max(aspect, 0.4), 1.2)),
                      font=dict(family=FONT_FAMILY, size=round(FONT_PT * PX_PER_IN / 72)), colorway=OKABE_ITO,
                      margin=dict(l=40, r=10, t=30 if fig.layout.title.text else 10, b=35))
    for i, t in enumerate(out.data):
        if t.type == "heatmap":
            t.colorscale = DIVERGING if _centred(t) else SEQUENTIAL
        elif t.type in ("scatter", "scattergl", "bar"):
            colour = OKABE_ITO[i % len(OKABE_ITO)]
            if t.marker is not None and isinstance(t.marker.color, str):
                t.marker.color = colour
            if t.type != "bar" and t.line is not None and isinstance(t.line.color, str):
                t.line.color = colour
    if out.layout.title.text:
        out.layout.title.text = tex(out.layout.title.text)
    for axis in (a for name in dir(out.layout) if name.startswith(("xaxis", "yaxis"))
                 if (a := getattr(out.layout, name, None)) is not None):
        if axis.title.text:
            axis.title.text = tex(axis.title.text)
    return out


def embed_font(svg: bytes) -> bytes:
    """The SVG with its font inside (an @font-face data URI), so it draws the same wherever it is opened."""
    if not FONT_FILE.is_file():
        raise StyleError(f"the paper style's font is not installed ({FONT_FILE}): on Debian "
                         "`apt-get install fonts-liberation`")
    data = base64.b64encode(FONT_FILE.read_bytes()).decode("ascii")
    face = (f"<style>@font-face{{font-family:'{FONT_FAMILY}';src:url(data:font/ttf;base64,{data}) "
            "format('truetype');}</style>").encode("ascii")
    head = svg.find(b">", svg.find(b"<svg")) + 1
    if head <= 0:
        raise StyleError("not an SVG document")
    return svg[:head] + face + svg[head:]
