"""The corpus report's windows on a Ray cluster (`python -m analysis.reports.corpus ... --ray [ADDRESS]`): the same
parts, and so the same report, as one process computes. The held-out protocol (analysis.reports.matched and
analysis.reports.real, --ray) runs its two phases' windows on the same workers. What a worker computes of a window
is the command's own function (corpus.window_result, matched.window_result), sent by reference: this module imports
neither command.

The command cuts what --parts lacks into (source, run, window) parts, ordered by model as run_all orders them. Each
worker is a Ray actor that holds one loaded model at a time; an idle worker gets the next part of the model it holds
or, when that model has none left, the first part of the next model that has: a worker loads each model at most once.
A worker computes a window with the command's function (the corpus report's caches each window's part-of-speech
tags, as run_all does) and sends back its rows and metrics; the command writes them with write_window, so the parts
land under --parts on the machine that runs the command, exactly as a one-process run writes them (one process
appends each windows.jsonl: appends from several hosts to one file on a network filesystem can interleave). A window
that raises, or whose worker dies, is named and skipped while the rest go on; a rerun redoes only what is missing
(done_windows).

Models reach workers by path: every node opens the same absolute path (a shared filesystem or a synced copy), and a
worker refuses a model whose weights' sha256 differs from what the command read. Ray is imported here only, and
this module only when --ray is given (pip install mixscope[cluster]). docs/cluster.md: a local run, a cluster run,
GPUs, costs.
"""
from __future__ import annotations

import logging
import socket
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from analysis.reports.parts import commit_now, done_windows, write_window

INSTALL = "--ray needs Ray: pip install 'mixscope[cluster]' (or, in this checkout, make install)"
LOCAL = "local"     # --ray with no address: a Ray instance of its own on this machine
RESTARTS = 3        # a worker that dies is restarted this often (the window it held is lost, not retried)
PROBE_S = 0.5       # a restarting worker is asked this often whether it is back
COMEBACK_S = 300    # a worker not back after this long is left out


class ClusterError(ValueError):
    pass


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError(INSTALL) from None
    return ray


@dataclass(frozen=True)
class Part:
    """One window of one run on one source, and the model (plan's key: "base" or a pruned directory) that runs it."""
    model: str
    source: str
    run: dict
    window: int

    def __str__(self) -> str:
        return f"{self.source} {self.run['run']} window {self.window}"


@dataclass(frozen=True)
class Layout:
    """Where the workers run: the device type each uses, how many, and the torch threads (Ray CPUs) each holds."""
    device: str
    workers: int
    threads: int


# ---- the worker --------------------------------------------------------------------------------------------------

class WindowWorker:
    """A Ray actor's state: one loaded model at a time, and what `compute` keeps between windows (the corpus
    report's part-of-speech tags). compute(loaded, (source, window), ids, run, kept) -> (rows, metrics) is the
    command's: corpus.window_result or matched.window_result."""

    def __init__(self, device: str, threads: int, compute):
        import torch
        torch.set_num_threads(threads)   # (its share of the host's cores: workers on one host do not oversubscribe)
        self.device, self.compute = device, compute
        self.model_key, self.loaded, self.kept = None, None, {}
        self.commit = commit_now()   # (this node's code: each window's line names what computed it)

    def ready(self) -> bool:
        return True

    def check(self, models: list[dict]) -> str | None:
        """Why this worker cannot run one of the models (model_problem), or None."""
        return next((p for m in models if (p := model_problem(m["path"], m["sha256"]))), None)

    def window(self, model: dict, source: str, w: int, ids: list[int], run: dict):
        """(rows, metrics, commit) of one window under one run; model: {"key", "path", "sha256"}."""
        if self.model_key != model["key"]:
            self.model_key, self.loaded = None, None   # (the previous model freed before the next one loads)
            self.loaded = load_checked(model["path"], model["sha256"], self.device)
            self.model_key = model["key"]
        rows, metrics = self.compute(self.loaded, (source, w), ids, run, self.kept)
        return rows, metrics, self.commit


def model_problem(path: str, sha256: str) -> str | None:
    """Why this node cannot run the model the command read at `path` (not there, other weights, a delta's base
    missing), or None."""
    from analysis.export import weights_sha256
    from models.checkpoint import CheckpointError
    from models.delta import BASE, base_weights, read_base_spec
    host = socket.gethostname()
    try:
        here = weights_sha256(Path(path) / "model.safetensors")
    except OSError:
        return f"{path} is not readable on {host}: every node needs the model directories at the same path"
    if here != sha256:
        return (f"{path} on {host} holds other weights than the command read (sha256 {here[:12]}, not "
                f"{sha256[:12]}): give every node the same model directory")
    if (Path(path) / BASE).is_file():
        try:
            base_weights(Path(path), read_base_spec(Path(path)))
        except (CheckpointError, OSError) as e:
            return f"on {host}: {e}"
    return None


def load_checked(path: str, sha256: str, device: str):
    """The model at `path` on this node, refused unless its weights are the ones the command read."""
    from models.checkpoint import load_model_dir
    problem = model_problem(path, sha256)
    if problem:
        raise ClusterError(problem)
    return load_model_dir(path, device=device)


# ---- the cluster -------------------------------------------------------------------------------------------------

@contextmanager
def connected(address: str):
    """Ray up for the block: a local instance of its own (LOCAL), or the cluster at `address`; down after it."""
    ray = import_ray()
    options = dict(log_to_driver=False, logging_level=logging.WARNING)   # (errors come back as exceptions)
    if address == LOCAL:
        ray.init(address=LOCAL, include_dashboard=False, **options)
    else:
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as e:
            # (a cluster with token authentication refuses a client without its token in this same way)
            raise ClusterError(f"--ray {address}: no Ray cluster reached there ({e}); if its head is up, it may want "
                               "its token: RAY_AUTH_MODE=token and the head's ~/.ray/auth_token here (docs/cluster.md)"
                               ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


def layout(ray, device: str, workers: int | None, threads: int | None) -> Layout:
    """The device type, workers and threads per worker: by default every CPU (cpu: one thread each) or GPU (cuda)
    of the cluster a worker; given workers, threads default to the cores each can have (at least 1). Refused when
    the workers do not fit the nodes (they would wait for a place forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    cpus, gpus = [int(n.get("CPU", 0)) for n in nodes], [int(n.get("GPU", 0)) for n in nodes]
    if device == "auto":
        device = "cuda" if sum(gpus) else "cpu"
    if device not in ("cpu", "cuda"):
        raise ClusterError(f"--device {device} with --ray: use cpu, cuda or auto (Ray gives each worker its GPU)")
    if device == "cuda" and not sum(gpus):
        raise ClusterError("--device cuda: the Ray cluster has no GPU")
    if workers is not None and workers < 1 or threads is not None and threads < 1:
        raise ClusterError("--ray-workers and --ray-threads must be at least 1")

    def places(t: int) -> int:   # workers of t threads the nodes hold (on a GPU: one a GPU)
        return sum(c // t if device == "cpu" else min(g, c // t) for c, g in zip(cpus, gpus))

    if threads is None:
        if device == "cuda":
            threads = max(1, min(c // g for c, g in zip(cpus, gpus) if g))
        else:
            threads = 1 if workers is None else max(1, sum(cpus) // workers)
        while workers is not None and threads > 1 and places(threads) < workers:
            threads -= 1
    workers = places(threads) if workers is None else workers
    if not workers or places(threads) < workers:
        each = f"{threads} thread(s)" + (" and a GPU" if device == "cuda" else "")
        held = f"CPUs {cpus}" + (f", GPUs {gpus}" if sum(gpus) else "")
        raise ClusterError(f"{workers} worker(s) of {each} each do not fit the Ray cluster's nodes ({held})")
    return Layout(device, workers, threads)


def start_workers(ray, lay: Layout, count: int, models: dict[str, dict], compute,
                  prog: str = "corpus") -> list:
    """`count` workers, each placed where it gets its threads (and a GPU), restarted after a death. A worker that
    cannot start, or whose node lacks a model (model_problem), is left out with why; none left is an error."""
    remote = ray.remote(WindowWorker).options(num_cpus=lay.threads, num_gpus=1 if lay.device == "cuda" else 0,
                                              max_restarts=RESTARTS, max_task_retries=0)
    actors = [remote.remote(lay.device, lay.threads, compute) for _ in range(count)]
    checks = [actor.check.remote(list(models.values())) for actor in actors]
    started, problems = [], []
    for actor, check in zip(actors, checks):
        try:
            problem = ray.get(check)
        except ray.exceptions.RayError as e:
            problem = f"a worker did not start: {reason(ray, e)}"
        if problem:
            problems.append(problem)
            print(f"{prog}: {problem} (that worker is left out)", file=sys.stderr)
        else:
            started.append(actor)
    if not started:
        raise ClusterError(f"no Ray worker can run the models: {problems[0]}")
    return started


def reason(ray, error) -> str:
    """What a failed window's message says: the worker's own exception, or that the worker died."""
    if isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        return f"{type(error.cause).__name__}: {error.cause}"
    if isinstance(error, ray.exceptions.RayActorError):
        return f"its worker died ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
    return f"{type(error).__name__}: {error}"


# ---- the run -----------------------------------------------------------------------------------------------------

def parts_todo(sources: dict[str, list[list[int]]], plan: list[dict], parts: Path) -> list[Part]:
    """What --parts lacks, in run_all's order: by model, then source, run and window."""
    out = []
    for key in dict.fromkeys(r["model"] for r in plan):
        for source, windows in sources.items():
            for r in (r for r in plan if r["model"] == key):
                done = done_windows(parts / source / r["run"])
                out += [Part(key, source, r, w) for w in range(len(windows)) if w not in done]
    return out


def next_part(queues: dict[str, deque], held: str | None) -> Part | None:
    """The next part of the model a worker holds; when none is left, the first part of the next model that has."""
    if queues.get(held):
        return queues[held].popleft()
    return next((q.popleft() for q in queues.values() if q), None)


def model_specs(args, protocol: dict) -> dict[str, dict]:
    """Each model of the plan as workers open it: its absolute path and the sha256 the protocol recorded."""
    dirs = {"base": args.base} | {d: d for d in args.pruned}
    return {key: {"key": key, "path": str(Path(d).resolve()),
                  "sha256": protocol["models"]["base" if key == "base" else Path(d).name]} for key, d in dirs.items()}


def submit(actor, part: Part, sources: dict, models: dict):
    return actor.window.remote(models[part.model], part.source, part.window, sources[part.source][part.window],
                               part.run)


class Dispatch:
    """The command's side of a run: the parts queued per model, the model each worker holds, what is in flight (one
    part a worker, or a probe asking a restarting worker whether it is back) and what failed."""

    def __init__(self, ray, actors: list, todo: list[Part], sources: dict, models: dict, parts: Path, bar: tqdm,
                 prog: str = "corpus"):
        self.ray, self.actors, self.bar, self.prog = ray, actors, bar, prog
        self.sources, self.models, self.parts = sources, models, parts
        self.queues: dict[str, deque] = {}
        for p in todo:
            self.queues.setdefault(p.model, deque()).append(p)
        self.held: list[str | None] = [None] * len(actors)
        self.pending: dict = {}              # ref -> (worker, its part, or None for a probe)
        self.probe_at: dict[int, float] = {}  # a restarting worker -> when to ask again
        self.down_since: dict[int, float] = {}
        self.gone: set[int] = set()          # workers left out (not back in time): a later phase skips them
        self.failed: list[tuple[Part, str]] = []

    def run(self) -> list[tuple[Part, str]]:
        for i in range(len(self.actors)):
            self.feed(i)
        while self.busy():
            self.send_probes()
            wait = max(0.0, min(self.probe_at.values()) - time.monotonic()) if self.probe_at else None
            if self.pending:
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=wait)
                for ref in ready:
                    self.settle(ref)
            else:
                time.sleep(wait)
        return self.failed + [(p, "no worker left to run it") for q in self.queues.values() for p in q]

    def busy(self) -> bool:
        """Parts in flight, or parts queued and a worker that may come back for them."""
        in_flight = any(part is not None for _, part in self.pending.values())
        return in_flight or any(self.queues.values()) and bool(self.pending or self.probe_at)

    def feed(self, i: int) -> None:
        part = next_part(self.queues, self.held[i])
        if part is not None:
            self.held[i] = part.model
            self.pending[submit(self.actors[i], part, self.sources, self.models)] = (i, part)

    def settle(self, ref) -> None:
        i, part = self.pending.pop(ref)
        ray = self.ray
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as e:
            # the worker died: Ray restarts it (with no model) and tasks sent meanwhile would fail too, so it gets
            # no part until a probe finds it back; a worker dead for good is left out
            self.held[i] = None
            if part is not None:
                self.fail(part, reason(ray, e))
            if isinstance(e, ray.exceptions.ActorUnavailableError) or part is not None:
                self.come_back(i)
            return
        except ray.exceptions.RayError as e:   # the window raised; the worker is fine
            self.fail(part, reason(ray, e))
        else:
            self.down_since.pop(i, None)
            if part is not None:
                rows, metrics, commit = result
                write_window(self.parts / part.source / part.run["run"], part.window, rows, metrics, commit=commit)
                self.bar.update()
        self.feed(i)

    def fail(self, part: Part, why: str) -> None:
        self.failed.append((part, why))
        tqdm.write(f"{self.prog}: {part} failed: {why}", file=sys.stderr)
        self.bar.set_postfix_str(f"{len(self.failed)} failed")
        self.bar.update()

    def come_back(self, i: int) -> None:
        now = time.monotonic()
        if now - self.down_since.setdefault(i, now) > COMEBACK_S:
            self.gone.add(i)
            tqdm.write(f"{self.prog}: a Ray worker not back after {COMEBACK_S} s is left out", file=sys.stderr)
        else:
            self.probe_at[i] = now + PROBE_S

    def send_probes(self) -> None:
        now = time.monotonic()
        for i in [i for i, at in self.probe_at.items() if at <= now]:
            del self.probe_at[i]
            self.pending[self.actors[i].ready.remote()] = (i, None)


class Pool:
    """Workers for one command, started when a phase first has parts and kept for the next phase (a worker keeps
    the model it holds; more are started, up to the layout's, when a later phase has more parts than workers)."""

    def __init__(self, ray, lay: Layout, models: dict[str, dict], compute, prog: str = "corpus"):
        self.ray, self.lay, self.models, self.compute, self.prog = ray, lay, models, compute, prog
        self.actors: list = []

    def run(self, todo: list[Part], sources: dict[str, list[list[int]]], parts: Path, desc: str,
            total: int | None = None) -> list[tuple[Part, str]]:
        """The parts of todo, each written under parts as it comes back; one bar of `total` (default: todo's
        length) with what is already done counted in; returns the parts that failed (with why)."""
        if not todo:
            return []
        more = min(self.lay.workers, len(todo)) - len(self.actors)
        if more > 0:
            self.actors += start_workers(self.ray, self.lay, more, self.models, self.compute, self.prog)
        total = len(todo) if total is None else total
        n = len(self.actors)
        bar = tqdm(total=total, initial=total - len(todo), desc=f"{desc} ({n} Ray worker{'s' * (n > 1)})",
                   file=sys.stderr)
        dispatch = Dispatch(self.ray, self.actors, todo, sources, self.models, parts, bar, self.prog)
        try:
            return dispatch.run()
        finally:
            bar.close()
            self.actors = [a for i, a in enumerate(self.actors) if i not in dispatch.gone]


def run_windows(args, sources: dict[str, list[list[int]]], plan: list[dict], parts: Path, protocol: dict,
                ray, lay: Layout, compute) -> list[tuple[Part, str]]:
    """What --parts lacks, each window computed by `compute` on the cluster `ray` is connected to; returns the parts
    that failed (with why)."""
    todo = parts_todo(sources, plan, parts)
    return Pool(ray, lay, model_specs(args, protocol), compute).run(todo, sources, parts, "windows x runs")


def failure_report(failed: list[tuple[Part, str]], parts: Path, prog: str = "corpus", also: str = "") -> str:
    """The end of a run with failures: what failed, and that a rerun redoes only those (and `also`: what waited
    on them)."""
    lines = [f"{prog}: {len(failed)} window(s) failed, no report written:"]
    lines += [f"  {part}: {why}" for part, why in failed]
    lines.append(f"every other window is in {parts}: the same command again redoes only these{also}")
    return "\n".join(lines)
