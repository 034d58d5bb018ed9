"""The corpus report on Ray: windows x runs per second with one worker against two workers of one thread each, on
the same small protocol, in one local Ray instance, beside one process at one thread (run_all).

    python -m bench.ray_scaling [--window 256] [--windows 16] [--json bench/results/ray_scaling_cpu.json]

The protocol: the zoo's pruned MHA (its own rule) and its dense base (nothing evicted, H2O and StreamingLLM at two
budgets each), windows of docs/methods.md. Each setting computes every part into a fresh --parts directory; its
`seconds` is what a run of the command spends on its windows (workers starting, models and the tagger loading,
windows computed and written), `first_window_s` how long until the first window was written, and the steady rate
counts the windows after it. So a run of N window x runs costs about Ray's startup (`ray_startup_s`, once) +
first_window_s + N / steady rate. The parts of every setting are checked equal to one process's. Run it alone: on a
2-core machine anything else running takes a worker's core.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from argparse import Namespace
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from bench import cpu_model, report

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "assets" / "models"
SOURCE = ROOT / "docs" / "methods.md"


def protocol(window: int, windows: int) -> tuple[Namespace, dict, list[dict], dict]:
    """The command's arguments, sources, plan and protocol, as analysis.reports.corpus.run builds them."""
    from analysis.export import model_entry
    from analysis.reports import corpus
    from models.checkpoint import load_model_dir
    args = Namespace(pruned=[str(MODELS / "mha-1024-pruned")], base=str(MODELS / "mha-1024"), device="cpu")
    tokenizer = load_model_dir(args.base, device="cpu").tokenizer
    sources = {"methods": corpus.windows_of(str(SOURCE), tokenizer, window, windows)}
    plan = corpus.run_plan(args.pruned, ["h2o", "streamingllm"], [window // 8, window // 4])
    models = {"base": model_entry(args.base)} | {Path(d).name: model_entry(d) for d in args.pruned}
    proto = {"window": window, "sources": {"methods": {"spec": str(SOURCE), "windows": len(sources["methods"])}},
             "runs": [r["run"] for r in plan], "precision": {"device": "cpu", "dtype": "float32"},
             "models": {k: v["checkpoint_sha256"] for k, v in models.items()}}
    return args, sources, plan, proto


def same_parts(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*.parquet"))
    if files != sorted(p.relative_to(b) for p in b.rglob("*.parquet")):
        return False
    return all(pd.read_parquet(a / f).equals(pd.read_parquet(b / f)) for f in files)


@contextmanager
def timed(module):
    """The times (perf_counter) at which `module`'s write_window finished each window, in a list filled in the block:
    the module is the one whose run loop writes (corpus for run_all, cluster for the Ray dispatch)."""
    real, stamps = module.write_window, []

    def write(*a, **k):
        real(*a, **k)
        stamps.append(time.perf_counter())

    module.write_window = write
    try:
        yield stamps
    finally:
        module.write_window = real


def row(setting: str, workers: int, start: float, stamps: list[float]) -> dict:
    return {"setting": setting, "workers": workers, "threads": 1, "window_runs": len(stamps),
            "seconds": round(stamps[-1] - start, 2), "first_window_s": round(stamps[0] - start, 2),
            "window_runs_per_s": round(len(stamps) / (stamps[-1] - start), 2),
            "steady_window_runs_per_s": round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 2)}


def one_process(args, sources, plan, proto, parts: Path) -> dict:
    from analysis.reports import corpus
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        corpus.check_protocol(parts, proto)
        with timed(corpus) as stamps:
            start = time.perf_counter()
            corpus.run_all(args, sources, plan, parts)
        return row("one process, 1 thread", 0, start, stamps)
    finally:
        torch.set_num_threads(threads)


def on_ray(ray, workers: int, args, sources, plan, proto, parts: Path) -> dict:
    from analysis.reports import cluster, corpus
    corpus.check_protocol(parts, proto)
    with timed(cluster) as stamps:
        start = time.perf_counter()
        failed = cluster.run_windows(args, sources, plan, parts, proto, ray, cluster.Layout("cpu", workers, 1),
                                      corpus.window_result)
    if failed:
        raise SystemExit(cluster.failure_report(failed, parts))
    return row(f"Ray, {workers} worker{'s' * (workers > 1)} of 1 thread", workers, start, stamps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ray_scaling", description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--json", default="bench/results/ray_scaling_cpu.json")
    args = ap.parse_args(argv)
    from analysis.export import code_version
    from analysis.reports import cluster
    ray = cluster.import_ray()
    command, sources, plan, proto = protocol(args.window, args.windows)
    parts_each = len(plan) * len(sources["methods"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="ray-scaling-") as tmp:
        reference = Path(tmp) / "one"
        rows.append(one_process(command, sources, plan, proto, reference))
        start = time.perf_counter()
        with cluster.connected(cluster.LOCAL) as ray:
            startup = time.perf_counter() - start
            for workers in (1, 2):
                parts = Path(tmp) / f"ray{workers}"
                rows.append(on_ray(ray, workers, command, sources, plan, proto, parts)
                            | {"same_parts_as_one_process": same_parts(reference, parts)})
    by, code = {r["workers"]: r for r in rows}, code_version()
    result = {"benchmark": "ray_scaling", "device": "cpu", "cpu": cpu_model(), "host": platform.node(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": code["commit"],
              "uncommitted_changes": code["uncommitted_changes"],
              "versions": {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__},
              "protocol": {"models": ["mha-1024-pruned", "mha-1024"], "source": "docs/methods.md",
                           "window": args.window, "windows": len(sources["methods"]), "runs": [r["run"] for r in plan],
                           "window_runs": parts_each},
              "ray_startup_s": round(startup, 2), "rows": rows,
              "speedup_2_workers_vs_1": round(by[1]["seconds"] / by[2]["seconds"], 2),
              "steady_speedup_2_workers_vs_1": round(by[2]["steady_window_runs_per_s"]
                                                     / by[1]["steady_window_runs_per_s"], 2)}
    if not all(r.get("same_parts_as_one_process", True) for r in rows):
        print("ray_scaling: a Ray run's parts differ from one process's", file=sys.stderr)
        report(result, args.json)
        return 1
    return report(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
