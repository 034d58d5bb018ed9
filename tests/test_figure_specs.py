"""Every figure the app exports has a spec that redraws it: each page's exported figures (caught at
app.common.export_buttons while the page runs) go through the JSON button's sidecar and
`python -m analysis.render`'s loader with their data arrays equal exactly; a redraw is byte for byte the same
image; the publication style keeps the data and embeds its font."""
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from analysis import render, style
from analysis.export import figure_bytes
from tests.test_corpus import small_report  # noqa: F401 (a fixture)
from tests.test_train_eval import data_dir  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def snapshot_run(tmp_path_factory, data_dir):   # noqa: F811
    from models.train import train
    from tests.test_snapshots import pruned_config
    root = tmp_path_factory.mktemp("snapshot_run")
    train(pruned_config(root, data_dir, snapshots=2), root / "models" / "run", progress=False)
    return root / "models"

VIEWS = Path(__file__).resolve().parent.parent / "app" / "views"
# (page, model): together every figure kind the pages export (Generate on a pruned and on a dense model: its two
# branches; Pruning's off-by-default views and its timeline)
PAGES = [("Models.py", None), ("1_Generate.py", "mha-1024-pruned"), ("1_Generate.py", "mha"),
         ("2_Attention.py", "mha"), ("2_Attention.py", "she"), ("3_Heads.py", "mha"), ("3_Heads.py", "mhe-mul"),
         ("4_Extractors.py", "we"), ("5_Attribution.py", "mha"),
         ("6_Compare.py", "mha"), ("7_Pruning.py", "mha-1024-pruned"), ("7_Pruning.py+views", "mha-1024-pruned"),
         ("7_Pruning.py+timeline", "run"), ("8_Corpus.py", None)]


def exported(monkeypatch, page: str, model: str) -> list[tuple[str, object, dict]]:
    import app.common
    page, _, extra = page.partition("+")
    caught = []
    real = app.common.export_buttons

    def catch(fig, table, name, model_dir=None, text=None, settings=None, key=None, precision=None):
        caught.append((name, fig, {"model_dir": model_dir, "text": text, "settings": settings,
                                   "precision": precision}))
        return real(fig, table, name, model_dir, text, settings, key, precision)

    monkeypatch.setattr(app.common, "export_buttons", catch)
    at = AppTest.from_file(str(VIEWS.parent / page if page == "Models.py" else VIEWS / page), default_timeout=300)
    at.session_state["model"] = model
    at.run()
    if page == "1_Generate.py":   # its figures come after a generation
        at.number_input(key="gen_n").set_value(12)
        at.checkbox(key="gen_greedy").set_value(True)
        at.button(key="gen_go").click().run()
    if extra == "timeline":   # a run with snapshots (MIXSCOPE_MODELS: the fixture's): the replay, at its first
        at.toggle(key="prune_timeline").set_value(True).run()
        at.select_slider(key="prune_timeline_at").set_value(0).run()
        names = [name for name, *_ in caught]
        assert {"pruning_timeline", "pruning_timeline_layers", "pruning_timeline_pos"} <= set(names)
        assert [how["settings"]["snapshot_step"] for name, _, how in caught if name == "pruning_timeline"][-1] == 0
    if extra == "views":   # Pruning's views that are off by default: the scores, a side by side, every policy
        at.toggle(key="prune_scores").set_value(True)
        at.selectbox(key="prune_compare").set_value("tova")
        at.toggle(key="prune_all").set_value(True)
        at.toggle(key="prune_iv").set_value(True).run()
        at.selectbox(key="prune_iv_token").set_value(3)
        at.radio(key="prune_iv_keep").set_value("dropped").run()
        at.radio(key="prune_iv_kind").set_value("patch the dense twin's states").run()
        at.radio(key="prune_iv_site").set_value("its attention output").run()
        at.radio(key="prune_iv_kind").set_value("patch into the dense twin").run()
        names = {name for name, *_ in caught}
        assert {"pruning_scores", "pruning_score_terms", "pruning_soft_keep", "pruning_disagreement",
                "pruning_pos_profile", "pruning_pos_profile_all"} <= names
        what_if = [how["settings"] for name, _, how in caught if name == "pruning_what_if"]
        assert {"token": 3, "keep": False, "at": 4, "onward": False}.items() <= what_if[-4].items()
        assert what_if[-3]["donor"] == "twin" and what_if[-3]["into"] == "pruned" and what_if[-3]["site"] == "residual"
        assert what_if[-2]["site"] == "mixer" and what_if[-1]["into"] == "dense" and what_if[-1]["site"] == "mixer"
    assert not at.exception, at.exception
    return caught


@pytest.mark.parametrize("page, model", PAGES)
def test_each_exported_figure_redraws_from_its_spec_with_equal_data(monkeypatch, tmp_path, page, model, request):
    from app.common import sidecar_json
    if page == "8_Corpus.py":   # a small report of the zoo's pruned MHA (tests/test_corpus.py)
        monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(request.getfixturevalue("small_report")))
    if page.endswith("+timeline"):   # a small pruned run with snapshots (tests/test_snapshots.py)
        monkeypatch.setenv("MIXSCOPE_MODELS", str(request.getfixturevalue("snapshot_run")))
    figures = exported(monkeypatch, page, model)
    assert figures, f"{page} on {model} exported no figure"
    for name, fig, how in figures:
        path = tmp_path / f"{name}.json"
        path.write_text(sidecar_json(fig, name, how["model_dir"], how["text"], how["settings"], how["precision"]))
        meta = json.loads(path.read_text())
        for key in ("checkpoint_sha256", "code", "text_sha256", "settings", "precision", "versions"):
            assert key in meta, (name, key)
        # every model the figure draws is named with its weights' hash (a figure of two models names both, the
        # zoo's figure every model it plots)
        dirs = how["model_dir"] if isinstance(how["model_dir"], dict) else {"model": how["model_dir"]}
        assert dirs and [m["name"] for m in meta["models"]] == [str(k) for k in dirs], name
        assert all(m["checkpoint_sha256"] for m in meta["models"]), name
        assert meta["checkpoint_sha256"] == meta["models"][0]["checkpoint_sha256"], name
        again = render.load_figure(path)
        assert json.loads(again.to_json()) == json.loads(fig.to_json()), name
    if page == "1_Generate.py" and model == "mha":   # a dense model's generation: its per-token latency
        assert {n for n, *_ in figures} == {"generation_latency"}
    if page == "Models.py":
        assert {n for n, *_ in figures} == {"zoo_efficiency"} and len(figures[0][2]["model_dir"]) >= 10
    if page == "8_Corpus.py":   # each figure names the report's models as it recorded them, with their hashes
        run = "mha-1024-pruned_own"
        assert {n for n, *_ in figures} == {"corpus_curve_own", f"corpus_pos_layer_{run}", f"corpus_layers_{run}",
                                            f"corpus_position_{run}", f"corpus_tokens_{run}"}
        assert all(how["precision"] == {"device": "cpu", "dtype": "float32"} for *_, how in figures)
    if page == "6_Compare.py":   # dense against dense here: both maps, their difference, the surprisal of both
        assert {"compare_surprisal", "compare_map_A", "compare_map_B", "compare_difference"} <= {n for n, *_ in figures}
        assert all(len(how["model_dir"]) == 2 for n, _, how in figures if n in ("compare_surprisal",
                                                                                  "compare_difference"))


def test_no_two_kinds_of_figure_share_an_export_name():
    """A name is a figure kind: two export_buttons calls in the views never give the same literal name (or the same
    literal start of a formatted one), so a download never stands for another figure."""
    import ast
    seen = {}
    for page in sorted(VIEWS.glob("*.py")):
        for node in ast.walk(ast.parse(page.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "export_buttons":
                name = node.args[2]
                if isinstance(name, ast.Name):   # names from a builder (analysis.corpus.page_figures: tested there)
                    assert page.name == "8_Corpus.py", page.name
                    continue
                if isinstance(name, ast.JoinedStr):   # f"heads_pca_{...}": its literal start
                    name = name.values[0]
                assert isinstance(name, ast.Constant), (page.name, ast.dump(name))
                assert name.value not in seen, (name.value, page.name, seen.get(name.value))
                seen[name.value] = page.name
    assert len(seen) > 20


def sidecar_of(tmp_path, fig) -> Path:
    from app.common import sidecar_json
    path = tmp_path / "fig.json"
    path.write_text(sidecar_json(fig, "fig", None, None, {}))
    return path


def small_figures():
    import numpy as np

    from analysis import maps
    rng = np.random.default_rng(0)
    heat = maps.map_figure(rng.random((5, 5)), list("abcde"), "attention")
    diff = maps.difference_figure(rng.random((5, 5)), rng.random((5, 5)), list("abcde"), "a - b")
    import plotly.graph_objects as go
    lines = go.Figure([go.Scatter(y=[1, 3, 2], line={"color": "red"}, name="x"), go.Bar(y=[2, 1, 3])])
    lines.update_layout(title="x_{n,j} under \\sigma_\\alpha", xaxis_title="I^{k}")
    return heat, diff, lines


def test_a_redraw_is_the_same_image_byte_for_byte(tmp_path):
    heat, _, _ = small_figures()
    path = sidecar_of(tmp_path, heat)
    first = render.render(path, ["png", "svg"], tmp_path / "a")
    second = render.render(path, ["png", "svg"], tmp_path / "b")
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes() and a.stat().st_size > 1000, a.name
    assert first[0].read_bytes() == figure_bytes(heat, "png")   # and the same as the app's own export


def test_the_paper_style_keeps_the_data_and_embeds_its_font(tmp_path):
    heat, diff, lines = small_figures()
    for fig in (heat, diff, lines):
        styled = style.paper(fig, "two")
        assert styled.layout.width == 672 and styled.layout.font.family == style.FONT_FAMILY
        for a, b in zip(fig.data, styled.data):    # the numbers drawn are the figure's own
            for key in ("x", "y", "z"):
                assert json.dumps(a.to_plotly_json().get(key), default=str) == json.dumps(
                    b.to_plotly_json().get(key), default=str)
    assert style.paper(heat, "one").layout.width == 336
    cmap = lambda f: [c for _, c in f.data[0].colorscale]  # noqa: E731
    assert cmap(style.paper(heat)) == cmap(heat.update_traces(colorscale=style.SEQUENTIAL))
    assert style.paper(diff).data[0].colorscale == diff.update_traces(colorscale=style.DIVERGING).data[0].colorscale
    styled = style.paper(lines)
    assert styled.data[0].line.color == style.OKABE_ITO[0] and styled.layout.colorway == tuple(style.OKABE_ITO)
    assert styled.layout.title.text == "x<sub>n,j</sub> under σ<sub>α</sub>"
    assert styled.layout.xaxis.title.text == "I<sup>k</sup>"
    path = sidecar_of(tmp_path, lines)
    svg, pdf = render.render(path, ["svg", "pdf"], tmp_path / "paper", paper="one")
    assert b"@font-face" in svg.read_bytes() and b"base64," in svg.read_bytes()
    assert b"/FontFile2" in pdf.read_bytes() and b"LiberationSans" in pdf.read_bytes()   # embedded TrueType
    with pytest.raises(render.ExportError, match="one or two"):
        render.render(path, ["png"], tmp_path / "bad", paper="three")


def test_tex_subset():
    assert style.tex("x_{n,j} + \\beta^2") == "x<sub>n,j</sub> + β<sup>2</sup>"
    assert style.tex("plain text, \\unknown, held_bytes") == "plain text, \\unknown, held_bytes"


def test_the_paper_style_keeps_groups_apart_and_pairs_together():
    """Past the palette's 8 colours the groups differ by dash; traces that shared a colour (a run's held and
    allocated cache) still share one; greys stay; a categorical heatmap keeps its bands, its tints and its hues'
    names (red stays a red, blue a blue)."""
    import plotly.graph_objects as go

    import pandas as pd

    from analysis import live, pruning
    many = go.Figure([go.Scatter(y=[i, i + 1], mode="lines", name=f"layer {i}") for i in range(10)]
                     + [go.Scatter(y=[0, 0], mode="lines", line_color="#777", name="dense")])
    styled = style.paper(many)
    looks = [(t.line.color, t.line.dash) for t in styled.data[:10]]
    assert len(set(looks)) == 10 and {c for c, _ in looks} <= set(style.OKABE_ITO)
    assert styled.data[10].line.color == "#777"
    steps = [{"step": s, "held_bytes": 100 - s, "alloc_bytes": 128, "dense_bytes": 100 + s, "model_ms": 1.0,
              "token": "a"} for s in range(4)]
    curve = style.paper(live.cache_curve_figure({"pruned": {"steps": steps}, "twin": {"steps": steps}}, "cache"))
    held_a, alloc_a, held_b, alloc_b = curve.data[:4]
    assert held_a.line.color == alloc_a.line.color != held_b.line.color == alloc_b.line.color
    assert alloc_a.line.dash == "dot" and held_a.line.dash is None
    d = pd.DataFrame({"layer": [0, 0, 0, 0], "position": [0, 1, 2, 3], "token": list("abcd"),
                      "who": ["neither", "both", "a only", "b only"]})
    heat = pruning.disagreement_figure(d, ("x", "y"), "who")
    before, after = heat.data[0].colorscale, style.paper(heat).data[0].colorscale
    assert [v for v, _ in before] == [v for v, _ in after]   # the same bands
    colours = dict(zip(pruning.WHO_COLOURS, [c for _, c in after][::2]))
    assert colours["neither"] == pruning.WHO_COLOURS["neither"] and colours["both"] == pruning.WHO_COLOURS["both"]
    assert colours["a only"] == "#D55E00" and colours["b only"] == "#0072B2"   # Okabe-Ito's vermillion and blue


def test_the_paper_style_keeps_what_a_colour_per_bar_says():
    """The term bars colour each bar by its sign (red below 0, blue above) and the attribution bars by value on a
    centred scale: the paper style keeps both meanings (Okabe-Ito's vermillion and blue; RdBu)."""
    import pandas as pd

    from analysis import attribution, scores
    terms = pd.DataFrame({"term": ["dim 0", "dim 1", "beta"], "value": [-0.5, 0.25, 1.0]})
    bars = style.paper(scores.split_figure(terms, 12, "terms"))
    assert list(bars.data[0].marker.color) == ["#D55E00", "#0072B2", "#0072B2"]
    df = pd.DataFrame({"position": [0, 1, 2], "attribution": [-1.0, 0.5, 2.0], "token": list("abc")})
    attr = style.paper(attribution.attribution_figure(df, "attr"))
    assert list(attr.data[0].marker.color) == [-1.0, 0.5, 2.0]
    import plotly.colors
    assert [c for _, c in attr.data[0].marker.colorscale] == [c for _, c in plotly.colors.get_colorscale("RdBu")]
