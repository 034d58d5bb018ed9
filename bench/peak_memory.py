"""Each heavy computation the pages run, at the largest input its page accepts: the memory it peaks at against the
estimate the code budgets with (where it has one), and what it gives back afterwards.

    python -m bench.peak_memory [--model assets/models/smollm2-135m] [--pruned assets/models/smollm2-pruned-window]
        [--data data/smollm2] [--threads 2] [--json FILE]

Each case runs in a process of its own: the model loaded and one small forward run (so that the allocator's
start-up is not counted), the peak resident set reset (/proc/self/clear_refs), the computation, then the peak
(VmHWM) and the resident set after it, then again after glibc's malloc_trim (what the app does once no
computation has started for 2 s and none runs: app/slots.py). The numbers are MiB of resident memory above what
the process held just before the computation. The model load is measured from a bare process, against the model cache's
estimate of a loaded model (app/model_cache.nbytes). Linux only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import cpu_model, proc_status_kb, report

# case -> (which model, what it does); the sizes are each page's largest (app/views/*.py)
CASES = {
    "load": ("dense", "load the model (its cache counts it at its tensors' bytes)"),
    "attention maps, 128 tokens": ("dense", "Attention and Compare: every layer's and head's map of a 128-token view"),
    "integrated gradients, 256 tokens, 64 steps": ("dense", "Attribution at its window and most steps"),
    "gradient x input, 256 tokens": ("dense", "Attribution's one-gradient method at its window"),
    "learned rule, 512 tokens": ("pruned", "Pruning: the rule's keep masks and log-probabilities over its window"),
    "interaction scores, 512 tokens": ("pruned", "Pruning's Why view: every layer's q_int and k_int"),
    "SnapKV per group, prompt mode, 1,024 tokens": ("dense", "Pruning: a policy that reads the prompt's attention"),
    "H2O per group, step by step, 1,024 tokens": ("dense", "Pruning: a policy replayed token by token"),
    "generate 256 tokens after 4,000": ("dense", "Generate: serve mode's most new tokens after a long prompt"),
}


def settle() -> None:
    """Before a case: nothing collectable or free left over from the set-up."""
    import gc

    from app.slots import give_back_memory
    gc.collect()
    give_back_memory()


def estimate_bytes(case: str, model) -> int | None:
    """What the code budgets with for this case, or None where it has no estimate."""
    from analysis import attribution
    cfg = model.config
    if case.startswith("integrated gradients"):
        per = attribution.bytes_per_sample(cfg, 256)
        return min(64, max(1, attribution.BUDGET_BYTES // per)) * per
    if case.startswith("gradient x input"):
        return attribution.bytes_per_sample(cfg, 256)
    return None


def run_case(case: str, model_dir: str, ids: list[int]) -> dict:
    """In this process: the case's numbers (see the module's docstring)."""
    import torch
    from models.checkpoint import load_model_dir
    if case == "load":
        from app.model_cache import nbytes
        open("/proc/self/clear_refs", "w").write("5")
        before = proc_status_kb("VmRSS")
        t0 = time.perf_counter()
        loaded = load_model_dir(model_dir)
        seconds = time.perf_counter() - t0
        return {"estimate_mb": nbytes(loaded) / 2**20, "peak_mb": (proc_status_kb("VmHWM") - before) / 1024,
                "after_mb": (proc_status_kb("VmRSS") - before) / 1024, "seconds": seconds}
    from analysis import attribution, maps, pruning, scores
    from app.slots import give_back_memory
    from models.generate import generate
    model = load_model_dir(model_dir).model
    with torch.inference_mode():
        model(torch.tensor([ids[:16]]))
    work = {
        "attention maps, 128 tokens": lambda: maps.mixing_maps(model, ids[:128]),
        "integrated gradients, 256 tokens, 64 steps":
            lambda: attribution.attribute(model, ids[:256], 255, None, "integrated gradients", 64),
        "gradient x input, 256 tokens": lambda: attribution.attribute(model, ids[:256], 255, None, "gradient x input"),
        "learned rule, 512 tokens": lambda: pruning.method_run(model, ids[:512], pruning.LEARNED),
        "interaction scores, 512 tokens": lambda: scores.recorded(model, ids[:512]),
        "SnapKV per group, prompt mode, 1,024 tokens":
            lambda: pruning.method_run(model, ids[:1024], "snapkv", 256, 768),
        "H2O per group, step by step, 1,024 tokens": lambda: pruning.method_run(model, ids[:1024], "h2o", 256),
        "generate 256 tokens after 4,000": lambda: generate(model, ids[:4000], 256, greedy=True),
    }[case]
    settle()
    open("/proc/self/clear_refs", "w").write("5")
    before = proc_status_kb("VmRSS")
    t0 = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - t0
    peak = proc_status_kb("VmHWM")
    del result
    after = proc_status_kb("VmRSS")
    t1 = time.perf_counter()
    give_back_memory()   # what the server does once its last computation ends (app/slots.py)
    trim_s = time.perf_counter() - t1
    est = estimate_bytes(case, model)
    return {"estimate_mb": None if est is None else est / 2**20, "peak_mb": (peak - before) / 1024,
            "after_mb": (after - before) / 1024, "after_trim_mb": (proc_status_kb("VmRSS") - before) / 1024,
            "trim_s": trim_s, "seconds": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peak_memory", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--pruned", default="assets/models/smollm2-pruned-window")
    ap.add_argument("--data", default="data/smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)   # (one case, in the child process)
    ap.add_argument("--ids", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    if args.case:
        ids = json.loads(Path(args.ids).read_text())
        print(json.dumps(run_case(args.case, args.model if CASES[args.case][0] == "dense" else args.pruned, ids)))
        return 0
    from bench.app_pages import sample_text
    from models.checkpoint import load_model_dir
    tokenizer = load_model_dir(args.model).tokenizer
    ids = tokenizer.encode(sample_text(tokenizer, Path(args.data), 4000)).ids[:4000]
    ids_file = Path(args.json or "peak_memory").with_suffix(".ids.json")
    ids_file.write_text(json.dumps(ids))
    rows = []
    try:
        for case, (which, what) in CASES.items():
            cmd = [sys.executable, "-m", "bench.peak_memory", "--case", case, "--ids", str(ids_file),
                   "--model", args.model, "--pruned", args.pruned, "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = {"case": case, "model": args.model if which == "dense" else args.pruned, "what": what,
                   **json.loads(out)}
            rows.append(row)
            est = row["estimate_mb"]
            print(f"{case:<46} peak {row['peak_mb']:7.0f} MB  estimate {'-' if est is None else f'{est:.0f}':>6} MB"
                  f"  after {row['after_mb']:6.0f} MB  trimmed {row.get('after_trim_mb', row['after_mb']):6.0f} MB",
                  file=sys.stderr)
    finally:
        ids_file.unlink(missing_ok=True)
    result = {"benchmark": "peak_memory", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "cases": rows,
              "note": "MB: resident memory above the process's just before the computation (peak: VmHWM); "
                      "after_trim: after malloc_trim (trim_s: its seconds); each case in a fresh process"}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
