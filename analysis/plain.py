"""Text in plotly figures as the characters it is, and the parts of a figure spec that could make a renderer reach
out to the network. Pure functions: no plotly, no I/O.

How plotly.js reads a string it draws (a title, an axis title, a tick label, an annotation, a legend entry, a
hover label; plotly.js 3, `svg_text_utils.convertToTspans`, in kaleido's chromium and in the app's browser alike):

- two `$` anywhere in it (`/([^$]*)([$]+[^$]*[$]+)([^$]*)/` on the raw string) hand it to MathJax, when the page
  has MathJax;
- it is split at `<...>`; `<br>` breaks the line, `<b> <i> <u> <s> <em> <sup> <sub> <span> <a>` are tags, whose
  `style="..."` becomes the drawn element's CSS (a `url(...)` in it is fetched) and an `<a>`'s `href` a link;
  any other `<...>` is drawn as text;
- in the text between tags, HTML character references (`&lt;`, `&amp;`, `&#36;`, `&#x3c;`) become the character,
  drawn as text: never read again as a tag or as MathJax;
- a line break (`\\n`, `\\r\\n`) is drawn as a space.

So `plotly_text` writes `&`, `<`, `>`, `$`, `\\` (and the `%` of `%{`, which a hovertemplate or texttemplate
would fill in) as character references, and one character of anything that names a remote resource (`url(`,
`https://`): plotly.js draws exactly the input's characters (line breaks as spaces), with no tag, style, link or
math made from them, and spec_refusal passes it. Use it for every string a figure shows that our own code did
not write (a token, a model's name, a card's field, a user's title); markup of our own (`<br>`, `<sub>`) goes
around it.

`spec_refusal` walks a whole figure spec (data, layout, frames, templates, any depth) and says where it names
something a renderer would fetch, or None; `without_inert_template_parts` first drops what a template holds only
for subplots and trace types a spec that passes can never have (plotly's own templates style geo subplots).
"""
from __future__ import annotations

import re

# what this project's figures are made of; anything else (images, maps, geo) could make the renderer fetch a URL
TRACES = frozenset({"heatmap", "scatter", "scattergl", "bar", "scatter3d", "box", "histogram", "violin"})
# trace types that draw a map, geography or an image: refused wherever a "type" names one
REMOTE_TRACES = frozenset({
    "scattergeo", "choropleth", "scattermapbox", "choroplethmapbox", "densitymapbox", "scattermap",
    "choroplethmap", "densitymap", "image"})
_SUBPLOT = re.compile(r"(geo|mapbox|map)\d*")            # layout keys of map and geography subplots
_IMAGES = frozenset({"images", "imagedefaults"})          # layout images (and a template's defaults for them)

_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "$": "&#36;", "%": "&#37;", "\\": "&#92;"}
_SPECIAL = re.compile(r"[&<>$\\]|%(?=\{)")
# the patterns text_refusal reads as naming a remote resource, each broken by writing one character of it as a
# character reference (drawn as that character): `url(` as `url&#40;`, `https://` as `https&#58;//`
_BREAK = [
    (re.compile(r"((?:url|image-set|image|expression)\s*)\(", re.I), r"\1&#40;"),
    (re.compile(r"@(import)", re.I), r"&#64;\1"),
    (re.compile(r"((?:java|vb)script\s*):", re.I), r"\1&#58;"),
    (re.compile(r"\b((?:href|src|srcset|xlink:href)\s*)=", re.I), r"\1&#61;"),
    (re.compile(r"\b([a-z][a-z0-9+.\-]*):(?=//)", re.I), r"\1&#58;"),
    (re.compile(r"^(\s*)/(?=/)"), r"\1&#47;"),
]


def plotly_text(s: object) -> str:
    """`s` (a str, or any object as str() writes it; None as "") as plotly text that plotly.js draws as exactly
    these characters: `&`, `<`, `>`, `$` and `\\` become character references (`&amp;`, `&lt;`, `&gt;`, `&#36;`,
    `&#92;`), as does the `%` of a `%{` (`&#37;`), so no tag, style, link, MathJax or template field is made from
    it; and one character of what text_refusal reads as a remote resource (`url(`, `https://`, `//host`, `src=`)
    is written the same way, so a figure showing it is still drawn and redrawn. Line breaks stay, and are drawn
    as spaces, as plotly.js draws them. text_refusal(plotly_text(s)) is None for every s."""
    text = "" if s is None else str(s)
    text = _SPECIAL.sub(lambda m: _ESCAPES[m.group(0)], text)
    for pattern, repl in _BREAK:
        text = pattern.sub(repl, text)
    return text


def plotly_texts(items) -> list[str]:
    """plotly_text of each item (tick labels, a trace's text array)."""
    return [plotly_text(s) for s in items]


# -- what plotly.js would read as more than text ------------------------------------------------------------------

_TAG_SPLIT = re.compile(r"(<[^<>]*>)")                       # plotly.js: qV
_TAG = re.compile(r"<(/?)([^ >]*)(\s+(.*))?>", re.S)         # plotly.js: OV (name up to a space)
_TAGS = frozenset({"sup", "sub", "s", "u", "b", "i", "a", "span", "em"})   # plotly.js: the keys of Lde
_NEWLINES = re.compile(r"\r\n?|\n")
_CSS_HEX = re.compile(r"\\([0-9a-fA-F]{1,6})(?:\r\n|[ \t\r\n\f])?")
_CSS_CHAR = re.compile(r"\\(.)", re.S)
# a remote resource named in text: CSS that fetches, a link or a source attribute, a URL with a scheme, a
# protocol-relative one (// and a host at the start)
_REMOTE = [
    (re.compile(r"url\s*\(", re.I), "a CSS url(...)"),
    (re.compile(r"image-set\s*\(|image\s*\(\s*['\"]", re.I), "a CSS image(...)"),
    (re.compile(r"@import", re.I), "a CSS @import"),
    (re.compile(r"expression\s*\(", re.I), "a CSS expression(...)"),
    (re.compile(r"(java|vb)script\s*:", re.I), "a script: URL"),
    (re.compile(r"\b(href|src|srcset|xlink:href)\s*=", re.I), "an href= or src= attribute"),
    (re.compile(r"\b[a-z][a-z0-9+.\-]*://", re.I), "a URL (scheme://)"),
    (re.compile(r"^\s*//[^/\s]"), "a protocol-relative URL (//host)"),
]


def _css_decoded(s: str) -> str:
    """s with CSS escapes (\\72, \\000072 and a space, \\r) read as the characters they stand for."""
    def hex_char(m):
        code = int(m.group(1), 16)
        return chr(code) if 0 < code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF else "\ufffd"
    s = s.replace("\\\r\n", "").replace("\\\n", "")
    return _CSS_CHAR.sub(r"\1", _CSS_HEX.sub(hex_char, s))


def text_refusal(s: str) -> str | None:
    """Why plotly.js would read `s` as more than plain text, or a browser fetch something for it; None when it is
    drawn as text. Refused: MathJax (two `$`), a tag with attributes (`<span style>`, `<a href>`, `<b style>`:
    the only place plotly.js reads CSS or a link from text) and, as a second line, a remote resource named
    anywhere in it, as written or in CSS escapes (`u\\72l(`). (Character references are not decoded here:
    plotly.js draws them as text, and reads them as more only inside a tag's attributes, which are refused.)"""
    if s.count("$") >= 2:
        return "MathJax ($...$), which the renderer does not load: write it as plain text or <sub>/<sup>"
    spaced = _NEWLINES.sub(" ", s)   # (plotly.js reads a line break as a space before it splits tags)
    for piece in _TAG_SPLIT.split(spaced):
        m = _TAG.fullmatch(piece)
        if not m:
            continue
        name, attrs = m.group(2).lower(), m.group(3)
        first = re.split(r"[\s/>]", piece[1:].lstrip("/"), maxsplit=1)[0].lower()   # (a name read up to any space)
        if (name in _TAGS and attrs and attrs.strip()) or (first in _TAGS and first != name):
            return f"markup with attributes ({piece[:60]!r}): only <br>, <b>, <i>, <sup>, <sub> and the like, bare"
    for pattern, what in _REMOTE:
        if pattern.search(s) or ("\\" in s and pattern.search(_css_decoded(s))):
            return f"{what}, which a renderer could fetch"
    return None


# -- a whole spec --------------------------------------------------------------------------------------------------

_SCALARS = frozenset({int, float, bool, type(None)})


def _is_typed_array(d: dict) -> bool:
    """plotly's typed-array form {"dtype": ..., "bdata": base64, "shape": ...}: its bdata is data, not text."""
    return "bdata" in d and "dtype" in d and isinstance(d["bdata"], str) \
        and re.fullmatch(r"[A-Za-z0-9+/=\s]*", d["bdata"]) is not None


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(the spec)"


def _cleaned_layout(layout):
    if not isinstance(layout, dict) or not isinstance(layout.get("template"), dict):
        return layout
    template = dict(layout["template"])
    if isinstance(template.get("data"), dict):
        template["data"] = {k: v for k, v in template["data"].items() if k in TRACES}
    if isinstance(template.get("layout"), dict):
        template["layout"] = {k: v for k, v in template["layout"].items() if not _SUBPLOT.fullmatch(str(k))}
    return {**layout, "template": template}


def without_inert_template_parts(spec: dict) -> dict:
    """A shallow copy of a figure spec whose templates (its layout's and its frames') no longer hold trace defaults
    for types outside TRACES or geo/mapbox/map subplot styles: those style only what spec_refusal never lets a spec
    have (plotly's own templates carry them, with no URL). Anything else is left for spec_refusal to judge."""
    if not isinstance(spec, dict):
        return spec
    out = dict(spec)
    if "layout" in out:
        out["layout"] = _cleaned_layout(out["layout"])
    if isinstance(out.get("frames"), list):
        out["frames"] = [{**f, "layout": _cleaned_layout(f["layout"])} if isinstance(f, dict) and "layout" in f
                         else f for f in out["frames"]]
    return out


def _trace_refusal(trace, where: tuple, template_kind: str | None = None) -> str | None:
    if not isinstance(trace, dict):
        return f"{_path(where)}: a trace that is not an object"
    kind = trace.get("type", template_kind or "scatter")
    if template_kind is not None and kind != template_kind:   # (a typeless trace would take its type from here)
        return (f"{_path(where + ('type',))}: a template's {template_kind} defaults that set the type "
                f"{str(kind)[:40]!r}")
    if kind not in TRACES:
        return (f"{_path(where)}: a trace of type {str(kind)[:40]!r}; this project's figures are made of "
                f"{', '.join(sorted(TRACES))}")
    return None


def _traces_refusal(spec: dict) -> str | None:
    """Every trace a spec draws or could draw (its data, its frames' data, its templates' trace defaults) is of a
    type in TRACES."""
    def data_of(obj, where):
        data = obj.get("data") if isinstance(obj, dict) else None
        if data is None:
            return None
        if not isinstance(data, list):
            return f"{_path(where + ('data',))}: data that is not a list"
        for i, trace in enumerate(data):
            if (why := _trace_refusal(trace, where + ("data", i))):
                return why
        return None

    def template_of(layout, where):
        template = layout.get("template") if isinstance(layout, dict) else None
        if not isinstance(template, dict):
            return None
        data = template.get("data")
        if isinstance(data, dict):
            for kind, traces in data.items():
                for i, trace in enumerate(traces if isinstance(traces, list) else [traces]):
                    if (why := _trace_refusal(trace, where + ("template", "data", kind, i), str(kind))):
                        return why
        return template_of(template.get("layout"), where + ("template", "layout"))

    if (why := data_of(spec, ()) or template_of(spec.get("layout"), ("layout",))):
        return why
    frames = spec.get("frames")
    for i, frame in enumerate(frames if isinstance(frames, list) else []):
        if isinstance(frame, dict):
            if (why := data_of(frame, ("frames", i)) or template_of(frame.get("layout"), ("frames", i, "layout"))):
                return why
    return None


def spec_refusal(spec) -> str | None:
    """Where a plotly figure spec (a dict as fig.to_json() or a sidecar holds it) names a remote resource or markup
    a renderer would act on, and what, as "PATH: what" (PATH such as `frames[2].layout.images`); None when it names
    none. Pass it through without_inert_template_parts first when it may carry plotly's own template.

    Refused anywhere in it (data, layout, frames, templates, nested objects and lists): a trace of a type outside
    TRACES (or a template that would give a typeless trace such a type), a geo, mapbox or map subplot, layout
    images, a "type" naming a map or image trace, and any string that text_refusal refuses (MathJax, a tag with
    attributes, CSS url(), @import, a script: URL, href=/src=, scheme:// or //host)."""
    if not isinstance(spec, dict):
        return "the spec is not an object"
    if (why := _traces_refusal(spec)):
        return why
    stack: list[tuple[object, tuple]] = [(spec, ())]
    while stack:
        obj, where = stack.pop()
        if isinstance(obj, str):
            if (why := text_refusal(obj)):
                return f"{_path(where)}: {why}"
        elif isinstance(obj, dict):
            typed = _is_typed_array(obj)
            for key, value in obj.items():
                k = str(key)
                if _SUBPLOT.fullmatch(k) and value is not None:
                    return f"{_path(where + (k,))}: a map or geography subplot, which this project's figures never have"
                if k in _IMAGES and not (value is None or isinstance(value, (list, tuple, dict)) and not value):
                    return f"{_path(where + (k,))}: images, which this project's figures never have"
                if k == "type" and isinstance(value, str) and value in REMOTE_TRACES:
                    return f"{_path(where + (k,))}: a {value} trace, which this project's figures never have"
                if typed and k == "bdata":
                    continue
                stack.append((value, where + (k,)))
        elif isinstance(obj, (list, tuple)):
            if not set(map(type, obj)) <= _SCALARS:   # (a list of numbers, as a sidecar's arrays are, has no text)
                stack.extend((v, where + (i,)) for i, v in enumerate(obj))
        elif type(obj).__name__ == "ndarray" and getattr(obj, "dtype", None) is not None and obj.dtype.kind in "OUS":
            stack.extend((v, where + (i,)) for i, v in enumerate(obj.ravel().tolist()))
    return None
