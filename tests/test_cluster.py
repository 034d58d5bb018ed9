"""The corpus report on Ray (`--ray`, analysis.reports.cluster): docs/cluster.md's local example, run as written on a
local 2-worker Ray instance, gives the same parts and report as one process; a worker killed mid-run loses only its
window, the command names it and exits 1, and a rerun redoes only that window and gives the same report. On a fake
Ray: workers are laid out to fit what the nodes have free (their memory too); a node that lacks the models, a worker
out of restarts, one that cannot load a model or is not placed in time is left out while the rest go on; workers
load the command's own policies; a worker never goes back to a model it left. Without Ray, --ray says how to install
it, and nothing but --ray imports Ray."""
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
from types import SimpleNamespace

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
    """Enough of Ray for the layout, the workers' start and the dispatch, in this process: nodes of (CPUs, GPUs
    [, memory GB [, CPUs other work holds]]); actors are WindowWorker-like objects `behave(actor, method, args)`
    answers for (a value, or an exception to raise), each call settled at once."""

    class RayError(Exception):
        pass

    class RayTaskError(RayError):
        def __init__(self, cause):
            super().__init__(str(cause))
            self.cause = cause

    class RayActorError(RayError):
        pass

    class ActorDiedError(RayActorError):
        pass

    class ActorUnavailableError(RayActorError):
        pass

    def __init__(self, *nodes: tuple, behave=None):
        self._nodes, self.free = [], {}
        for k, (c, g, *more) in enumerate(nodes):
            total = {"CPU": c, **({"GPU": g} if g else {}), **({"memory": more[0] * 2**30} if more else {})}
            self._nodes.append({"NodeID": f"node{k}", "NodeManagerAddress": f"10.0.0.{k}", "Alive": True,
                                "Resources": total})
            self.free[f"node{k}"] = total | {"CPU": c - (more[1] if len(more) > 1 else 0)}
        self._nodes.append({"NodeID": "dead", "Alive": False, "Resources": {"CPU": 64}})   # (holds nothing)
        self.exceptions = SimpleNamespace(**{n: getattr(FakeRay, n) for n in (
            "RayError", "RayTaskError", "RayActorError", "ActorDiedError", "ActorUnavailableError")})
        self.util = SimpleNamespace(scheduling_strategies=SimpleNamespace(
            NodeAffinitySchedulingStrategy=lambda node_id, soft: node_id))
        self._private = SimpleNamespace(state=SimpleNamespace(
            available_resources_per_node=lambda: {k: dict(v) for k, v in self.free.items()}))
        self.behave = behave or (lambda actor, method, args: None if method == "check" else True)
        self.started, self.killed, self.timeouts = [], [], []

    def nodes(self):
        return self._nodes

    def remote(self, cls):
        fake = self

        class Options:
            def options(self, scheduling_strategy, num_cpus, num_gpus, memory=0, **_):
                def start(*args):
                    actor = FakeActor(fake, scheduling_strategy, args, {"CPU": num_cpus, "GPU": num_gpus,
                                                                        "memory": memory})
                    for k, v in actor.holds.items():
                        fake.free[actor.node][k] = fake.free[actor.node].get(k, 0) - v
                    fake.started.append(actor)
                    return actor
                return SimpleNamespace(remote=start)
        return Options()

    def wait(self, refs, num_returns, timeout):
        self.timeouts.append(timeout)
        ready = [r for r in refs if not r.never]
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def get(self, ref):
        if isinstance(ref.value, BaseException):
            raise ref.value
        return ref.value

    def kill(self, actor):
        if actor not in self.killed:
            self.killed.append(actor)
            for k, v in actor.holds.items():
                self.free[actor.node][k] += v


class Ref:
    def __init__(self, value, never=False):
        self.value, self.never = value, never


class FakeActor:
    def __init__(self, ray: FakeRay, node: str, args: tuple, holds: dict):
        self.ray, self.node, self.args, self.holds, self.calls = ray, node, args, holds, []

    def __getattr__(self, method):
        def call(*args):
            self.calls.append(method)
            try:
                answer = self.ray.behave(self, method, args)
            except BaseException as e:   # (raised when the caller gets it, as Ray raises it)
                answer = e
            return Ref(None, never=True) if answer == "never" else Ref(answer)
        return SimpleNamespace(remote=call)


@pytest.mark.parametrize("nodes, device, workers, threads, want", [
    ([(2, 0)], "auto", None, None, ("cpu", 2, 1)),            # one worker a core
    ([(8, 0)], "cpu", 2, None, ("cpu", 2, 4)),                # the cores shared out
    ([(8, 0), (8, 0)], "cpu", 3, None, ("cpu", 3, 4)),        # 5 threads each would leave the third no place
    ([(8, 0), (8, 0)], "cpu", None, 3, ("cpu", 4, 3)),        # two of 3 threads a node
    ([(16, 2), (4, 0)], "auto", None, None, ("cuda", 2, 8)),  # a GPU each, the GPU node's cores shared
    ([(8, 0, 64, 6)], "cpu", None, None, ("cpu", 2, 1)),      # what other work holds is not counted
    ([(8, 0, 64, 6)], "cpu", 2, None, ("cpu", 2, 1)),
])
def test_workers_are_laid_out_to_fit_the_nodes(nodes, device, workers, threads, want):
    assert cluster.layout(FakeRay(*nodes), device, workers, threads) == cluster.Layout(*want)


@pytest.mark.parametrize("nodes, device, workers, threads, message", [
    ([(2, 0)], "cpu", 3, None, "do not fit"),
    ([(8, 0), (8, 0)], "cpu", None, 9, "do not fit"),
    ([(8, 0)], "cuda", None, None, "no free GPU"),
    ([(8, 1)], "cuda:1", None, None, "cpu, cuda or auto"),
    ([(8, 0)], "cpu", 0, None, "at least 1"),
    ([(8, 0, 64, 8)], "cpu", None, None, "other work holds the rest"),
])
def test_a_layout_that_cannot_run_is_refused(nodes, device, workers, threads, message):
    with pytest.raises(cluster.ClusterError, match=message):
        cluster.layout(FakeRay(*nodes), device, workers, threads)


def test_each_worker_reserves_the_memory_one_process_plans_for_one_model():
    need = cluster.worker_bytes([str(ROOT / "assets/models/mha-1024"), str(ROOT / "assets/models/mha-1024-pruned")],
                                64)
    assert need > 512 * 2**20   # (the runtime, a model's weights and its runs of one window)
    assert cluster.layout(FakeRay((8, 0, 3)), "cpu", None, None, 2**30) == cluster.Layout("cpu", 3, 1, 2**30)
    with pytest.raises(cluster.ClusterError, match="2 worker.* of 1 CPU.* and 1.0 GB each do not fit"):
        cluster.layout(FakeRay((8, 0, 1)), "cpu", 2, None, 2**30)
    fake = FakeRay((8, 0, 3))
    actors, _ = cluster.start_workers(fake, cluster.Layout("cpu", 3, 1, 2**30), 3, MODELS, None)
    assert [a.holds["memory"] for a in actors] == [2**30] * 3


MODELS = {"base": {"key": "base", "path": "/m", "sha256": "0" * 64}}
OK = (pd.DataFrame({"x": [1.0]}), {}, "abc")


def window_parts(run: str, n: int) -> list:
    return [cluster.Part("base", "s", {"run": run}, w) for w in range(n)]


def written(parts: Path, run: str) -> list[int]:
    return sorted(command.done_windows(parts / "s" / run))


def test_a_node_that_lacks_the_models_is_not_tried_again_and_phase_two_goes_on(tmp_path, capsys):
    """Phase one's worker on node 0 finds no model: left out, its CPU free again; phase two's top-up finds no other
    place (node 0 refused, node 1 full) and goes on with the worker there is."""
    fake = FakeRay((1, 0), (1, 0), behave=lambda actor, method, args: (
        ("/m is not readable on node0" if actor.node == "node0" else None) if method == "check" else OK))
    pool = cluster.Pool(fake, cluster.Layout("cpu", 2, 1), MODELS, None)
    sources = {"s": [[1, 2], [3, 4]]}
    assert pool.run(window_parts("dense", 2), sources, tmp_path, "phase 1") == []
    assert pool.run(window_parts("h2o@8", 2), sources, tmp_path, "phase 2") == []
    assert [a.node for a in fake.started] == ["node0", "node1"] and fake.killed == fake.started[:1]
    assert written(tmp_path, "dense") == written(tmp_path, "h2o@8") == [0, 1]
    assert "/m is not readable on node0 (that worker is left out)" in capsys.readouterr().err


def test_a_worker_out_of_restarts_is_dropped_and_a_later_phase_starts_another(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cluster, "PROBE_S", 0)

    def behave(actor, method, args):
        if actor is fake.started[0] and method in ("window", "ready"):   # (its window killed it, for good)
            raise FakeRay.ActorDiedError("The actor died: out of restarts")
        return None if method == "check" else OK

    fake = FakeRay((2, 0), behave=behave)
    pool = cluster.Pool(fake, cluster.Layout("cpu", 2, 1), MODELS, None)
    sources = {"s": [[1]] * 4}
    failed = pool.run(window_parts("dense", 4), sources, tmp_path, "phase 1")
    assert [(str(p), why) for p, why in failed] == [("s dense window 0", "its worker died (The actor died: out of "
                                                                          "restarts)")]
    assert pool.actors == fake.started[1:] and fake.killed == fake.started[:1]
    assert written(tmp_path, "dense") == [1, 2, 3]
    assert "a Ray worker is left out: its worker died" in capsys.readouterr().err
    assert pool.run(window_parts("h2o@8", 4), sources, tmp_path, "phase 2") == []
    assert len(fake.started) == 3 and pool.actors == fake.started[1:]
    assert written(tmp_path, "h2o@8") == [0, 1, 2, 3]


def test_a_worker_that_cannot_load_a_model_puts_its_part_back_and_is_left_out(tmp_path, capsys):
    def behave(actor, method, args):
        if actor is fake.started[0] and method == "window":
            raise FakeRay.RayTaskError(cluster.LoadFailed("base did not load on node0: MemoryError: "))
        return None if method == "check" else OK

    fake = FakeRay((2, 0), behave=behave)
    pool = cluster.Pool(fake, cluster.Layout("cpu", 2, 1), MODELS, None)
    assert pool.run(window_parts("dense", 4), {"s": [[1]] * 4}, tmp_path, "phase 1") == []
    assert written(tmp_path, "dense") == [0, 1, 2, 3] and fake.started[0].calls == ["check", "window"]
    assert pool.actors == fake.started[1:]
    assert "a Ray worker is left out: base did not load on node0: MemoryError" in capsys.readouterr().err


def test_a_load_that_raises_is_told_apart_from_a_window_that_raises(monkeypatch):
    worker = object.__new__(cluster.WindowWorker)   # (its state, without __init__'s torch threads)
    worker.device, worker.model_key, worker.loaded, worker.kept, worker.commit = "cpu", None, None, {}, "abc"
    worker.compute = lambda loaded, key, ids, run, kept: (pd.DataFrame(), {})

    def load(path, sha256, device):
        raise MemoryError("no room for it")

    monkeypatch.setattr(cluster, "load_checked", load)
    with pytest.raises(cluster.LoadFailed, match="base did not load on .*: MemoryError: no room for it"):
        worker.window(MODELS["base"], "s", 0, [1], {"run": "dense"})


def test_a_worker_not_placed_in_time_is_named_and_none_at_all_is_an_error(tmp_path):
    fake = FakeRay((1, 0), (1, 0), behave=lambda actor, method, args: (
        ("never" if actor.node == "node0" else None) if method == "check" else OK))
    refused: set = set()
    started, problems = cluster.start_workers(fake, cluster.Layout("cpu", 2, 1), 2, MODELS, None, "corpus", refused)
    assert [a.node for a in started] == ["node1"] and refused == {"node0"} and fake.timeouts == [cluster.START_S]
    assert problems == [f"a worker of 1 CPU(s) was not placed and checked on node 10.0.0.0 within {cluster.START_S} "
                        "s: other work took what was free there, or the models' check is that slow"]
    fake = FakeRay((1, 0), behave=lambda actor, method, args: "never")
    with pytest.raises(cluster.ClusterError, match="no Ray worker can run the models: a worker of 1 CPU.* not placed"):
        cluster.Pool(fake, cluster.Layout("cpu", 1, 1), MODELS, None).run(window_parts("dense", 1), {"s": [[1]]},
                                                                          tmp_path, "phase 1")


def test_workers_load_the_commands_own_policies(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_POLICIES", "plugins/mine.py")
    fake = FakeRay((1, 0))
    actors, _ = cluster.start_workers(fake, cluster.Layout("cpu", 1, 1), 1, MODELS, None)
    plugins = actors[0].args[3]
    assert plugins == (str((Path.cwd() / "plugins/mine.py").resolve()),)
    loaded = []
    monkeypatch.setattr("models.pruning.policies.load_plugins", loaded.append)
    monkeypatch.setattr(cluster, "commit_now", lambda: "abc")
    cluster.WindowWorker("cpu", torch.get_num_threads(), None, plugins)
    assert loaded == [plugins]


def test_an_unreachable_address_is_said_first_and_its_error_kept_to_a_line(monkeypatch, capsys):
    def init(**options):
        raise ConnectionError("no Ray head at 10.9.9.9:6379\nTraceback (most recent call last):\n  ...")

    monkeypatch.setattr(cluster, "import_ray", lambda: SimpleNamespace(init=init, shutdown=lambda: None))
    with pytest.raises(cluster.ClusterError) as error:
        with cluster.connected("10.9.9.9:6379", "matched"):
            pass
    assert capsys.readouterr().err == "matched: connecting to the Ray cluster at 10.9.9.9:6379\n"
    assert "(no Ray head at 10.9.9.9:6379);" in str(error.value) and "Traceback" not in str(error.value)


def test_a_model_directory_named_like_a_policys_run_is_refused(tmp_path, capsys):
    (tmp_path / "h2o@16").symlink_to(ROOT / "assets/models/mha-1024-pruned")
    argv = with_out(doc_example(), tmp_path / "out", ray=False)
    argv[0] = str(tmp_path / "h2o@16")
    assert command.main(argv) == 2
    assert "without '@': h2o@16" in capsys.readouterr().err and not (tmp_path / "out").exists()


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
    imports it, and the commands import that inside the functions that use it, never at their top."""
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
