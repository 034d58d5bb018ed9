"""No outbound request from figure export or `mixscope render` (docs/deployment.md, "In both modes"):

- a spec that names a remote resource in any of the ways plotly.js and chromium would follow (a <span style> with a
  CSS url(), also CSS-escaped; a MathJax title; a geo or mapbox layout; a geo trace made through a template; images
  in a frame, in the layout or in a template) is refused by `render`, with the place in the spec named, and a local
  listener those specs point at records no request;
- the renderer itself (kaleido's chromium, as analysis.export starts it) loads no MathJax and reaches nothing, not
  even what a figure that skipped the checks names: its command line carries the flags, a request it would make is
  refused before it leaves;
- analysis.plain.plotly_text makes any string plain text: no `<` or `>` left, and plotly.js draws the input's
  characters exactly;
- `render` and write_bundle never write through a link planted at a temporary or final name.

The tests that start chromium are marked `full` (as tests/test_export.py is, through tests/conftest.py)."""
import http.server
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from analysis import export, plain, render

REPO = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"


class Listener:
    """An HTTP server on 127.0.0.1 that records every request (and every proxy CONNECT) it is sent."""

    def __init__(self):
        requests = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self):
                requests.append(f"{self.command} {self.path}")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = do_HEAD = do_CONNECT = do_OPTIONS = _record

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    srv = Listener()
    yield srv
    srv.close()


def scatter(**extra):
    return {"type": "scatter", "x": [1, 2, 3], "y": [2, 1, 3], **extra}


def hostile_specs(url: str) -> dict[str, tuple[dict, str]]:
    """name -> (a figure spec naming url, the place in it a refusal must name)."""
    span = f'<span style="background:url({url}/span.png)">x</span>'
    return {
        "span style url": ({"data": [scatter()], "layout": {"annotations": [{"text": span, "x": 1, "y": 1}]}},
                           "layout.annotations[0].text"),
        "span style url in a label": ({"data": [scatter(name=span)], "layout": {}}, "data[0].name"),
        "css-escaped url": ({"data": [scatter()], "layout": {"title": {
            "text": f'<span style="background:u\\72l({url}/escaped.png)">t</span>'}}}, "layout.title.text"),
        "css-escaped url, long form": ({"data": [scatter()], "layout": {"xaxis": {"title": {
            "text": f'<b style="background-image:\\000075rl({url}/long.png)">t</b>'}}}}, "layout.xaxis.title.text"),
        "css-escaped url outside a tag": ({"data": [scatter()], "layout": {"font": {
            "family": f"x; background:u\\72 l({url[7:]}/font.png)"}}}, "layout.font.family"),
        "mathjax title": ({"data": [scatter()], "layout": {"title": {"text": f"$\\href{{{url}/mj}}{{x}}^2$"}}},
                          "layout.title.text"),
        "geo layout": ({"data": [scatter()], "layout": {"geo": {"scope": "europe"}}}, "layout.geo"),
        "geo trace": ({"data": [{"type": "scattergeo", "lat": [1], "lon": [1]}], "layout": {}}, "data[0]"),
        "geo via template": ({"data": [{"x": [10], "y": [10]}],   # (typeless: scatter to plotly.py, geo to plotly.js)
                              "layout": {"template": {"data": {"scatter": [{"type": "scattergeo"}]}}}},
                             "layout.template.data.scatter[0].type"),
        "images inside frames": ({"data": [scatter()], "layout": {}, "frames": [
            {"name": "a", "data": [scatter()]}, {"name": "b"},
            {"name": "c", "layout": {"images": [{"source": f"{url}/frame.png", "xref": "paper", "yref": "paper",
                                                 "x": 0, "y": 1, "sizex": 1, "sizey": 1}]}}]},
                                 "frames[2].layout.images"),
        "geo inside frames": ({"data": [scatter()], "layout": {}, "frames": [
            {"data": [{"type": "scattergeo", "lat": [1], "lon": [1]}]}]}, "frames[0].data[0]"),
        "layout images": ({"data": [scatter()], "layout": {"images": [
            {"source": f"{url}/layout.png", "xref": "paper", "yref": "paper", "x": 0, "y": 1, "sizex": 1,
             "sizey": 1}]}}, "layout.images"),
        "template images": ({"data": [scatter()], "layout": {"template": {"layout": {"images": [
            {"source": f"{url}/template.png"}]}}}}, "layout.template.layout.images"),
        "mapbox": ({"data": [scatter()], "layout": {"mapbox": {"style": f"{url}/style.json"}}}, "layout.mapbox"),
        "mapbox trace": ({"data": [{"type": "scattermapbox", "lat": [1], "lon": [1]}],
                          "layout": {"mapbox": {"style": f"{url}/style.json"}}}, "data[0]"),
        "link": ({"data": [scatter()], "layout": {"annotations": [{"text": f'<a href="{url}/a">x</a>', "x": 1,
                                                                    "y": 1}]}}, "layout.annotations[0].text"),
        "image trace": ({"data": [{"type": "image", "source": f"{url}/image.png"}], "layout": {}}, "data[0]"),
        "url in a tick label": ({"data": [scatter()], "layout": {"xaxis": {
            "tickvals": [1], "ticktext": [f"{url}/tick"]}}}, "layout.xaxis.ticktext[0]"),
        "protocol-relative url": ({"data": [scatter(text=["a", f"//127.0.0.1:{url.rsplit(':', 1)[1]}/x", "c"],
                                                    mode="text")], "layout": {}}, "data[0].text[1]"),
        "@import": ({"data": [scatter()], "layout": {"meta": [f"@import '{url}/x.css'"]}}, "layout.meta[0]"),
    }


@pytest.mark.parametrize("name", list(hostile_specs("http://127.0.0.1:1")))
def test_render_refuses_every_remote_resource_and_nothing_is_fetched(name, listener, tmp_path, capsys):
    spec, where = hostile_specs(listener.url)[name]
    side = tmp_path / "fig.json"
    side.write_text(json.dumps({"plotly": spec}))
    with pytest.raises(export.ExportError) as refused:
        render.render(side, ["png", "svg"], tmp_path / "out")
    assert where in str(refused.value), str(refused.value)
    assert render.main([str(side), "--format", "png", "--out", str(tmp_path / "out")]) == 2
    assert where in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert listener.requests == []


def test_the_app_export_path_refuses_them_too(listener):
    """figure_bytes (the app's PNG/SVG/PDF buttons, write_bundle, the reports) checks the same way before drawing."""
    for name in ("span style url in a label", "mathjax title", "images inside frames", "layout images", "link"):
        spec, where = hostile_specs(listener.url)[name]
        with pytest.raises(export.ExportError, match=re.escape(where)):
            export.figure_bytes(go.Figure(spec), "png")
    assert listener.requests == []


def test_plotlys_own_templates_and_the_paper_style_pass():
    """The geo and map styles in plotly's templates name nothing and style nothing these figures open: dropped,
    not refused; a figure in any built-in template, or in the paper style, passes."""
    from analysis import style
    for name in pio.templates:
        spec = json.loads(go.Figure(go.Heatmap(z=[[1, 2]]), layout={"template": name}).to_json())
        assert render.refused(spec) is None, name
    lines = go.Figure([go.Scatter(y=[1, 3], name="x"), go.Bar(y=[2, 1])],
                      layout={"title": "x_{n,j} under \\sigma_\\alpha", "xaxis_title": "I^{k}"})
    assert render.refused(json.loads(style.paper(lines, "two").to_json())) is None
    hover = go.Figure(go.Heatmap(z=[[1]], hovertemplate="query %{y}<br>key %{x}<br>%{z:.3f}<extra></extra>"),
                      layout={"title": "x<sub>n,j</sub> and <b>bold</b>"})
    assert render.refused(json.loads(hover.to_json())) is None


def test_a_refusal_names_the_deepest_place():
    deep = {"data": [scatter()], "layout": {"updatemenus": [{"buttons": [{"args": [{"images": [{"source": "x"}]}]}]}]}}
    assert plain.spec_refusal(deep).startswith("layout.updatemenus[0].buttons[0].args[0].images:")
    typed = {"data": [scatter(x={"dtype": "f8", "bdata": "//8AAAAAAAA="})], "layout": {}}   # (base64, not a URL)
    assert plain.spec_refusal(typed) is None


# -- the renderer: no MathJax, no network ---------------------------------------------------------------------------

def test_the_renderers_page_loads_no_mathjax_and_nothing_remote():
    page = export._page().generate_index()
    sources = re.findall(r'<script src="([^"]*)"', page)
    assert sources and all(s.startswith("file://") for s in sources), sources
    assert "mathjax" not in page.lower()


def _descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _hostile_but_drawable(url: str) -> dict:
    """An ordinary figure, plus what would make chromium fetch from url: for drawing with the checks skipped."""
    return {"data": [scatter(name="a line")], "layout": {
        "title": {"text": "$x^2$ and a title"},
        "images": [{"source": f"{url}/img.png", "xref": "paper", "yref": "paper", "x": 0, "y": 1, "sizex": 0.5,
                    "sizey": 0.5}],
        "annotations": [{"text": f'<span style="background:url({url}/span.png)">hi</span>', "x": 2, "y": 2}]}}


@pytest.mark.full
def test_an_ordinary_export_runs_in_a_renderer_that_reaches_nothing(listener):
    """PNG and PDF of an ordinary figure; then the renderer (as figure_bytes starts it) is handed a figure that
    names the listener in an image and a CSS url(), with the checks skipped: chromium asks nothing of it."""
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2], name="ordinary"), layout={"title": "an ordinary figure"})
    assert export.figure_bytes(fig, "png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert export.figure_bytes(fig, "pdf")[:5] == b"%PDF-"
    export._ensure_server()
    for fmt in ("png", "pdf"):
        with warnings.catch_warnings():   # (kaleido's server says plotly's kopts are ignored: not what is tested)
            warnings.simplefilter("ignore")
            pio.to_image(_hostile_but_drawable(listener.url), format=fmt, validate=False)
    assert listener.requests == []
    # what kaleido gave its chromium: the flags are on the browser process's command line
    browsers = []
    for pid in _descendants(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--remote-debugging-pipe" in argv and b"chromium" in argv[0]:
            browsers.append([a.decode() for a in argv])
    assert browsers, "no chromium under this process"
    for argv in browsers:
        assert "--proxy-bypass-list=<-loopback>" in argv and "--host-resolver-rules=MAP * ~NOTFOUND" in argv
        assert [a for a in argv if a.startswith("--proxy-server=")] == ["--proxy-server=127.0.0.1:9"]


SENSOR = textwrap.dedent("""
    # the renderer as analysis.export starts it, but with its proxy at the listener, so that whatever it asks of the
    # network is seen there; MathJax's address is the listener too, so a page that loads it is seen as well
    import sys, warnings
    import kaleido._page_generator as pg
    import plotly.io as pio
    from analysis import export
    port, default_page = int(sys.argv[1]), sys.argv[2] == "kaleido-default"
    pg.DEFAULT_MATHJAX = f"http://127.0.0.1:{port}/mathjax.js"
    export.RENDERER_FLAGS = (f"--proxy-server=127.0.0.1:{port}", "--proxy-bypass-list=<-loopback>")
    if default_page:   # (the control: kaleido's own page, with its MathJax, in the same browser)
        import kaleido
        kaleido.start_sync_server(browser_cls=export._offline_browser(), silence_warnings=True)
        export._server_started = True
    warnings.simplefilter("ignore")
    spec = {"data": [{"type": "scatter", "x": [1, 2], "y": [1, 2]}], "layout": {"title": {"text": "$x^2$"}}}
    export._ensure_server()
    for fmt in ("png", "pdf"):
        pio.to_image(spec, format=fmt, validate=False)
    print("drawn")
""")


@pytest.mark.full
def test_the_renderer_never_asks_for_mathjax(listener):
    """A figure whose title is MathJax, drawn by the renderer with every request it makes sent to the listener:
    nothing asks for MathJax (kaleido's own page, drawn the same way, does: the listener would see it)."""
    def sensor(page):
        res = subprocess.run([sys.executable, "-c", SENSOR, str(listener.port), page], cwd=REPO,
                             capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0 and "drawn" in res.stdout, res.stderr[-3000:]
        seen = list(listener.requests)
        listener.requests.clear()
        return seen
    ours = sensor("ours")
    assert not [r for r in ours if "mathjax" in r.lower() or "cdnjs" in r.lower()], ours
    control = sensor("kaleido-default")
    assert [r for r in control if "mathjax" in r.lower()], control


# -- the sanitiser --------------------------------------------------------------------------------------------------

PIECES = list("ab <>&$%{}()\\/:;=\"'#@x.é") + [
    "url(", "URL (", "http://", "https://", "//", "$x$", "&lt;", "&#36;", "&amp;", "<b>", "</b>", "<br>",
    "<span style=\"background:url(http://127.0.0.1:9/x)\">", "</span>", "%{x}", "%{y:.2f}", "u\\72l(", "\\000075rl(",
    "@import", "javascript:", "src=", "href=", "<a href='x'>", "<extra>", "&#x3c;", "$$"]

_ENTITY = re.compile(r"&(#\d+|#x[\da-fA-F]+|[a-z]+);")   # plotly.js's convertEntities
_NAMED = {"mu": "\u03bc", "amp": "&", "lt": "<", "gt": ">", "nbsp": "\xa0", "times": "\xd7", "plusmn": "\xb1",
          "deg": "\xb0"}


def drawn_by_plotly(text: str) -> str:
    """The characters plotly.js draws for a string with no tag in it: its character references read."""
    def one(m):
        ref = m.group(1)
        if ref.startswith("#"):
            return chr(int(ref[2:], 16) if ref[1] == "x" else int(ref[1:]))
        return _NAMED.get(ref, m.group(0))
    return _ENTITY.sub(one, text)


def random_strings(seed: int, n: int, longest: int = 10) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, longest))) for _ in range(n)]


def test_plotly_text_is_plain_text_for_any_string():
    for s in random_strings(0, 3000) + ["", "$", "a$b$c", "%{", "//host/x", " // c", "\\", "&#36;"]:
        out = plain.plotly_text(s)
        assert "<" not in out and ">" not in out and "$" not in out and "%{" not in out and "\\" not in out, (s, out)
        assert plain.text_refusal(out) is None, (s, out)
        assert drawn_by_plotly(out) == s, (s, out)
    assert plain.plotly_text(None) == "" and plain.plotly_text(3) == "3"
    assert plain.plotly_texts(["<b>", "$"]) == ["&lt;b&gt;", "&#36;"]
    labels = random_strings(1, 40)
    spec = {"data": [scatter(x=plain.plotly_texts(labels[:3]), name=plain.plotly_text(labels[3]),
                             text=plain.plotly_texts(labels[4:7]))],
            "layout": {"title": {"text": "<b>ours</b> " + plain.plotly_text(labels[7])},
                       "annotations": [{"text": plain.plotly_text(s), "x": 1, "y": 1} for s in labels[8:]]}}
    assert plain.spec_refusal(spec) is None


def texts_drawn(svg: bytes) -> dict[str, list[str]]:
    """The text of each kind of label in a plotly SVG, as drawn (the tspans' characters joined)."""
    root = ET.fromstring(svg)
    out = {"title": [], "legend": [], "annotation": [], "xtick": [], "xtitle": []}
    classes = {"gtitle": "title", "legendtext": "legend", "annotation-text": "annotation", "xtitle": "xtitle"}
    for g in root.iter(f"{SVG}g"):
        if "xtick" in (g.get("class") or "").split():
            out["xtick"] += ["".join(t.itertext()) for t in g.iter(f"{SVG}text")]
    for t in root.iter(f"{SVG}text"):
        for cls in (t.get("class") or "").split():
            if cls in classes:
                out[classes[cls]].append("".join(t.itertext()))
    return out


@pytest.mark.full
def test_plotly_draws_sanitised_text_as_the_input(listener):
    """Random strings full of <, >, &, $, url( and markup, through plotly_text into a title, an axis title, tick
    labels, a legend entry and an annotation; the spec through fig.to_json() and back, then exported: each label's
    drawn characters are the input's, and the PNG and PDF are drawn as well, with no request made."""
    for seed in range(3):
        s = random_strings(100 + seed, 7)
        s[0] = " " + s[0] + "  x"   # (spaces kept)
        fig = go.Figure(go.Bar(x=plain.plotly_texts(s[:2]), y=[1, 2], name=plain.plotly_text(s[2]), showlegend=True),
                        layout={"title": {"text": plain.plotly_text(s[3])},
                                "xaxis": {"title": {"text": plain.plotly_text(s[4])}},
                                "annotations": [{"text": plain.plotly_text(s[5]), "x": 0.5, "y": 0.5, "xref": "paper",
                                                 "yref": "paper", "showarrow": False}]})
        fig = pio.from_json(fig.to_json())
        drawn = texts_drawn(export.figure_bytes(fig, "svg"))
        assert drawn == {"title": [s[3]], "legend": [s[2]], "annotation": [s[5]], "xtick": s[:2],
                         "xtitle": [s[4]]}, (s, drawn)
        if seed == 0:
            assert export.figure_bytes(fig, "png")[:8] == b"\x89PNG\r\n\x1a\n"
            assert export.figure_bytes(fig, "pdf")[:5] == b"%PDF-"
    assert listener.requests == []


# -- links planted at the names render and write_bundle write to ----------------------------------------------------

def plant(directory: Path, names: list[str], target: Path) -> None:
    for name in names:
        (directory / name).symlink_to(target)


def temp_names(name: str) -> list[str]:
    return [f".{name}.part", f".{name}.tmp", f"{name}.part", f"{name}.tmp", f".{name}",
            f".{name}.0123456789abcdef.part"]


@pytest.fixture
def fake_drawing(monkeypatch):
    """figure_bytes without chromium (what is tested is where the bytes go)."""
    def fake(fig, fmt, scale=2.0):
        return f"drawn {fmt}".encode()
    monkeypatch.setattr(export, "figure_bytes", fake)
    monkeypatch.setattr(render, "figure_bytes", fake)


def test_render_never_writes_through_a_planted_link(tmp_path, fake_drawing, monkeypatch):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    side = tmp_path / "fig.json"
    side.write_text(json.dumps({"plotly": json.loads(go.Figure(go.Scatter(y=[1, 2])).to_json())}))
    out = tmp_path / "out"
    out.mkdir()
    for fmt in ("svg", "png", "pdf"):
        plant(out, temp_names(f"fig.{fmt}"), outside)
    if hasattr(export, "secrets"):   # the random part of the name: the first one tried is a planted link
        names = iter(["0123456789abcdef"] + [f"{i:016x}" for i in range(1, 100)])
        monkeypatch.setattr(export.secrets, "token_hex", lambda n: next(names))
    written = render.render(side, ["svg", "png", "pdf"], out)
    assert outside.read_bytes() == b"precious"
    for p in written:
        assert not p.is_symlink() and p.read_bytes() == f"drawn {p.suffix[1:]}".encode()
    # --force over a link at the final name replaces the link; the file it pointed at is left alone
    (out / "fig.svg").unlink()
    (out / "fig.svg").symlink_to(outside)
    render.render(side, ["svg"], out, force=True)
    assert outside.read_bytes() == b"precious" and not (out / "fig.svg").is_symlink()
    leftovers = {p.name for p in out.iterdir()} - {"fig.svg", "fig.png", "fig.pdf"} - {
        n for fmt in ("svg", "png", "pdf") for n in temp_names(f"fig.{fmt}")}
    assert leftovers == set()


def test_write_bundle_never_writes_through_a_planted_link(tmp_path, fake_drawing):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    out = tmp_path / "bundle"
    out.mkdir()
    for ext in ("png", "svg", "pdf", "csv", "json"):
        plant(out, [f"map.{ext}", *temp_names(f"map.{ext}")], outside)
    fig = go.Figure(go.Scatter(y=[1, 2]))
    paths = export.write_bundle(fig, pd.DataFrame({"a": [1, 2]}), out, "map", {"figure": "map"})
    assert outside.read_bytes() == b"precious"
    assert sorted(p.name for p in paths) == sorted(f"map.{e}" for e in ("png", "svg", "pdf", "csv", "json"))
    assert all(not p.is_symlink() and p.is_file() for p in paths)
    assert (out / "map.csv").read_text().splitlines() == ["a", "1", "2"]


def test_export_model_still_refuses_to_overwrite(tmp_path):
    (tmp_path / "map.png").write_bytes(b"old")
    with pytest.raises(export.ExportError, match="would be overwritten"):
        export.refuse_overwrite(export.bundle_paths(tmp_path, "map"), tmp_path, force=False)
    export.refuse_overwrite(export.bundle_paths(tmp_path, "map"), tmp_path, force=True)
    assert (tmp_path / "map.png").read_bytes() == b"old"
