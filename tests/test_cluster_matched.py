"""The held-out protocol's parts and --ray (analysis.reports.matched, analysis.reports.cluster): a run keeps each
(source, run, window) under --parts; a window that fails is named while the rest go on, the command exits 1, and a
rerun computes only what is missing (phase two waits for the budgets of a source whose matched model lost a window);
parts of another protocol are refused; the default parts, beside the output, are gone once the report is written (a
directory kept there with --parts stays); the code that computed the windows is listed; and on a local 2-worker Ray
instance the same protocol gives the one-process run's tables and parts, a window failing on a worker is named and a
rerun redoes only it."""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.reports import cluster, matched
from analysis.reports.parts import commit_now, done_windows, write_window
from models.pruning import policies

ROOT = Path(__file__).resolve().parent.parent
MODELS = [str(ROOT / "assets/models/mha-1024-pruned"), "--base", str(ROOT / "assets/models/mha-1024")]
PHASE_ONE = 2 * 3                  # the dense base and the pruned model, 3 windows
PHASE_TWO = (2 + 3) * 3            # 2 step policies, then 3 after the prompt (h2o:prompt too), 3 windows each


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("heldout")
    np.save(d / "test.npy", np.random.default_rng(7).integers(0, 8192, 500).astype(np.uint16))
    return d


def argv(source: Path, out: Path, *more: str) -> list[str]:
    return [*MODELS, "--source", f"held={source}:test", "--window", "130", "--windows", "3",
            "--policies", "streamingllm,tova,h2o:prompt", "--prompt-share", "0.5",
            "--out", str(out / "m.md"), "--json", str(out / "m.json"), *more]


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory) -> Path:
    """The protocol in this process, at the Ray workers' one thread, its parts kept."""
    out = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert matched.main(argv(source, out, "--parts", str(out / "parts"))) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def results(out: Path) -> dict:
    return json.loads((out / "m.json").read_text())["results"]


def tova_budget(one_process: Path) -> int:
    return results(one_process)["held"]["budgets"]["tova"]


def assert_same_run(a: Path, b: Path) -> None:
    """The same results, report (but for the paths in its command line), parts and window lines."""
    assert results(a) == results(b)
    assert (a / "m.md").read_text().split("\n", 3)[3] == (b / "m.md").read_text().split("\n", 3)[3]
    parts = sorted(p.relative_to(a / "parts") for p in (a / "parts").rglob("*.parquet"))
    assert len(parts) == PHASE_ONE + PHASE_TWO
    assert parts == sorted(p.relative_to(b / "parts") for p in (b / "parts").rglob("*.parquet"))
    for p in parts:
        pd.testing.assert_frame_equal(pd.read_parquet(a / "parts" / p), pd.read_parquet(b / "parts" / p),
                                      check_exact=True, obj=str(p))
    for log in (a / "parts").rglob("windows.jsonl"):
        lines = [sorted(map(json.loads, f.read_text().splitlines()), key=lambda r: r["window"])
                 for f in (log, b / "parts" / log.relative_to(a / "parts"))]
        assert lines[0] == lines[1], log


def test_parts_hold_what_the_tables_pool(one_process, source):
    """Each part is its window's per-query values: the pruned model's row is its windows pooled, and each policy
    ran at the budget matched to that model's sparsity (over the queries after the prompt, in that reading)."""
    held = results(one_process)["held"]
    parts = one_process / "parts" / "held"
    assert sorted(p.name for p in parts.iterdir()) == sorted(
        ["dense", "mha-1024-pruned"] + [f"{n}@{b}" for n, b in held["budgets"].items()]
        + [f"{n}@{b}-after-65" for n, b in held["prompt"]["budgets"].items()])
    values = [matched.read_part(parts / "mha-1024-pruned", w) for w in range(3)]
    assert all(s.dtype == np.float32 and lp.dtype == np.float64 and len(lp) == 129 for s, lp in values)
    row = next(r for r in held["all"] if r["method"] == "mha-1024-pruned")
    assert row["sparsity"] == pytest.approx(sum(float(s.sum()) for s, _ in values) / (3 * 129), rel=1e-6)
    assert row["perplexity"] == pytest.approx(np.exp(-sum(lp.sum() for _, lp in values) / (3 * 129)), rel=1e-12)
    assert held["budgets"]["tova"] == policies.budget_for("tova", row["sparsity"], 129)
    assert held["computed_by"] == [commit_now()]   # (each window's line names its code; the report lists them)
    assert f"Code that computed the windows (commit): `{commit_now()}`" in (one_process / "m.md").read_text()
    after = sum(float(s[65:].sum()) for s, _ in values) / (3 * 64)
    assert held["prompt"]["budgets"]["h2o:prompt"] == policies.budget_for("h2o:prompt", after, 129, 65, first=65)


def test_a_failed_window_is_named_the_rest_go_on_and_a_rerun_redoes_only_what_is_missing(
        one_process, source, tmp_path, monkeypatch, capsys):
    ids = [matched.source_windows(f"{source}:test", 130, 3)[w] for w in range(3)]
    real, ran, fail = matched.window_part, [], {("mha-1024-pruned", 1)}

    def window_part(model, window_ids, run):
        key = (run["run"], ids.index(window_ids))
        ran.append(key)
        if key in fail:
            raise RuntimeError("out of memory (a test's)")
        return real(model, window_ids, run)

    monkeypatch.setattr(matched, "window_part", window_part)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # phase one loses the matched model's window 1: the policies' budgets on that source wait for it
        assert matched.main(argv(source, tmp_path)) == 1
        err = capsys.readouterr().err
        assert "matched: held mha-1024-pruned window 1 failed: RuntimeError: out of memory (a test's)" in err
        assert "1 window(s) failed, no report written" in err and "then the policies on held" in err
        assert len(ran) == PHASE_ONE and ran[-1] != ("mha-1024-pruned", 1), "the other windows went on"
        assert not (tmp_path / "m.md").exists() and not (tmp_path / "m.json").exists()
        assert (tmp_path / "m.parts" / "protocol.json").is_file()   # (the default parts stay for the rerun)

        # the rerun: that window, then phase two, where tova's window 2 fails and every other window goes on
        tova = f"tova@{tova_budget(one_process)}"
        ran.clear()
        fail = {(tova, 2)}
        assert matched.main(argv(source, tmp_path)) == 1
        err = capsys.readouterr().err
        assert f"matched: held {tova} window 2 failed" in err and "redoes only these" in err
        assert "then the policies" not in err
        assert ran[0] == ("mha-1024-pruned", 1) and len(ran) == 1 + PHASE_TWO

        ran.clear()
        fail = set()
        assert matched.main(argv(source, tmp_path)) == 0
        assert ran == [(tova, 2)]
    finally:
        torch.set_num_threads(threads)
    assert results(tmp_path) == results(one_process)
    assert not (tmp_path / "m.parts").exists(), "the default parts are removed once the report is written"


def test_parts_of_another_protocol_are_refused(one_process, source, tmp_path, capsys):
    parts = ["--parts", str(one_process / "parts")]
    other = argv(source, tmp_path, *parts)
    other[other.index("--windows") + 1] = "2"   # other windows of the same source
    assert matched.main(other) == 2
    assert "holds parts of another protocol (it differs in sources)" in capsys.readouterr().err
    other = argv(source, tmp_path, *parts)
    other[other.index("--base") + 1] = str(ROOT / "assets/models/mha-1024-pruned")   # another base
    assert matched.main(other) == 2
    assert "differs in models" in capsys.readouterr().err
    assert not (tmp_path / "m.md").exists()
    # other policies and another prompt share add runs beside the same parts: only theirs are computed
    before = set((one_process / "parts").rglob("*.parquet"))
    more = argv(source, tmp_path, *parts)
    more[more.index("--policies") + 1] = "streamingllm,h2o"
    more[more.index("--prompt-share") + 1] = "0"
    try:
        assert matched.main(more) == 0
        added = set((one_process / "parts").rglob("*.parquet")) - before
        assert {p.parent.name for p in added} == {f"h2o@{results(tmp_path)['held']['budgets']['h2o']}"}
    finally:   # (the module's parts as they were, for the tests after this one)
        added = set((one_process / "parts").rglob("*.parquet")) - before
        for log in {p.parent / "windows.jsonl" for p in added}:
            for p in log.parent.iterdir():
                p.unlink()
            log.parent.rmdir()


def test_only_a_parts_directory_the_run_made_at_its_default_place_is_removed(tmp_path):
    kept = tmp_path / "real.parts"   # (an earlier run's, kept there with --parts)
    write_window(kept / "held" / "dense", 0, pd.DataFrame({"sparsity": [0.0]}), {}, commit="abc")
    assert matched.default_parts(str(tmp_path / "real.md")) == kept
    matched.remove_parts(kept)
    assert done_windows(kept / "held" / "dense") == {0: {"window": 0, "commit": "abc"}}
    made = matched.default_parts(str(tmp_path / "m.json"))
    write_window(made / "held" / "dense", 0, pd.DataFrame({"sparsity": [0.0]}), {}, commit="abc")
    matched.remove_parts(made)
    assert not made.exists()


def test_ray_options_are_checked_before_anything_runs(source, tmp_path, monkeypatch, capsys):
    from analysis.reports import real   # (real passes --ray and --parts to the protocol; saved runs take neither)
    with pytest.raises(SystemExit):
        matched.main(argv(source, tmp_path, "--ray-workers", "2"))
    assert "go with --ray" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # --ray before the model directories: argparse takes one for the address
        matched.main(["--ray", *argv(source, tmp_path)])
    assert "not a Ray address" in capsys.readouterr().err
    dense = str(ROOT / "assets/models/mha-1024")
    with pytest.raises(SystemExit):   # (no pruned run: no held-out protocol for --ray to compute)
        real.main([dense, "--base", dense, "--source", f"held={source}:test", "--window", "130", "--windows", "3",
                   "--ray"])
    assert "needs a pruned run" in capsys.readouterr().err
    monkeypatch.setitem(__import__("sys").modules, "ray", None)   # (import ray raises ImportError)
    with pytest.raises(SystemExit):
        matched.main(argv(source, tmp_path, "--ray"))
    assert "pip install 'mixscope[cluster]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        real.main([*MODELS, "--matched", str(tmp_path / "m.json"), "--parts", str(tmp_path / "p"), "--ray"])
    assert "drop --parts, --ray" in capsys.readouterr().err


@pytest.mark.full
def test_on_ray_the_same_tables_and_parts_and_a_failed_window_is_redone_alone(
        one_process, source, tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    tova = f"held tova@{tova_budget(one_process)} window 2"
    real, sent, poison = cluster.submit, [], [tova]

    def submit(actor, part, sources, models):
        sent.append(str(part))
        if str(part) in poison:   # (a window that raises on its worker)
            poison.remove(str(part))
            part = cluster.Part(part.model, part.source, part.run | {"method": "no-such-policy"}, part.window)
        return real(actor, part, sources, models)

    monkeypatch.setattr(cluster, "submit", submit)
    run = argv(source, tmp_path, "--parts", str(tmp_path / "parts"), "--ray", "--ray-workers", "2",
               "--ray-threads", "1")
    assert matched.main(run) == 1
    err = capsys.readouterr().err
    assert "2 Ray workers" in err and f"matched: {tova} failed: " in err and "no-such-policy" in err
    assert len(sent) == PHASE_ONE + PHASE_TWO and "1 window(s) failed" in err
    assert len(list((tmp_path / "parts").rglob("*.parquet"))) == PHASE_ONE + PHASE_TWO - 1
    sent.clear()
    assert matched.main(run) == 0
    assert sent == [tova]
    protocol = json.loads((tmp_path / "parts" / "protocol.json").read_text())
    assert protocol == json.loads((one_process / "parts" / "protocol.json").read_text())
    assert_same_run(one_process, tmp_path)
