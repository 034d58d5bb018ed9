"""The Pruning, Generate and Corpus pages draw their figures through analysis.pruning_figures, generation_figures and
corpus_figures, and `mixscope export` draws them from the same functions: for the same model, text and settings, the
figures a page exports (caught at app.common.export_buttons under AppTest) and the functions' Bundles are equal
specs, tables and sidecar settings; the command writes them as bundles and refuses to overwrite them."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from analysis import corpus, corpus_figures, export, generation_figures, pruning_figures
from analysis.zoo import models_root
from models import snapshots
from models.checkpoint import load_model_dir
from tests.test_app_pruning import pruned_zoo  # noqa: F401 (a fixture: a tiny pruned model and its dense base)

pytestmark = pytest.mark.full   # pages under AppTest and the command writing images (make test, not test-quick)

VIEWS = Path(__file__).resolve().parent.parent / "app" / "views"


def exported(monkeypatch, page: str, state: dict, then=None) -> tuple[AppTest, dict]:
    """The page run once with these widget values (its session state), then `then(at)`: {name: (figure, table, model
    dirs, text, settings)} of the last export of each figure."""
    import app.common
    caught = {}
    real = app.common.export_buttons

    def catch(fig, table, name, model_dir=None, text=None, settings=None, key=None, precision=None):
        caught[name] = (fig, table, model_dir, text, settings)
        return real(fig, table, name, model_dir, text, settings, key, precision)

    monkeypatch.setattr(app.common, "export_buttons", catch)
    at = AppTest.from_file(str(VIEWS / page), default_timeout=300)
    for key, value in state.items():
        at.session_state[key] = value
    at.run()
    if then is not None:
        then(at)
    assert not at.exception, at.exception
    return at, caught


def spec(fig) -> dict:
    return json.loads(fig.to_json())


def csv_of(table) -> bytes:
    return export.csv_bytes(table() if callable(table) else table)


def dirs(d):
    return {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) else str(d)


def assert_page_equals(caught: dict, bundles, model_dir, text) -> None:
    """Each figure the page exported is the Bundle of the same name: spec, CSV, settings, models and text."""
    assert list(caught) == [b.name for b in bundles]
    for b in bundles:
        fig, table, page_dirs, page_text, settings = caught[b.name]
        assert spec(fig) == spec(b.fig), b.name
        assert csv_of(table) == csv_of(b.table), b.name
        assert settings == b.settings, b.name
        assert dirs(page_dirs) == dirs(b.models or model_dir) and page_text == text, b.name


def snapshot(model_dir: Path, step: int, alpha: float, beta: float) -> None:
    """A training snapshot of the rule (models.snapshots.save), its betas set to `beta`."""
    model = load_model_dir(model_dir).model
    rule = {n: p.detach().clone() for n, p in model.named_parameters() if ".pruning." in n}
    for n in rule:
        if n.endswith(".beta"):
            rule[n].fill_(beta)
    snapshots.save(model_dir, rule, step, {"alpha": alpha, "tokens_seen": 64 * step})


def test_the_pruning_pages_figures_are_the_functions(pruned_zoo, monkeypatch):   # noqa: F811
    """Every view of the page on (the learned rule, the why view, a forced drop, the run's snapshots, TOVA beside it,
    every policy): what it exports is pruning_figures.page_figures with the same settings."""
    from app.common import SAMPLE_TEXT
    model_dir = pruned_zoo / "pruned"
    snapshot(model_dir, 0, 1.0, 0.5)
    snapshot(model_dir, 2, 8.0, 0.0)
    _, caught = exported(monkeypatch, "7_Pruning.py", {
        "prune_scores": True, "prune_iv": True, "prune_iv_token": 3, "prune_iv_keep": "dropped",
        "prune_timeline": True, "prune_compare": "tova", "prune_all": True})
    loaded = load_model_dir(model_dir)
    bundles = pruning_figures.page_figures(loaded, SAMPLE_TEXT, scores_view=True, force=(3, False, 4, False),
                                           timeline_view=True, compare="tova", every=True)
    assert [b.name for b in bundles] == [
        "pruning_tokens_by_layer", "pruning_pos_by_layer", "pruning_triggers", "pruning_scores", "pruning_score_terms",
        "pruning_soft_keep", "pruning_what_if", "pruning_timeline", "pruning_timeline_layers", "pruning_timeline_pos",
        "pruning_disagreement", "pruning_pos_profile", "pruning_pos_profile_all"]
    assert_page_equals(caught, bundles, model_dir, SAMPLE_TEXT)
    assert bundles[-1].settings["method"] == "learned" and bundles[7].settings["snapshot_step"] == 2
    # a dense model opens on the first policy at a quarter of the window; a policy has no triggers figure
    _, caught = exported(monkeypatch, "7_Pruning.py", {"model": "base"})
    base = load_model_dir(pruned_zoo / "base")
    bundles = pruning_figures.page_figures(base, SAMPLE_TEXT)
    assert_page_equals(caught, bundles, base.path, SAMPLE_TEXT)
    assert bundles[0].settings["method"] == "streamingllm" and bundles[0].settings["budget"] > 0


def generate(at: AppTest, n: int, greedy: bool = False) -> None:
    at.number_input(key="gen_n").set_value(n)
    at.checkbox(key="gen_greedy").set_value(greedy)
    at.button(key="gen_go").click().run()


def test_the_generate_pages_figures_are_the_functions_of_its_generation(monkeypatch):
    """The page's figures are generation_figures.figures of the generation it kept; the command's generation
    (generation_figures.generate, same prompt and settings) makes the same tokens, drops and caches, so its figures
    are the page's but for the latencies measured."""
    name = "mha-1024-pruned"
    at, caught = exported(monkeypatch, "1_Generate.py", {"model": name}, then=lambda at: generate(at, 8))
    saved = at.session_state["gen_result"]
    loaded = load_model_dir(models_root() / name)
    bundles = generation_figures.figures(saved, loaded.tokenizer, loaded.config.mixer)
    assert_page_equals(caught, bundles, saved["runs"][0][0], generation_figures.PROMPT)
    twin, why = generation_figures.load_twin(loaded)
    assert why is None and saved["labels"] == ["pruned", "dense twin"]
    again = generation_figures.generate([("pruned", loaded), ("dense twin", twin)], generation_figures.PROMPT, 8,
                                        settings=generation_figures.sampling())
    for (_, res, tr), (_, page_res, page_tr) in zip(again["runs"], saved["runs"]):
        assert res.new_ids == page_res.new_ids and res.drops == page_res.drops
        assert [s["held_bytes"] for s in tr["steps"]] == [s["held_bytes"] for s in page_tr["steps"]]
    mine = generation_figures.figures(again, loaded.tokenizer, loaded.config.mixer)
    for b, page in zip(mine, bundles):
        if b.name == "generation_latency_steps":   # (the model time of each step: measured anew)
            got, want = spec(b.fig), spec(page.fig)
            for trace in (*got["data"], *want["data"]):
                trace.pop("y")
            assert got == want
        else:
            assert spec(b.fig) == spec(page.fig) and b.settings == page.settings, b.name


def test_a_dense_generation_draws_its_latency_from_the_same_function(monkeypatch):
    at, caught = exported(monkeypatch, "1_Generate.py", {"model": "mha"}, then=lambda at: generate(at, 4, True))
    saved = at.session_state["gen_result"]
    loaded = load_model_dir(models_root() / "mha")
    bundles = generation_figures.figures(saved, loaded.tokenizer, loaded.config.mixer)
    assert [b.name for b in bundles] == ["generation_latency"] and bundles[0].settings == {"max_new_tokens": 4}
    assert_page_equals(caught, bundles, saved["runs"][0][0], generation_figures.PROMPT)


def write_report(out: Path) -> Path:
    """A small corpus report as analysis.reports.corpus writes one (its tables, and a manifest naming their hashes):
    a learned rule, two policies and the dense base on one source."""
    out.mkdir(parents=True)
    runs = {"rule": ("learned", None, 0.62), "h2o@8": ("h2o", 8, 0.55), "tova@8": ("tova", 8, 0.5),
            "tova@16": ("tova", 16, 0.3), "dense": ("dense", None, 0.0)}
    curves = pd.DataFrame([{"run": r, "family": f, "budget": b, "source": "own", "windows": 6, "sparsity": s,
                            "perplexity": 20 + 10 * s, "cost": s / 2, "cost_lo": s / 3, "cost_hi": s / 1.5}
                           for r, (f, b, s) in runs.items()])
    rng = np.random.default_rng(0)

    def stats(keys: list[dict]) -> pd.DataFrame:
        rows = []
        for r, (f, _, _) in runs.items():
            if r == "dense":
                continue
            for k in keys:
                rate = float(rng.random())
                rows.append({"run": r, "family": f, "source": "own", "occurrences": 80, "rows": 160, "windows": 6,
                             "drop_rate": rate, "lo": rate * 0.9, "hi": min(1.0, rate * 1.1), **k})
        return pd.DataFrame(rows)

    tables = {"curves": curves,
              "stats_layer": stats([{"layer": i} for i in range(2)]),
              "stats_pos_layer": stats([{"pos": p, "layer": i} for p in ("NOUN", "VERB") for i in range(2)]),
              "stats_pos": stats([{"pos": p} for p in ("NOUN", "VERB")]),
              "stats_position": stats([{"bucket": b, "positions": corpus.bucket_label(b)} for b in range(4)]),
              "stats_token": stats([{"token_id": i, "token": t} for i, t in enumerate(["the", "river"])])}
    for name, table in tables.items():
        table.to_parquet(out / f"{name}.parquet")
    files = {f"{n}.parquet": hashlib.sha256((out / f"{n}.parquet").read_bytes()).hexdigest() for n in tables}
    entry = {"model_dir": "runs/rule", "checkpoint_sha256": "ab" * 32, "base": None}
    (out / "corpus.json").write_text(json.dumps({
        "command": "python -m analysis.reports.corpus runs/rule --base runs/base", "window": 32,
        "precision": {"device": "cpu", "dtype": "float32"}, "sources": {"own": {"windows": 6}}, "files": files,
        "models": {"base": entry | {"model_dir": "runs/base", "checkpoint_sha256": "cd" * 32}, "rule": entry}}))
    return out


def test_the_corpus_pages_figures_are_the_functions(tmp_path, monkeypatch):
    report = write_report(tmp_path / "reports" / "small")
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(tmp_path / "reports"))
    _, caught = exported(monkeypatch, "8_Corpus.py", {})
    rep = corpus.read_report(report)
    bundles = corpus_figures.page_figures(rep, str(report))
    assert [b.name for b in bundles][1] == "corpus_pos_layer_rule_own"   # the sparsest learned run
    assert bundles[2].settings["runs"] == ["rule", "h2o@8", "tova@8"]      # beside it: the nearest of each policy
    assert_page_equals(caught, bundles, None, None)


def test_the_command_writes_the_pages_figures_and_refuses_to_overwrite(pruned_zoo, tmp_path, monkeypatch,  # noqa: F811
                                                                      capsys):
    """`mixscope export MODEL --text F --report R`: the model's pages, the Pruning page (with the views asked for),
    the Generate page and the Corpus page, each bundle's sidecar as the functions give it; run again, it refuses."""
    report = write_report(tmp_path / "report")
    text = tmp_path / "t.txt"
    text.write_text("The bridge over the river was finished in the spring, and the town was glad of it at last.")
    out = tmp_path / "out"
    model_dir = pruned_zoo / "pruned"
    args = [str(model_dir), "--text", str(text), "--out", str(out), "--format", "svg", "--report", str(report),
            "--scores", "--compare", "h2o", "--max-new-tokens", "4", "--greedy"]
    assert export.main(args) == 0, capsys.readouterr().err
    loaded = load_model_dir(model_dir)
    content = text.read_text()
    pruning = pruning_figures.page_figures(loaded, content, scores_view=True, compare="h2o")
    corpus_bundles = corpus_figures.page_figures(corpus.read_report(report), str(report))
    stems = {p.name.rsplit(".", 1)[0] for p in out.iterdir()}
    assert {b.name for b in pruning + corpus_bundles} | {"maps_overview", "surprisal", "generation_strip",
                                                         "generation_cache", "generation_latency_steps"} <= stems
    assert {p.suffix for p in out.iterdir()} == {".svg", ".csv", ".json"}
    for b in pruning + corpus_bundles:
        side = json.loads((out / f"{b.name}.json").read_text())
        assert side["settings"] == json.loads(json.dumps(b.settings)), b.name
        assert side["plotly"] == spec(b.fig), b.name
        assert (out / f"{b.name}.csv").read_bytes() == csv_of(b.table), b.name
    side = json.loads((out / "generation_cache.json").read_text())
    assert [m["name"] for m in side["models"]] == ["pruned · pruned", "dense twin · base"]   # the page's twin
    assert side["text_sha256"] == hashlib.sha256(generation_figures.PROMPT.encode()).hexdigest()
    assert json.loads((out / "corpus_curve_own.json").read_text())["models"][0]["name"] == "base"
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert export.main(["--report", str(report), "--out", str(out), "--format", "svg"]) == 2   # (corpus alone)
    assert "would be overwritten" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("args, message", [
    (["--figures", "corpus"], "--report"),
    (["--figures", "pruning", "--method", "h2o", "--scores"], "the learned rule's"),
    (["--figures", "pruning", "--method", "nope"], "unknown eviction policy"),
    (["--figures", "pruning", "--at", "3"], "give --drop"),
    (["--figures", "generate", "--evict", "oracle"], "--evict oracle"),
    (["--figures", "maps"], "choose from model, pruning, generate, corpus"),
])
def test_the_command_says_what_is_wrong(pruned_zoo, tmp_path, capsys, args, message):   # noqa: F811
    text = tmp_path / "t.txt"
    text.write_text("The bridge over the river.")
    code = export.main([str(pruned_zoo / "pruned"), "--text", str(text), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and not (tmp_path / "o").exists()


def test_the_command_refuses_an_extractor_and_a_pruning_window_over_budget_before_loading(tmp_path, monkeypatch,
                                                                                          capsys):
    from analysis import budgets, views
    from models.memory import RUNTIME_BYTES, planned_weights
    text = tmp_path / "t.txt"
    text.write_text("The bridge over the river.")
    argv = ["--text", str(text), "--out", str(tmp_path / "o"), "--figures", "pruning"]
    assert export.main([str(models_root() / "we"), *argv]) == 2
    assert "Extractor" in capsys.readouterr().err
    path = models_root() / "mha-1024-pruned"
    cfg = budgets.config_of(path)
    need = planned_weights(cfg) + RUNTIME_BYTES + budgets.method_run_bytes(cfg, views.PRUNING_VIEW)
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", str(need // 2**20 - 1))

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("models.checkpoint.load_model_dir", no_load)
    assert export.main([str(path), *argv]) == 2
    assert "the Pruning page's figures over its 1024-token window" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
