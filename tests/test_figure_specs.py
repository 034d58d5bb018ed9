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


# pages whose figures come named from analysis/ (the module naming them, as the command line draws them too)
NAMED_BY = {"1_Generate.py": "generation_figures", "7_Pruning.py": "pruning_figures", "8_Corpus.py": "corpus"}


def test_no_two_kinds_of_figure_share_an_export_name():
    """A name is a figure kind: two export_buttons calls in the views, or two Bundles the pages' figure modules make,
    never give the same literal name (or the same literal start of a formatted one), so a download never stands for
    another figure."""
    import ast
    seen = {}

    def literal(name, where):
        if isinstance(name, ast.JoinedStr):   # f"heads_pca_{...}": its literal start
            name = name.values[0]
        assert isinstance(name, ast.Constant), (where, ast.dump(name))
        assert name.value not in seen, (name.value, where, seen.get(name.value))
        seen[name.value] = where

    for page in sorted(VIEWS.glob("*.py")):
        for node in ast.walk(ast.parse(page.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "export_buttons":
                name = node.args[2]
                if isinstance(name, ast.Attribute):   # a Bundle's name, from the page's module in analysis/
                    assert page.name in NAMED_BY, page.name
                    continue
                literal(name, page.name)
    analysis = VIEWS.parents[1] / "analysis"
    for module in sorted(set(NAMED_BY.values()) - {"corpus"}):   # (corpus.page_figures' names: tested there)
        calls = [node for node in ast.walk(ast.parse((analysis / f"{module}.py").read_text()))
                 if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Bundle"]
        assert calls, module
        for node in calls:
            literal(node.args[0], module)
    assert len(seen) >= 30 and {"pruning_what_if", "generation_strip"} <= set(seen)


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


# ---- every figure builder draws text it did not write as text -----------------------------------------------------

# what a token, a model's directory, a card field or a report's run could hold: a CSS url() in a tag's style, MathJax,
# a Markdown image naming a URL
HOSTILE = ['<span style="background:url(http://x)">', "$x$", "![a](http://x/y.png)"]
# functions that return figures but build none from strings: they restyle, draw or read back a figure already built
NOT_BUILDERS = {"analysis.style.paper": "restyles a built figure (its strings are the builder's)",
                "analysis.export.figure_bytes": "draws a built figure, refusing its spec (spec_refusal) first"}


def figure_builders() -> set[str]:
    """Every function in analysis/ that builds a plotly figure: it returns one (its annotation says Figure) or its
    source makes one (go.Figure(, px.*(, make_subplots()."""
    import importlib
    import inspect
    import re

    import analysis
    root = Path(analysis.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        module = importlib.import_module(".".join(path.relative_to(root.parent).with_suffix("").parts))
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                made = re.search(r"\bgo\.Figure\(|\bpx\.\w+\(|make_subplots\(", inspect.getsource(fn))
                if made or "Figure" in str(fn.__annotations__.get("return", "")):
                    found.add(f"{module.__name__}.{name}")
    return found - set(NOT_BUILDERS)


def hostile_tokens(n: int) -> list[str]:
    return [HOSTILE[i % len(HOSTILE)] + f" {i}" for i in range(n)]


HEADING = " ".join(HOSTILE)   # a title that names all three (as a model's name in a page's title would)


def token_table(n_layers: int = 2, t: int = 6, seed: int = 0):
    """analysis.pruning.token_table of random keep masks over hostile tokens, tagged with hostile parts of speech."""
    import numpy as np

    from analysis import pruning
    keeps = np.tril(np.random.default_rng(seed).random((n_layers, t, t)) > 0.4)
    keeps[:, np.arange(t), np.arange(t)] = True
    return pruning.token_table(keeps, hostile_tokens(t), [HOSTILE[i % 3] for i in range(t)])


def corpus_report():
    """A report as analysis.corpus.page_figures reads it, with hostile sources, runs and tokens."""
    import pandas as pd
    src, runs = HOSTILE[0], [HOSTILE[1], HOSTILE[2]]
    interval = {"drop_rate": 0.3, "lo": 0.2, "hi": 0.4, "occurrences": 60, "windows": 3, "source": src}
    stats = {"pos_layer": pd.DataFrame([{"run": r, "pos": p, "layer": layer, **interval}
                                        for r in runs for p in HOSTILE for layer in (0, 1)]),
             "layer": pd.DataFrame([{"run": r, "layer": layer, **interval} for r in runs for layer in (0, 1)]),
             "position": pd.DataFrame([{"run": r, "bucket": b, "positions": f"{2 ** b}-{2 ** (b + 1) - 1}",
                                        **interval} for r in runs for b in (0, 1)]),
             "token": pd.DataFrame([{"run": r, "token": h, "token_id": i, **interval}
                                    for r in runs for i, h in enumerate(HOSTILE)])}
    curves = pd.DataFrame([{"source": src, "run": runs[0], "family": "learned", "sparsity": 0.5, "cost": 0.1,
                            "cost_lo": 0.05, "cost_hi": 0.15, "budget": None},
                           {"source": src, "run": runs[1], "family": HOSTILE[0], "sparsity": 0.4, "cost": 0.2,
                            "cost_lo": 0.1, "cost_hi": 0.3, "budget": 8}])
    return {"curves": curves, "stats": stats}


def trace(n_layers: int = 2):
    """A generation trace (models.trace.build's shape): 3 prompt tokens, 3 generated, two drops."""
    steps = [{"step": s, "token": HOSTILE[s % 3], "held_bytes": 10 - s, "alloc_bytes": 16, "dense_bytes": 10 + s,
              "model_ms": 1.0 + s, "live_per_layer": [3] * n_layers} for s in range(3)]
    return {"prompt_ids": [1, 2, 3], "new_ids": [4, 5, 6], "n_layers": n_layers, "steps": steps,
            "drops": [{"layer": 0, "position": 0, "trigger": 3, "step": 1}, {"layer": 1, "position": 1, "trigger": 4,
                                                                            "step": 2}]}


def _maps_and_tokens():
    import numpy as np
    return np.random.default_rng(0).random((2, 2, 6, 6)), hostile_tokens(6)


def _corpus_cases():
    from analysis import corpus
    report = corpus_report()
    stats, runs = report["stats"], list(report["stats"]["layer"]["run"].unique())
    by_run = {t: {r: stats[t][stats[t]["run"] == r] for r in runs} for t in ("layer", "position")}
    return {
        "analysis.corpus.pos_layer_figure": lambda: [corpus.pos_layer_figure(
            stats["pos_layer"][stats["pos_layer"]["run"] == runs[0]], HEADING)],
        "analysis.corpus._lines": lambda: [corpus._lines(by_run["layer"], "layer", HEADING, "layer")],
        "analysis.corpus.layer_figure": lambda: [corpus.layer_figure(by_run["layer"], HEADING)],
        "analysis.corpus.position_figure": lambda: [corpus.position_figure(by_run["position"], HEADING)],
        "analysis.corpus.token_figure": lambda: [corpus.token_figure(stats["token"], HEADING)],
        "analysis.corpus.curve_figure": lambda: [corpus.curve_figure(report["curves"], HEADING)],
        "analysis.corpus.page_figures": lambda: [f for _, f, *_ in corpus.page_figures(report, HOSTILE[0],
                                                                                          runs[0], [runs[1]])],
    }


def _heads_cases():
    import numpy as np
    import pandas as pd

    from analysis import heads
    rng = np.random.default_rng(0)
    geo = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "norm": rng.random(4), "pc1": rng.random(4),
                        "pc2": rng.random(4)})
    norms = pd.DataFrame({"kind": ["QK"] * 4, "layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "norm": rng.random(4)})
    return {
        "analysis.heads.pca_figure": lambda: [heads.pca_figure(geo, np.array([0.6, 0.3]), HEADING),
                                              heads.pca_figure(geo.assign(pc3=rng.random(4)),
                                                               np.array([0.5, 0.3, 0.1]), HEADING)],
        "analysis.heads.similarity_figure": lambda: [heads.similarity_figure(rng.random((4, 4)), 2, HEADING)],
        "analysis.heads.cosine_figure": lambda: [heads.cosine_figure(rng.random((2, 2, 8)), 1, HEADING)],
        "analysis.heads.norms_figure": lambda: [heads.norms_figure(norms, HEADING)],
    }


def _lags_cases():
    import numpy as np
    import pandas as pd

    from analysis import lags
    rng = np.random.default_rng(0)
    table = pd.DataFrame([{"layer": layer, "lag": k, "rms": rng.random(), "mean": rng.random() - 0.5,
                           "fro": rng.random()} for layer in (0, 1) for k in range(4)])
    return {
        "analysis.lags.profile_view": lambda: [lags.profile_view(table, mixer)[0] for mixer in ("we", "me", HEADING)],
        "analysis.lags.profile_figure": lambda: [lags.profile_figure(table, "fro", HEADING)],
        "analysis.lags.mean_rms_figure": lambda: [lags.mean_rms_figure(table, HEADING)],
        "analysis.lags.lag_channel_figure": lambda: [lags.lag_channel_figure(rng.random((4, 3)), HEADING)],
        "analysis.lags.cumulative_figure": lambda: [lags.cumulative_figure(table, HEADING)],
    }


def _pruning_cases():
    from types import SimpleNamespace

    from analysis import lab, pruning
    a, b = token_table(seed=0), token_table(seed=1)
    d = pruning.disagreement(a, b)
    runs = [SimpleNamespace(loaded=SimpleNamespace(config=SimpleNamespace(mixer="mha")), name=n, table=t,
                            method=n, budget=3, settings={},   # (a method's id, as a plug-in policy may name itself)
                            pos_rates=pruning.pos_drop_rates(t), triggers=pruning.trigger_counts(t))
            for n, t in ((HOSTILE[0], a), (HOSTILE[1], b))]
    return {
        "analysis.pruning.disagreement_figure": lambda: [pruning.disagreement_figure(d, HOSTILE[:2], HEADING)],
        "analysis.pruning.pos_profile_figure": lambda: [pruning.pos_profile_figure(
            pruning.pos_profile({HOSTILE[0]: a, HOSTILE[2]: b}), HEADING, subtitle=HEADING)],
        "analysis.pruning.pos_heatmap": lambda: [pruning.pos_heatmap(pruning.pos_drop_rates(a), HEADING)],
        "analysis.pruning.token_layer_figure": lambda: [pruning.token_layer_figure(a, HEADING)],
        "analysis.pruning.triggers_figure": lambda: [pruning.triggers_figure(pruning.trigger_counts(a), HEADING)],
        "analysis.lab._figure": lambda: [lab._figure(kind, runs)[0] for kind in lab.FIGURES],
    }


def _token_cases():
    import numpy as np
    import pandas as pd
    import torch

    from analysis import attribution, intervene, live, maps, scores, timeline, tokens
    m, labels = _maps_and_tokens()
    x = torch.randn(6, 6)
    fates = scores.fates(x, 0)
    terms = pd.DataFrame({"term": ["dim 0", "dim 1", "beta"], "value": [-0.5, 0.25, 1.0]})
    effects = pd.DataFrame({"position": range(5), "token": labels[:5], "next_token": labels[1:], "delta_logp": 0.1,
                            "kl": 0.2})
    surprisal = pd.concat([tokens.surprisal_table(labels, -np.random.default_rng(0).random(5), name)
                           for name in HOSTILE[:2]])
    generated = pd.DataFrame({"index": range(6), "latency_ms": 1.0, "token": labels})
    traces = {HOSTILE[0]: trace(), HOSTILE[2]: trace()}
    steps = pd.DataFrame({"step": [0, 10], "sparsity": [0.1, 0.5], "alpha": [1.0, 2.0], "sink_share": [1.0, 0.9]})
    layers = pd.DataFrame({"step": [0, 0, 10, 10], "layer": [0, 1, 0, 1], "sparsity": [0.1, 0.2, 0.4, 0.5]})
    return {
        "analysis.attribution.attribution_figure": lambda: [attribution.attribution_figure(
            attribution.attribution_table(np.linspace(-1, 1, 6), labels), HEADING)],
        "analysis.intervene.effect_figure": lambda: [intervene.effect_figure(effects, 2, HEADING)],
        "analysis.live.strip_figure": lambda: [live.strip_figure(trace(), 3, labels, HEADING)],
        "analysis.live.cache_curve_figure": lambda: [live.cache_curve_figure(traces, HEADING)],
        "analysis.live.latency_curve_figure": lambda: [live.latency_curve_figure(traces, HEADING)],
        "analysis.maps.overview_figure": lambda: [maps.overview_figure(m, "attention", HEADING)],
        "analysis.maps.map_figure": lambda: [maps.map_figure(m[0, 0], labels, HEADING)],
        "analysis.maps.difference_figure": lambda: [maps.difference_figure(m[0, 0], m[1, 1], labels, HEADING)],
        "analysis.scores.score_figure": lambda: [scores.score_figure(x, fates, 0, labels, HEADING)],
        "analysis.scores.split_figure": lambda: [scores.split_figure(terms, 12, HEADING)],
        "analysis.scores.soft_figure": lambda: [scores.soft_figure(scores.soft_keep(x, 2.0, 0), 0, labels, HEADING)],
        "analysis.timeline.steps_figure": lambda: [timeline.steps_figure(steps, 10, HEADING)],
        "analysis.timeline.layers_figure": lambda: [timeline.layers_figure(layers, 0, HEADING)],
        "analysis.tokens.surprisal_figure": lambda: [tokens.surprisal_figure(surprisal, HEADING)],
        "analysis.tokens.latency_figure": lambda: [tokens.latency_figure(generated, HEADING)],
    }


def _report_cases():
    import pandas as pd

    from analysis.reports import eviction, pruning as pruning_report
    whole = pd.DataFrame({"method": [HOSTILE[0], HOSTILE[2], HOSTILE[1]], "sparsity": [0.2, 0.5, 0.4],
                          "perplexity": [10.0, 12.0, 11.0]})
    buckets = pd.DataFrame({"method": [f"{HOSTILE[2]} 8", f"{HOSTILE[2]} 16"], "model": HOSTILE[:2],
                            "sparsity": [0.3, 0.6], "perplexity": [9.0, 9.5], "bucket": ["0-63", "64-127"]})

    def eviction_figures():
        """The report's two figures, caught where they would be drawn (dense and pruned models named hostilely)."""
        import tempfile
        from types import SimpleNamespace

        from analysis import export
        drawn, real = [], export.figure_bytes
        export.figure_bytes = lambda fig, fmt, scale=2.0: drawn.append(fig) or b""
        try:
            with tempfile.TemporaryDirectory() as out:
                args = SimpleNamespace(figure=f"{out}/curve.png", pos_figure=f"{out}/pos.png")
                eviction._figures(args, whole, pruning_profile(), 9.0, 0.5, HOSTILE[0], HOSTILE[1])
        finally:
            export.figure_bytes = real
        return drawn

    return {
        "analysis.reports.eviction.figure": lambda: [eviction.figure(whole, HEADING, dense=9.0)],
        "analysis.reports.eviction._figures": eviction_figures,
        "analysis.reports.pruning.figure": lambda: [pruning_report.figure(buckets)],
    }


def pruning_profile():
    from analysis import pruning
    return pruning.pos_profile({HOSTILE[0]: token_table(seed=0), HOSTILE[1]: token_table(seed=1)})


def _zoo_and_export_cases():
    import dataclasses

    import pandas as pd

    from analysis import export, text as text_module, zoo
    table = pd.DataFrame({"model": HOSTILE, "mixer": ["mha"] * 3, "attention params": [1e4, 2e4, 3e4],
                          "test ppl": [10.0, 11.0, 12.0], "total params": [1e5] * 3, "KV-cache bytes/token": [64] * 3,
                          "error": [None] * 3, "data": ["d"] * 3})

    def model_figures():
        """The command's figures of the zoo's MHA, with hostile tokens and a hostile decoded target."""
        from models.checkpoint import load_model_dir
        loaded = load_model_dir(zoo.models_root() / "mha")
        ids = text_module.tokenize(loaded.tokenizer, "The river rose over the old stone bridge.").ids
        hostile = text_module.Tokens(ids, hostile_tokens(len(ids)), [(0, 0)] * len(ids))

        class Decodes:   # the tokenizer, whose target token decodes to hostile text
            def __getattr__(self, name):
                return getattr(loaded.tokenizer, name)

            def decode(self, ids):
                return HEADING

        real = text_module.tokenize
        text_module.tokenize = lambda tok, text: hostile
        try:
            return [f for _, f, *_ in export.model_figures(dataclasses.replace(loaded, tokenizer=Decodes()), "x")]
        finally:
            text_module.tokenize = real

    return {"analysis.zoo.efficiency_figure": lambda: [zoo.efficiency_figure(table)],
            "analysis.export.model_figures": model_figures}


def builder_cases() -> dict:
    return {**_corpus_cases(), **_heads_cases(), **_lags_cases(), **_pruning_cases(), **_token_cases(),
            **_report_cases(), **_zoo_and_export_cases()}


def spec_strings(fig) -> list[str]:
    out, stack = [], [json.loads(fig.to_json())]
    while stack:
        obj = stack.pop()
        if isinstance(obj, str):
            out.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list):
            stack.extend(obj)
    return out


def test_every_figure_builder_in_analysis_has_a_hostile_case():
    """A new figure builder comes with a case below (or a reason in NOT_BUILDERS)."""
    builders, cases = figure_builders(), builder_cases()
    assert builders <= set(cases), sorted(builders - set(cases))


@pytest.mark.parametrize("builder", sorted(builder_cases()))
def test_each_figure_builder_draws_hostile_labels_as_text_once(builder):
    """Tokens, names, titles holding a CSS url() in a tag's style, MathJax and a Markdown image: the builder's spec
    passes analysis.plain.spec_refusal, shows each of them (as plotly_text writes it: drawn as its characters), and
    escapes none twice (no '&amp;': none of them holds an '&')."""
    from analysis.plain import plotly_text, spec_refusal, without_inert_template_parts
    figures = builder_cases()[builder]()
    assert figures, builder
    shown = []
    for fig in figures:
        assert spec_refusal(without_inert_template_parts(json.loads(fig.to_json()))) is None, builder
        strings = spec_strings(fig)
        assert not [s for s in strings if "&amp;" in s], (builder, [s for s in strings if "&amp;" in s][:3])
        shown += strings
    for h in HOSTILE:
        assert any(plotly_text(h) in s for s in shown), (builder, h)
