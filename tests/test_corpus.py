"""Corpus-scale statistics (analysis.corpus, python -m analysis.reports.corpus): the drop rates by part of speech,
layer, position and token equal a direct count from the keep masks; the intervals are bootstrap intervals over
windows; the curve's cost is the pooled perplexity ratio; the command writes Parquet and figure specs that redraw,
resumes without redoing a finished window, and refuses another protocol's parts and existing files."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from analysis import corpus, pruning, render
from analysis.reports import corpus as command
from analysis.zoo import models_root
from tests.test_compact_cache import model_for

T, WINDOWS = 24, 5
TAGS = ["NOUN", "VERB", "DET", "PUNCT"]


def windows(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[int(i) for i in torch.randint(0, 61, (T,), generator=g)] for _ in range(WINDOWS)]


def tags_for(ids: list[int]) -> list[str]:
    return [TAGS[i % len(TAGS)] for i in ids]


def direct_count(runs: list[tuple[np.ndarray, list[int]]]) -> pd.DataFrame:
    """Straight from the masks: a token (not a window's last) is dropped by a row of a layer when the window's last
    query cannot see it (drops are permanent); its drop share is the mean over the layer's rows."""
    rows = []
    for w, (visible, ids) in enumerate(runs):
        for layer in range(visible.shape[0]):
            for j in range(T - 1):
                share = float((visible[layer, :, T - 1, j] == 0).mean())
                rows.append({"window": w, "layer": layer, "position": j, "token_id": ids[j],
                             "pos": tags_for(ids)[j], "share": share})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("method, budget", [(pruning.LEARNED, None), ("h2o", 8), ("tova-group", 6)])
def test_corpus_statistics_equal_a_direct_count(method, budget, monkeypatch):
    monkeypatch.setattr(corpus, "MIN_TOKEN_COUNT", 2)
    extra = {"n_kv_heads": 2} if method == "tova-group" else {}
    mixer = "gqa" if extra else "mha"
    model = model_for(mixer, prune=method == pruning.LEARNED, seed=3, context=64, n_layers=3, beta=0.0, **extra)
    runs, parts = [], []
    for w, ids in enumerate(windows()):
        visible, _, _ = pruning.method_run(model, ids, method, budget)
        runs.append((visible, ids))
        parts.append(corpus.window_rows(visible, ids, tags_for(ids)).assign(window=w))
    sums = [corpus.window_sums(part) for part in parts]   # (as the command reduces each window it reads)
    stats = corpus.statistics({t: pd.concat([x[t] for x in sums]) for t in corpus.TABLES}, resamples=200)
    assert_same_as_all_rows_at_once(stats, pd.concat(parts, ignore_index=True))
    want = direct_count(runs)
    assert 0.05 < want["share"].mean() < 0.95, "the method should drop some tokens and keep others"
    want["bucket"] = corpus.position_bucket(want["position"].to_numpy())
    for table, by in [("pos_layer", ["pos", "layer"]), ("layer", ["layer"]), ("pos", ["pos"]),
                      ("position", ["bucket"])]:
        got = stats[table].set_index(by).sort_index()
        direct = want.groupby(by)["share"].agg(["mean", "size"]).sort_index()
        np.testing.assert_allclose(got["drop_rate"], direct["mean"], rtol=1e-6, err_msg=table)
        assert (got["rows"] == direct["size"]).all(), table
        per_layer = 1 if "layer" in by else model.config.n_layers   # occurrences: tokens, not (layer, token) rows
        assert (got["occurrences"] * per_layer == direct["size"]).all(), table
        assert (got["windows"] == want.groupby(by)["window"].nunique().sort_index()).all(), table
        assert ((got["lo"] <= got["drop_rate"] + 1e-9) & (got["drop_rate"] <= got["hi"] + 1e-9)).all(), table
    common = want[want["layer"] == 0]["token_id"].value_counts()
    common = common[common >= 2].index
    assert len(common) > 3
    got = stats["token"].set_index("token_id").sort_index()
    direct = want[want["token_id"].isin(common)].groupby("token_id")["share"].mean().sort_index()
    np.testing.assert_allclose(got["drop_rate"], direct, rtol=1e-6)


def assert_same_as_all_rows_at_once(stats, rows):
    whole = corpus.statistics(corpus.window_sums(rows), resamples=200)
    for t in corpus.TABLES:
        pd.testing.assert_frame_equal(stats[t].reset_index(drop=True), whole[t].reset_index(drop=True))


def test_the_interval_is_a_bootstrap_over_windows():
    """Windows that agree give no spread; a group in fewer than MIN_WINDOWS windows gets no interval; windows that
    differ give an interval around the pooled rate that narrows as the same windows are seen more often."""
    def rows(shares: list[list[float]]) -> pd.DataFrame:
        return pd.DataFrame([{"window": w, "layer": 0, "position": j, "token_id": j, "pos": "X", "drop_share": x}
                             for w, xs in enumerate(shares) for j, x in enumerate(xs)])

    same = corpus.statistics(corpus.window_sums(rows([[1, 0]] * 8)), resamples=100)["layer"]
    assert same["drop_rate"][0] == 0.5 and same["lo"][0] == same["hi"][0] == 0.5
    few = corpus.statistics(corpus.window_sums(rows([[1, 0]] * 4)), resamples=100)["layer"]
    assert few["windows"][0] == 4 and np.isnan(few["lo"][0]) and np.isnan(few["hi"][0])
    mixed = [[1, 1], [1, 0], [0, 0], [1, 0], [0, 1], [1, 1], [0, 0], [1, 0]]
    narrow, wide = (corpus.statistics(corpus.window_sums(rows(m)), resamples=500)["layer"] for m in (mixed * 8, mixed))
    assert narrow["drop_rate"][0] == wide["drop_rate"][0] == pytest.approx(0.5)
    assert wide["lo"][0] < narrow["lo"][0] < 0.5 < narrow["hi"][0] < wide["hi"][0]


def test_the_curve_pools_perplexity_and_pairs_the_windows():
    m = pd.DataFrame({"run": ["dense"] * 3 + ["a"] * 3, "family": ["dense"] * 3 + ["learned"] * 3,
                      "budget": None, "window": [0, 1, 2] * 2, "nll": [10, 20, 30, 12, 21, 33.0],
                      "tokens": [10] * 6, "hidden": [0, 0, 0, 5, 6, 7.0], "nll_late": 0.0, "tokens_late": 1,
                      "hidden_late": 0.0})
    c = corpus.curve(m, resamples=100).set_index("run")
    assert c.loc["dense", "cost"] == 0 and c.loc["dense", "cost_lo"] == c.loc["dense", "cost_hi"] == 0
    assert c.loc["a", "cost"] == pytest.approx(np.exp((66 - 60) / 30) - 1)
    assert c.loc["a", "sparsity"] == pytest.approx(18 / 30)
    assert c.loc["a", "perplexity"] == pytest.approx(np.exp(66 / 30))
    # a window only one run finished is left out of both
    extra = pd.concat([m, m.iloc[[3]].assign(window=3)])
    assert corpus.curve(extra, resamples=50).set_index("run").loc["a", "windows"] == 3
    # paired: a run that costs the same per token in every window has no spread, however the windows differ
    same = m.assign(nll=np.where(m["run"] == "a", m["nll"].to_numpy()[:3].tolist() * 2, m["nll"]) + np.where(
        m["run"] == "a", 0.2 * m["tokens"], 0))
    c = corpus.curve(same, resamples=200).set_index("run")
    assert c.loc["a", "cost_lo"] == pytest.approx(c.loc["a", "cost_hi"]) == pytest.approx(np.exp(0.2) - 1)


def test_both_reports_draw_the_same_windows_and_pool_the_same_cost():
    """analysis.bootstrap: the corpus report's counts are the matched report's draws (one seed, the same windows),
    and a resample's cost pooled from counts equals the cost of its drawn windows' sums."""
    from analysis import bootstrap
    idx, w = bootstrap.draws(7, 40, seed=3), bootstrap.counts(7, 40, seed=3)
    assert np.array_equal(w, np.stack([np.bincount(d, minlength=7) for d in idx])) and (w.sum(1) == 7).all()
    rng = np.random.default_rng(0)
    nll, dnll, tok = rng.uniform(50, 60, 7), rng.uniform(40, 50, 7), rng.integers(20, 30, 7).astype(float)
    by_idx = bootstrap.cost(nll[idx].sum(-1), dnll[idx].sum(-1), tok[idx].sum(-1))
    np.testing.assert_allclose(bootstrap.cost(w @ nll, w @ dnll, w @ tok), by_idx, rtol=1e-12)
    assert bootstrap.cost(nll.sum(), dnll.sum(), tok.sum()) == pytest.approx(np.exp((nll - dnll).sum() / tok.sum()) - 1)
    lo, hi = bootstrap.interval(by_idx)
    assert lo == np.percentile(by_idx, 2.5) and hi == np.percentile(by_idx, 97.5)


@pytest.fixture
def text_source(tmp_path):
    return write_texts(tmp_path / "texts")


def write_texts(src: Path) -> Path:
    """Three short documents of a user's own corpus."""
    src.mkdir()
    words = "the harbour was quiet and the bridge stood over the river while ships came in slowly . ".split()
    for i in range(3):
        (src / f"doc{i}.txt").write_text(" ".join(words[(i + k) % len(words)] for k in range(400)))
    return src


def args_for(out, src, parts=None, **extra):
    argv = [str(models_root() / "mha-1024-pruned"), "--base", str(models_root() / "mha-1024"),
            "--source", f"own={src}", "--window", "32", "--windows", "6", "--policies", "h2o,streamingllm",
            "--budgets", "8,16", "--resamples", "50", "--formats", "png", "--out", str(out)]
    if parts:
        argv += ["--parts", str(parts)]
    for k, v in extra.items():
        argv += [f"--{k}", str(v)] if v is not True else [f"--{k}"]
    return argv


def test_the_command_writes_parquet_and_figures_and_resumes(tmp_path, text_source, monkeypatch, capsys):
    out, parts = tmp_path / "out", tmp_path / "parts"
    calls = []
    real = command.one_window
    monkeypatch.setattr(command, "one_window", lambda *a: calls.append(a[3]["run"]) or real(*a))
    assert command.main(args_for(out, text_source, parts)) == 0
    assert len(calls) == 6 * (1 + 1 + 4)     # windows x (learned, dense, 2 policies x 2 budgets)
    report = corpus.read_report(out)
    c = report["curves"].set_index("run")
    assert set(c.index) == {"mha-1024-pruned", "dense", "h2o@8", "h2o@16", "streamingllm@8", "streamingllm@16"}
    assert c.loc["dense", "cost"] == 0 and (c["windows"] == 6).all()
    assert {"token", "token_id"} <= set(report["stats"]["token"].columns)
    man = json.loads((out / "corpus.json").read_text())
    assert man["models"]["base"]["checkpoint_sha256"] and man["sources"]["own"]["windows"] == 6
    run = "mha-1024-pruned_own"
    assert {p.stem for p in out.glob("corpus_*.json")} == {"corpus_curve_own", f"corpus_pos_layer_{run}",
                                                           f"corpus_layers_{run}", f"corpus_position_{run}",
                                                           f"corpus_tokens_{run}"}   # the page's figures
    pos = report["stats"]["pos"]
    assert set(pos["run"]) == set(c.index) - {"dense"} and (pos["rows"] > 0).all()
    assert (pos.groupby("run")["occurrences"].sum() == 6 * 31).all()   # 6 windows x 31 tokens (the last left out)
    spec = out / "corpus_curve_own.json"
    assert [m["name"] for m in json.loads(spec.read_text())["models"]] == ["base", "mha-1024-pruned"]
    redrawn = render.load_figure(spec)
    assert redrawn.data[0].x is not None and (out / "corpus_curve_own.png").is_file()
    assert "| dense |" in (out / "report.md").read_text()

    # a stop: one run's last window lost its line (and a line cut short); the rerun redoes only that window
    log = parts / "own" / "h2o@8" / "windows.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[:-1]) + '\n{"window": 5, "nl')
    calls.clear()
    assert command.main(args_for(out, text_source, parts)) == 2      # the report is there: refused
    assert "--force" in capsys.readouterr().err and not calls
    assert command.main(args_for(out, text_source, parts, force=True)) == 0
    assert calls == ["h2o@8"]
    again = corpus.read_report(out)["curves"].set_index("run")
    pd.testing.assert_frame_equal(again.drop(columns=[]), c)

    # another protocol's parts are refused, not mixed in: another window, or the same window on other text
    assert command.main(args_for(tmp_path / "other", text_source, parts, window=16)) == 2
    assert "another protocol" in capsys.readouterr().err
    (text_source / "doc0.txt").write_text("a different text " * 200)
    assert command.main(args_for(tmp_path / "other", text_source, parts)) == 2
    assert "sources" in capsys.readouterr().err

    # parts computed on another device, or parts with no protocol at all, are refused too
    protocol = json.loads((parts / "protocol.json").read_text())
    (parts / "protocol.json").write_text(json.dumps(protocol | {"precision": {"device": "cuda", "dtype": "float32"}}))
    assert command.main(args_for(tmp_path / "other2", text_source, parts)) == 2
    assert "precision" in capsys.readouterr().err
    (parts / "protocol.json").unlink()
    assert command.main(args_for(tmp_path / "other2", text_source, parts)) == 2
    assert "no protocol.json" in capsys.readouterr().err

    # a report rewritten by halves (a table replaced after its manifest) is refused by the reader
    pd.DataFrame(report["stats"]["pos"]).head(3).to_parquet(out / "stats_pos.parquet")
    with pytest.raises(corpus.ReportError, match="by halves"):
        corpus.read_report(out)


@pytest.mark.parametrize("change, message", [({"policies": "snapkv"}, "after a prompt"),
                                             ({"budgets": "8,x"}, "whole numbers"),
                                             ({"windows": 0}, "at least 1"),
                                             ({"formats": "gif"}, "gif"),
                                             ({"resamples": 0}, "at least 1"),
                                             ({"source": "x=data/smollm2:train"}, "trained on that split"),
                                             ({"window": 4096}, "context")])
def test_the_command_refuses_bad_input_before_running(tmp_path, text_source, change, message, capsys):
    assert command.main(args_for(tmp_path / "out", text_source, **change)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_dense_model_given_as_pruned_and_a_missing_source_are_refused(tmp_path, capsys):
    argv = [str(models_root() / "mha-1024"), "--base", str(models_root() / "mha-1024"), "--source",
            f"x={tmp_path / 'none.txt'}", "--out", str(tmp_path / "out")]
    assert command.main(argv) == 2 and "does not prune" in capsys.readouterr().err
    argv[0] = str(models_root() / "mha-1024-pruned")
    assert command.main(argv) == 2 and "not found" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    """A report of the zoo's pruned MHA and its dense base on three short texts (what the page reads)."""
    root = tmp_path_factory.mktemp("corpus")
    assert command.main(args_for(root / "reports" / "small", write_texts(root / "texts"))) == 0
    return root / "reports"


def test_the_corpus_page_draws_a_report_and_says_what_is_wrong_with_a_bad_one(small_report, monkeypatch):
    from streamlit.testing.v1 import AppTest
    page = str(Path(__file__).resolve().parent.parent / "app" / "views" / "8_Corpus.py")
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(small_report))
    at = AppTest.from_file(page, default_timeout=120).run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert len(titles) == 5 and titles[1].startswith("mha-1024-pruned on own")
    at.sidebar.selectbox(key="corpus_run").set_value("h2o@8").run()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert not at.exception and titles[1].startswith("h2o@8")
    bad = small_report / "broken"
    bad.mkdir()
    for f in corpus.REPORT_FILES:
        (bad / f).write_bytes((small_report / "small" / f).read_bytes())
    pd.DataFrame({"x": [1]}).to_parquet(bad / "curves.parquet")   # not a curve table
    at = AppTest.from_file(page, default_timeout=120)
    at.session_state["corpus_report"] = str(bad)
    at.run()
    assert not at.exception and "not a corpus report" in at.error[0].value
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(small_report / "nothing here"))
    at = AppTest.from_file(page, default_timeout=120).run()
    assert not at.exception and "No corpus report" in at.info[0].value


def test_in_serve_mode_the_corpus_page_names_no_server_path(small_report, monkeypatch):
    """A shared server's users see a report as <corpus N>/its place, and neither the roots, the command (its paths)
    nor the 'looked in' message."""
    from streamlit.testing.v1 import AppTest
    page = str(Path(__file__).resolve().parent.parent / "app" / "views" / "8_Corpus.py")
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(small_report))
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    at = AppTest.from_file(page, default_timeout=120).run()
    assert not at.exception
    box = at.sidebar.selectbox(key="corpus_report")
    assert "<corpus 1>/small" in box.options and all(o.startswith("<corpus 1>/") for o in box.options)
    shown = " ".join([c.value for c in at.caption] + [m.value for m in at.markdown])
    assert str(small_report) not in shown and "--base" not in shown
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(small_report / "nothing here"))
    at = AppTest.from_file(page, default_timeout=120).run()
    assert str(small_report) not in at.info[0].value
