"""The corpus report on Ray (`--ray`, analysis.reports.cluster): docs/cluster.md's local example, run as written on a
local 2-worker Ray instance, gives the same parts and report as one process; a worker killed mid-run loses only its
window, the command names it and exits 1, and a rerun redoes only that window and gives the same report; workers are
laid out to fit the nodes; a worker never goes back to a model it left; without Ray, --ray says how to install it,
and nothing but --ray imports Ray."""
import ast
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
from collections import deque
from pathlib import Path

import pandas as pd
import pytest
import torch

from analysis.reports import cluster
from analysis.reports import corpus as command

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cluster.md"
KILLED = "methods h2o@16 window 3"


def doc_example() -> list[str]:
    """The local example of docs/cluster.md, as its arguments (the command after `python -m`)."""
    blocks = re.findall(r"```\n(python -m analysis\.reports\.corpus .*?)```", DOC.read_text(encoding="utf-8"), re.S)
    local = [b for b in blocks if "--ray --ray-workers" in b]
    assert len(local) == 1, "docs/cluster.md has one local example"
    return shlex.split(local[0].replace("\\\n", " "))[3:]


def with_out(argv: list[str], out: Path, ray: bool = True) -> list[str]:
    """argv writing to `out`; without its --ray options when ray is False."""
    argv = list(argv)
    argv[argv.index("--out") + 1] = str(out)
    if not ray:
        argv.remove("--ray")
        for option in ("--ray-workers", "--ray-threads"):
            at = argv.index(option)
            del argv[at:at + 2]
    return argv


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The example's protocol in this process, at the workers' one thread."""
    out = tmp_path_factory.mktemp("cluster") / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert command.main(with_out(doc_example(), out, ray=False)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def assert_same_report(a: Path, b: Path) -> None:
    """The same tables, report text (but for --out), parts and window lines."""
    for f in sorted(a.glob("*.parquet")):
        pd.testing.assert_frame_equal(pd.read_parquet(f), pd.read_parquet(b / f.name), check_exact=True, obj=f.name)
    assert (a / "report.md").read_text().replace(str(a), "OUT") == (b / "report.md").read_text().replace(str(b), "OUT")
    parts = sorted(p.relative_to(a) for p in (a / "parts").rglob("*.parquet"))
    assert parts and parts == sorted(p.relative_to(b) for p in (b / "parts").rglob("*.parquet"))
    for p in parts:
        pd.testing.assert_frame_equal(pd.read_parquet(a / p), pd.read_parquet(b / p), check_exact=True, obj=str(p))
    for log in (a / "parts").rglob("windows.jsonl"):
        lines = [sorted(map(json.loads, f.read_text().splitlines()), key=lambda r: r["window"])
                 for f in (log, b / log.relative_to(a))]
        assert lines[0] == lines[1], log


@pytest.mark.full
def test_the_docs_local_example_gives_the_one_process_report(one_process, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "ray"
    res = subprocess.run([sys.executable, "-m", "analysis.reports.corpus", *with_out(doc_example(), out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 Ray workers" in res.stderr
    protocol = json.loads((out / "parts" / "protocol.json").read_text())
    assert protocol["precision"] == {"device": "cpu", "dtype": "float32"}
    assert protocol == json.loads((one_process / "parts" / "protocol.json").read_text())
    assert_same_report(one_process, out)


@pytest.mark.full
def test_a_killed_worker_loses_only_its_window_and_a_rerun_redoes_only_it(one_process, tmp_path, monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    out, real, sent, kill = tmp_path / "ray", cluster.submit, [], [KILLED]

    def submit(actor, part, sources, models):
        pid = None
        if str(part) in kill:   # (asked first: the worker runs one call at a time)
            kill.remove(str(part))
            pid = ray.get(actor.__ray_call__.remote(lambda worker: os.getpid()))
        ref = real(actor, part, sources, models)
        sent.append(str(part))
        if pid is not None:
            os.kill(pid, signal.SIGKILL)   # (while its window is in flight, as an out-of-memory kill would)
        return ref

    monkeypatch.setattr(cluster, "submit", submit)
    argv = with_out(doc_example(), out)
    assert command.main(argv) == 1
    err = capsys.readouterr().err
    assert f"{KILLED} failed: its worker died" in err and "1 window(s) failed" in err and "redoes only these" in err
    assert not (out / "report.md").exists()
    lost = out / "parts" / "methods" / "h2o@16"
    assert 3 not in command.done_windows(lost) and not (lost / "00003.parquet").exists()
    assert sent.index(KILLED) < len(sent) - 1, "the run went on after the kill"
    every = {(p.parent.relative_to(one_process / "parts"), p.name) for p in (one_process / "parts").rglob("0*.parquet")}
    have = {(p.parent.relative_to(out / "parts"), p.name) for p in (out / "parts").rglob("0*.parquet")}
    assert every - have == {(Path("methods/h2o@16"), "00003.parquet")} and have <= every

    sent.clear()
    assert command.main(argv) == 0
    assert sent == [KILLED]
    assert_same_report(one_process, out)


# ---- without a cluster ---------------------------------------------------------------------------------------------

class FakeRay:
    """ray.nodes() of a cluster of the given (CPUs, GPUs) nodes."""

    def __init__(self, *nodes: tuple[int, int]):
        self._nodes = [{"Alive": True, "Resources": {"CPU": c, **({"GPU": g} if g else {})}} for c, g in nodes]
        self._nodes.append({"Alive": False, "Resources": {"CPU": 64}})   # a dead node holds nothing

    def nodes(self):
        return self._nodes


@pytest.mark.parametrize("nodes, device, workers, threads, want", [
    ([(2, 0)], "auto", None, None, ("cpu", 2, 1)),            # one worker a core
    ([(8, 0)], "cpu", 2, None, ("cpu", 2, 4)),                # the cores shared out
    ([(8, 0), (8, 0)], "cpu", 3, None, ("cpu", 3, 4)),        # 5 threads each would leave the third no place
    ([(8, 0), (8, 0)], "cpu", None, 3, ("cpu", 4, 3)),        # two of 3 threads a node
    ([(16, 2), (4, 0)], "auto", None, None, ("cuda", 2, 8)),  # a GPU each, the GPU node's cores shared
])
def test_workers_are_laid_out_to_fit_the_nodes(nodes, device, workers, threads, want):
    assert cluster.layout(FakeRay(*nodes), device, workers, threads) == cluster.Layout(*want)


@pytest.mark.parametrize("nodes, device, workers, threads, message", [
    ([(2, 0)], "cpu", 3, None, "do not fit"),
    ([(8, 0), (8, 0)], "cpu", None, 9, "do not fit"),
    ([(8, 0)], "cuda", None, None, "no GPU"),
    ([(8, 1)], "cuda:1", None, None, "cpu, cuda or auto"),
    ([(8, 0)], "cpu", 0, None, "at least 1"),
])
def test_a_layout_that_cannot_run_is_refused(nodes, device, workers, threads, message):
    with pytest.raises(cluster.ClusterError, match=message):
        cluster.layout(FakeRay(*nodes), device, workers, threads)


def test_a_worker_never_goes_back_to_a_model_it_left():
    """Parts handed to whichever worker is idle, in a random order of finishing: each worker's models change at
    most (models - 1) times, so it loads each model at most once."""
    plan = command.run_plan(["a", "b"], ["h2o"], [8, 16])
    todo = cluster.parts_todo({"s": [[0]] * 7, "t": [[0]] * 5}, plan, Path("/nonexistent"))
    assert len(todo) == 12 * len(plan) and [p.model for p in todo][:12] == ["a"] * 12
    rng = random.Random(0)
    for workers in (1, 3, 8):
        queues: dict[str, deque] = {}
        for p in todo:
            queues.setdefault(p.model, deque()).append(p)
        held, seen, done = [None] * workers, [[] for _ in range(workers)], 0
        while True:
            i = rng.randrange(workers)
            part = cluster.next_part(queues, held[i])
            if part is None:
                break
            held[i] = part.model
            done += 1
            if not seen[i] or seen[i][-1] != part.model:
                seen[i].append(part.model)
        assert done == len(todo)
        assert all(len(s) == len(set(s)) for s in seen), seen


def test_without_ray_the_command_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)   # (import ray raises ImportError)
    argv = with_out(doc_example(), tmp_path / "out")
    assert command.main(argv) == 2
    assert "pip install 'mixscope[cluster]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_model_directory_taken_for_the_address_is_refused(tmp_path, capsys):
    argv = with_out(doc_example(), tmp_path / "out", ray=False)
    argv = argv[:1] + ["--ray"] + argv[:1] + argv[1:]   # --ray before the model directories: argparse takes one
    assert command.main(argv) == 2 and "not a Ray address" in capsys.readouterr().err


@pytest.mark.full
def test_only_the_cluster_module_imports_ray():
    """The app, the library and every single-process command leave Ray alone: only analysis/reports/cluster.py
    imports it, and only corpus.run imports that (when --ray is given)."""
    importers, cluster_importers = [], []
    for path in sorted(p for d in ("app", "analysis", "models", "kernels") for p in (ROOT / d).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "ray" or n.startswith("ray.") for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
            top = node in tree.body
            if any(n == "analysis.reports.cluster" for n in names) or (
                    isinstance(node, ast.ImportFrom) and node.module == "analysis.reports"
                    and any(a.name == "cluster" for a in node.names)):
                cluster_importers.append((path.relative_to(ROOT).as_posix(), top))
    assert importers == ["analysis/reports/cluster.py"]
    assert cluster_importers and all(not top for _, top in cluster_importers), cluster_importers
    res = subprocess.run([sys.executable, "-c", "import sys, analysis.reports.corpus, analysis.lab; "
                                                "print('ray' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "False", res.stderr
