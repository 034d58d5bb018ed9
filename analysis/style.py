"""A publication style for exported figures: a paper's one- or two-column width, colour-blind-safe colours, one
embedded font, and math written as sub- and superscripts.

- Widths: 3.5 in (one column) and 7 in (two columns, a full page width), in CSS pixels at 96 per inch, which is
  what kaleido's PDF page is measured in; the height keeps the figure's own aspect, within 0.4 to 1.2 of the width.
- Colours: lines, markers and bars take the Okabe-Ito palette (distinct under the common colour-vision
  deficiencies), one colour per colour or legend group the figure had, dashed or hatched past 8 (`recolour`);
  heatmaps on a named scale take cividis (sequential, made for deuteranopia) or, when centred on a value,
  ColorBrewer's RdBu, which ColorBrewer marks colour-blind safe; a categorical heatmap keeps its bands, with its
  hues moved to the nearest Okabe-Ito colour.
- Font: Liberation Sans (Arial's metrics), at 8 pt. Chromium embeds the fonts it draws with in a PDF; an SVG
  names its font, so the paper SVG carries the font file itself (an @font-face data URI, about 190 KB).
- Math: kaleido has no MathJax offline, so labels written in TeX's small subset (x_{n,j}, I^{k}, \\alpha, \\sigma)
  become plotly's <sub>/<sup> tags and Unicode Greek, which every renderer draws.
"""
from __future__ import annotations

import base64
import re
from functools import lru_cache
from pathlib import Path

import plotly.colors as pc
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


def _centred(mid, lo, hi) -> bool:
    """A colour scale drawn around a value (its mid set, or a range symmetric about 0): it keeps a diverging scale."""
    return mid is not None or (lo is not None and hi is not None and lo == -hi and hi > 0)


DASHES = ["solid", "dash", "dot", "dashdot"]            # lines past the 8th colour: the colours again, dashed
PATTERNS = ["", "/", ".", "x"]                           # bars likewise, hatched
SYMBOLS = ["circle", "square", "diamond", "triangle-up"]  # markers likewise, in other shapes


def _rgb(colour) -> tuple[int, int, int] | None:
    """#rrggbb, #rgb or rgb(r, g, b) as integers; None for anything else (a name, an array of colours)."""
    if not isinstance(colour, str):
        return None
    c = colour.strip().lower()
    if re.fullmatch(r"#[0-9a-f]{6}", c):
        return tuple(int(c[i:i + 2], 16) for i in (1, 3, 5))
    if re.fullmatch(r"#[0-9a-f]{3}", c):
        return tuple(int(ch * 2, 16) for ch in c[1:])
    found = re.fullmatch(r"rgba?\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*(,[^)]*)?\)", c)
    return tuple(int(v) for v in found.groups()[:3]) if found else None


def _neutral(rgb: tuple[int, int, int]) -> bool:
    """A grey, black, white or a near-white tint: no hue to confuse, so it stays as drawn (reference lines,
    "kept" backgrounds)."""
    return max(rgb) - min(rgb) < 40 or min(rgb) > 200


def _nearest_hue(rgb: tuple[int, int, int]) -> str:
    """The Okabe-Ito colour nearest a categorical colour, so a figure's words ("red dropped, blue held") still hold."""
    def dist(c):
        o = _rgb(c)
        return sum((a - b) ** 2 for a, b in zip(rgb, o))
    return min(OKABE_ITO[1:], key=dist)


@lru_cache(maxsize=1)
def _named_scales() -> frozenset:
    """Plotly's named colour scales (and their reverses) as colour tuples: a figure holds "Viridis" as its stops."""
    out = set()
    for name in pc.named_colorscales():
        for n in (name, name + "_r"):
            out.add(tuple(_rgb(c) for _, c in pc.get_colorscale(n)))
    return frozenset(out)


def recolour(fig: go.Figure) -> None:
    """Colour-blind-safe colours in place.

    Lines, markers and bars: each distinct colour the figure gave (or, where it gave none, each legend group or
    name) takes the next Okabe-Ito colour, so traces that shared a colour still share one; past the palette's 8,
    the colours repeat with another dash, hatch or marker shape, so no two groups look alike. Greys stay. A colour
    per point or bar (a sign: red below 0, blue above) keeps its meaning, each hue moved to the nearest Okabe-Ito
    colour; values per point on a scale take the heatmaps' scales.
    Heatmaps: a scale of the figure's own colours is categorical (held/dropped, who dropped): its greys and
    tints stay and each hue becomes the nearest Okabe-Ito colour; a named scale becomes cividis, or RdBu when
    centred."""
    groups: dict = {}
    for t in fig.data:
        if t.type == "heatmap":
            scale = t.colorscale
            own = (isinstance(scale, (list, tuple)) and all(_rgb(c) for _, c in scale)
                   and tuple(_rgb(c) for _, c in scale) not in _named_scales())
            if own:
                t.colorscale = [[v, c if _neutral(_rgb(c)) else _nearest_hue(_rgb(c))] for v, c in scale]
            else:
                t.colorscale = DIVERGING if _centred(t.zmid, t.zmin, t.zmax) else SEQUENTIAL
            continue
        if t.type not in ("scatter", "scattergl", "bar"):
            continue
        points = t.marker.color if t.marker is not None else None
        if points is not None and not isinstance(points, str):   # a colour (or a value) per point or bar
            if len(points) and all(_rgb(c) for c in points):    # colours that say something (a sign): their hues
                t.marker.color = [c if _neutral(_rgb(c)) else _nearest_hue(_rgb(c)) for c in points]
            elif t.marker.colorscale is not None:                # values on a scale: as a heatmap's
                m = t.marker
                t.marker.colorscale = DIVERGING if _centred(m.cmid, m.cmin, m.cmax) else SEQUENTIAL
            continue
        given = (t.line.color if t.type != "bar" and t.line is not None else None) or points
        rgb = _rgb(given)
        if rgb is not None and _neutral(rgb):
            continue
        key = ("colour", rgb or given) if given else ("group", t.legendgroup or t.name or id(t))
        k = groups.setdefault(key, len(groups))
        colour, round_ = OKABE_ITO[k % len(OKABE_ITO)], k // len(OKABE_ITO)
        if t.type == "bar":
            t.marker.color = colour
            if round_ and not t.marker.pattern.shape:
                t.marker.pattern.shape = PATTERNS[round_ % len(PATTERNS)]
            continue
        # (a dash or shape the figure chose itself says something, e.g. allocated beside held: it stays)
        if t.mode is None or "lines" in t.mode:
            t.line.color = colour
            if round_ and t.line.dash is None:
                t.line.dash = DASHES[round_ % len(DASHES)]
        if t.mode is None or "markers" in t.mode:
            if t.marker.color is None or isinstance(t.marker.color, str):
                t.marker.color = colour
            if round_ and t.marker.symbol is None:
                t.marker.symbol = SYMBOLS[round_ % len(SYMBOLS)]


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
    recolour(out)
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
