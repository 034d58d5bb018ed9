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
worker refuses a model whose weights' sha256 differs from what the command read. Workers are placed on what each
node has free now (CPUs, GPUs and the memory the planner gives one model and one window), each pinned to its node,
so a node that lacks the models is not tried again. Ray is imported here only, and this module only when --ray is
given (pip install mixscope[cluster]). docs/cluster.md: a local run, a cluster run, GPUs, costs.
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
START_S = 300       # a worker not placed and checked after this long is left out (Ray would wait for room forever)


class ClusterError(ValueError):
    pass


class LoadFailed(RuntimeError):
    """A worker could not load a model (out of memory, its base gone): the part goes back to the queue and that
    worker is left out, rather than failing every next part of that model."""


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
    """Where the workers run: the device type each uses, how many, the torch threads (Ray CPUs) each holds and the
    memory (bytes, Ray's memory resource; 0: none asked) each reserves."""
    device: str
    workers: int
    threads: int
    memory: int = 0


# ---- the worker --------------------------------------------------------------------------------------------------

class WindowWorker:
    """A Ray actor's state: one loaded model at a time, and what `compute` keeps between windows (the corpus
    report's part-of-speech tags). compute(loaded, (source, window), ids, run, kept) -> (rows, metrics) is the
    command's: corpus.window_result or matched.window_result."""

    def __init__(self, device: str, threads: int, compute, plugins: tuple[str, ...] = ()):
        import torch
        from models.pruning import policies
        torch.set_num_threads(threads)   # (its share of the host's cores: workers on one host do not oversubscribe)
        policies.load_plugins(plugins)   # (the command's MIXSCOPE_POLICIES: a worker's environment is its node's)
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
            try:
                self.loaded = load_checked(model["path"], model["sha256"], self.device)
            except Exception as e:   # (MemoryError, a base removed since the check, ...)
                raise LoadFailed(f"{model['key']} did not load on {socket.gethostname()}: "
                                 f"{type(e).__name__}: {e}") from None
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
def connected(address: str, prog: str = "corpus"):
    """Ray up for the block: a local instance of its own (LOCAL), or the cluster at `address`; down after it."""
    ray = import_ray()
    options = dict(log_to_driver=False, logging_level=logging.WARNING)   # (errors come back as exceptions)
    if address == LOCAL:
        ray.init(address=LOCAL, include_dashboard=False, **options)
    else:
        print(f"{prog}: connecting to the Ray cluster at {address}", file=sys.stderr)   # (Ray retries a while)
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            # (a cluster with token authentication refuses a client without its token in this same way)
            raise ClusterError(f"--ray {address}: no Ray cluster reached there ({first}); if its head is up, it may "
                               "want its token: RAY_AUTH_MODE=token and the head's ~/.ray/auth_token here "
                               "(docs/cluster.md)") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def free_nodes(ray) -> dict[str, dict]:
    """Each live node's resources nothing holds now (node id -> {"CPU", "GPU", "memory" in bytes, ...}): on a shared
    cluster, or beside another command, only these take new workers."""
    try:
        return ray._private.state.available_resources_per_node()   # (a developer API of Ray 2.60, the version pinned)
    except AttributeError:   # (another Ray: its nodes' totals; a worker that finds no room is left out after START_S)
        return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}


def node_places(free: dict, device: str, threads: int, memory: int) -> int:
    """Workers of `threads` CPUs (a GPU each on cuda; `memory` bytes each when asked) that one node's free
    resources hold."""
    places = int(free.get("CPU", 0)) // threads
    if device == "cuda":
        places = min(places, int(free.get("GPU", 0)))
    if memory and "memory" in free:
        places = min(places, int(free["memory"] // memory))
    return places


def layout(ray, device: str, workers: int | None, threads: int | None, memory: int = 0) -> Layout:
    """The device type, workers and threads per worker, from what the nodes have free now (each worker reserving
    `memory` bytes: worker_bytes): by default every free CPU (cpu: one thread each) or GPU (cuda) a worker; given
    workers, threads default to the cores each can have (at least 1). Refused when the workers do not fit (they
    would wait for a place forever)."""
    nodes = list(free_nodes(ray).values())
    cpus, gpus = [int(n.get("CPU", 0)) for n in nodes], [int(n.get("GPU", 0)) for n in nodes]
    if device == "auto":
        device = "cuda" if sum(gpus) else "cpu"
    if device not in ("cpu", "cuda"):
        raise ClusterError(f"--device {device} with --ray: use cpu, cuda or auto (Ray gives each worker its GPU)")
    if device == "cuda" and not sum(gpus):
        raise ClusterError("--device cuda: the Ray cluster has no free GPU")
    if workers is not None and workers < 1 or threads is not None and threads < 1:
        raise ClusterError("--ray-workers and --ray-threads must be at least 1")

    def places(t: int) -> int:
        return sum(node_places(n, device, t, memory) for n in nodes)

    if threads is None:
        if device == "cuda":
            threads = max(1, min(c // g for c, g in zip(cpus, gpus) if g))
        else:
            threads = 1 if workers is None else max(1, sum(cpus) // workers)
        while workers is not None and threads > 1 and places(threads) < workers:
            threads -= 1
    workers = places(threads) if workers is None else workers
    if not workers or places(threads) < workers:
        raise ClusterError(f"{workers} worker(s) of {needs(Layout(device, workers, threads, memory))} each do not "
                           f"fit what the Ray cluster's nodes have free ({held(nodes)}): other work holds the rest")
    return Layout(device, workers, threads, memory)


def needs(lay: Layout) -> str:
    return (f"{lay.threads} CPU(s)" + (" and a GPU" if lay.device == "cuda" else "")
            + (f" and {lay.memory / 2**30:.1f} GB" if lay.memory else ""))


def held(nodes: list[dict]) -> str:
    """What nodes have free, as a message says it: CPUs, GPUs and memory per node."""
    text = f"CPUs {[int(n.get('CPU', 0)) for n in nodes]}"
    if any(n.get("GPU") for n in nodes):
        text += f", GPUs {[int(n.get('GPU', 0)) for n in nodes]}"
    return text + f", memory {[round(n.get('memory', 0) / 2**30, 1) for n in nodes]} GB"


def worker_bytes(dirs: list[str], window: int) -> int:
    """What one worker holds at most, as the one-process check plans a process holding one model at a time: the
    runtime, the largest model's float32 weights and the costliest model's runs of one window."""
    from analysis.budgets import config_of, report_window_bytes
    from models.memory import RUNTIME_BYTES, planned_weights
    cfgs = [config_of(d) for d in dirs]
    return RUNTIME_BYTES + max(map(planned_weights, cfgs)) + max(report_window_bytes(c, window) for c in cfgs)


def plugin_paths() -> tuple[str, ...]:
    """The command's own policies (MIXSCOPE_POLICIES), as absolute paths each worker loads."""
    from kernels import settings
    return tuple(str(Path(p).resolve()) for p in settings.get("MIXSCOPE_POLICIES"))


def start_workers(ray, lay: Layout, count: int, models: dict[str, dict], compute, prog: str = "corpus",
                  refused: set | None = None) -> tuple[list, list[str]]:
    """Up to `count` workers, each pinned to a node whose free resources hold it, none on a node in `refused`, and
    restarted after a death; returns them and why others were left out. A worker whose node lacks a model
    (model_problem), that does not start, or that is not placed and checked within START_S is left out with why,
    and its node joins `refused` (a later phase starts no worker there)."""
    refused = set() if refused is None else refused
    pins = []
    for node, free in free_nodes(ray).items():
        if node not in refused:
            pins += [node] * min(node_places(free, lay.device, lay.threads, lay.memory), count - len(pins))
    if not pins:
        return [], [f"no Ray node has {needs(lay)} free for a worker"]
    options = dict(num_cpus=lay.threads, num_gpus=1 if lay.device == "cuda" else 0, max_restarts=RESTARTS,
                   max_task_retries=0, **({"memory": lay.memory} if lay.memory else {}))
    remote, plugins = ray.remote(WindowWorker), plugin_paths()
    affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy
    actors = [remote.options(scheduling_strategy=affinity(node, soft=False), **options)
              .remote(lay.device, lay.threads, compute, plugins) for node in pins]
    checks = [actor.check.remote(list(models.values())) for actor in actors]
    ready, _ = ray.wait(checks, num_returns=len(checks), timeout=START_S)
    ready, where = set(ready), {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    started, problems = [], []
    for actor, check, node in zip(actors, checks, pins):
        if check not in ready:
            problem = (f"a worker of {needs(lay)} was not placed and checked on node {where.get(node, '?')} within "
                       f"{START_S} s: other work took what was free there, or the models' check is that slow")
        else:
            try:
                problem = ray.get(check)
            except ray.exceptions.RayError as e:
                problem = f"a worker did not start: {reason(ray, e)}"
        if problem:
            refused.add(node)
            ray.kill(actor)   # (its place is free again at once)
            problems.append(problem)
            print(f"{prog}: {problem} (that worker is left out)", file=sys.stderr)
        else:
            started.append(actor)
    return started, problems


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
        self.gone: set[int] = set()          # workers left out (dead, not back in time, a model they could not
                                             # load): a later phase drops them
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
        except ray.exceptions.RayError as e:
            if part is None:   # a probe: a worker still restarting is asked again; any other answer, it is gone
                if isinstance(e, ray.exceptions.ActorUnavailableError):
                    self.come_back(i)
                else:
                    self.retire(i, reason(ray, e))
                return
            if isinstance(getattr(e, "cause", None), LoadFailed):   # (the part is fine: another worker runs it)
                self.queues.setdefault(part.model, deque()).appendleft(part)
                self.retire(i, str(e.cause))
                for j in self.idle():
                    self.feed(j)
                return
            self.fail(part, reason(ray, e))
            if isinstance(e, ray.exceptions.RayActorError):
                # the worker died: Ray restarts it (with no model) and tasks sent meanwhile would fail too, so it
                # gets no part until a probe finds it back
                self.held[i] = None
                self.come_back(i)
                return
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
            self.retire(i, f"not back after {COMEBACK_S} s")
        else:
            self.probe_at[i] = now + PROBE_S

    def retire(self, i: int, why: str) -> None:
        """Worker i gets no more parts, in this phase or a later one (whose pool may start another in its place)."""
        self.gone.add(i)
        self.held[i] = None
        self.ray.kill(self.actors[i])   # (a dead one: nothing; a live one frees its place)
        tqdm.write(f"{self.prog}: a Ray worker is left out: {why}", file=sys.stderr)

    def idle(self) -> list[int]:
        """Workers with nothing in flight that may take a part."""
        busy = {i for i, _ in self.pending.values()} | set(self.probe_at) | self.gone
        return [i for i in range(len(self.actors)) if i not in busy]

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
        self.refused: set[str] = set()   # nodes that lacked a model or had no room: no worker is started there again

    def run(self, todo: list[Part], sources: dict[str, list[list[int]]], parts: Path, desc: str,
            total: int | None = None) -> list[tuple[Part, str]]:
        """The parts of todo, each written under parts as it comes back; one bar of `total` (default: todo's
        length) with what is already done counted in; returns the parts that failed (with why)."""
        if not todo:
            return []
        more = min(self.lay.workers, len(todo)) - len(self.actors)
        if more > 0:   # (a top-up that finds no place goes on with the workers there are)
            started, problems = start_workers(self.ray, self.lay, more, self.models, self.compute, self.prog,
                                              self.refused)
            self.actors += started
            if not self.actors:
                raise ClusterError(f"no Ray worker can run the models: {problems[0]}")
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
