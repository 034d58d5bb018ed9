"""`make gpu-check`: everything a GPU machine must show, in one command (<= 10 minutes on one H100).

    python -m bench.gpu_check [--steps 200] [--skip-tests] [--skip-bench]

1. `pytest -m gpu` (tests/test_gpu.py: every kernel against the reference in fp16/bf16 at 8k-32k context,
   d_head 64/128, GQA, MHE maps, pruning; models on Triton; bf16 autocast training steps of every mixer);
2. `python -m kernels.bench --tune` (Triton against SDPA, FlexAttention and the reference; the targets);
3. bf16 training of mha, mhe-mul, a pruned mha and we (configs/gpu/, --steps each) through models.train;
4. generation from each trained model (and the shipped zoo, where present) through the app's own loader
   (models.checkpoint.load_for_app), checking that the Triton kernels are the path actually taken;
5. batch-1 decode, eager against CUDA graphs (bench.decode_zoo), and SmolLM2 against transformers' best
   configuration (bench.decode_vs_hf --device cuda) when assets/models/smollm2-135m is there;
6. where a pruned training step's time goes beside a dense one's (bench.train_step_profile --device cuda).
Writes bench/results/{gpu_check,kernels}_<gpu>.json (+ the kernel table and the test log) with device,
versions and date. Exit status 1 if any part failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

CONFIGS = ["mha", "mhe-mul", "mha-pruned", "we"]
SHIPPED = ["mha", "mhe-mul", "mqa", "me", "mha-1024-pruned"]
PROMPT = "The committee met again on Tuesday. After a long debate about the harbour,"


def slug() -> str:
    """'h100' from 'NVIDIA H100 80GB HBM3', for file names."""
    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]+\d+[A-Z]*)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"\W+", "-", name)).lower()


def environment() -> dict:
    import triton
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def run_tests(results: Path, name: str) -> dict:
    log = results / f"gpu_tests_{name}.txt"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], capture_output=True, text=True,
                          env=os.environ | {"TRITON_INTERPRET": "0"})
    log.write_text(proc.stdout + proc.stderr)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    print(f"gpu tests: {last} ({time.perf_counter() - t0:.0f} s; log {log})", flush=True)
    return {"exit_code": proc.returncode, "summary": last, "counts": counts, "log": str(log),
            "seconds": time.perf_counter() - t0}


def run_bench(results: Path, name: str, models: list[str]) -> dict:
    out = results / f"kernels_{name}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kernels.bench", "--tune", "--json", str(out), "--table",
                           str(results / f"kernels_{name}.md"), "--models", ",".join(models)],
                          capture_output=True, text=True, env=os.environ | {"TRITON_INTERPRET": "0"})
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    print(tail, flush=True)
    return {"exit_code": proc.returncode, "json": str(out), "seconds": time.perf_counter() - t0,
            "tail": tail if proc.returncode else None}


def run_module(out: Path, module: str, *args: str) -> dict:
    """python -m module ... --json out, in a process of its own; its tail is kept when it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args, "--json", str(out)], capture_output=True, text=True,
                          env=os.environ | {"TRITON_INTERPRET": "0"})
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
    print(f"{module}: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
    if proc.returncode:
        print(tail, flush=True)
    return {"exit_code": proc.returncode, "json": str(out), "seconds": time.perf_counter() - t0,
            "tail": tail if proc.returncode else None}


def train_one(config: str, out: Path, steps: int) -> dict:
    from models.train import train
    cfg = json.loads(Path(config).read_text())
    tmp = Path(tempfile.mkdtemp()) / "config.json"
    base = Path(config).parent / cfg.get("base", "")
    cfg["base"] = str(base.resolve()) if "base" in cfg else None
    if cfg["base"] is None:
        cfg.pop("base")
    cfg.setdefault("train", {})["steps"] = steps
    tmp.write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    card = train(tmp, out, device="cuda", progress=False)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    first, last = log[0], log[-1]
    return {"config": config, "steps": card["steps"], "status": card["status"], "wall_s": time.perf_counter() - t0,
            "train_tokens_per_s": card["train_tokens_per_s"], "first_loss": first.get("loss"),
            "last_loss": last.get("loss"), "test_perplexity": card["test_perplexity"],
            "valid_sparsity": card.get("final_valid_query_sparsity"), "finite": math.isfinite(card["test_perplexity"])}


def generate_one(model_dir: str, tokens: int = 64) -> dict:
    import kernels
    from models.checkpoint import load_for_app
    from models.generate import generate
    loaded = load_for_app(model_dir, dtype="auto")  # the loader on CUDA in bf16 (the fast path)
    prompt = loaded.tokenizer.encode(PROMPT).ids
    t0 = time.perf_counter()
    generate(loaded.model, prompt, tokens, greedy=True)  # the first call compiles the kernels' specialisations
    first_s = time.perf_counter() - t0
    res = generate(loaded.model, prompt, tokens, greedy=True)
    cfg = loaded.config
    # generate() decodes a pruned model over the compacted cache, its steps through the fused pruning kernel
    want = ["lag_conv"] if cfg.mixer in ("me", "we", "he") else ["attention"]
    want += ["compact_decode"] if cfg.prune else []
    took_triton = all(res.kernel_paths.get(op) == "triton" for op in want) and bool(kernels.TRITON)
    return {"model": model_dir, "mixer": cfg.mixer, "pruned": cfg.prune, "device": str(loaded.model.wte.weight.device),
            "dtype": str(loaded.model.wte.weight.dtype), "kernel_paths": res.kernel_paths, "triton_taken": took_triton,
            "cache": res.cache_kind, "graphs": res.graphs,
            "new_tokens": len(res.new_ids), "first_call_s": first_s, "prefill_ms": res.prefill_s * 1e3,
            "tokens_per_s": res.decode_tokens_per_s, "perplexity_of_output": res.perplexity,
            "text": loaded.tokenizer.decode(res.new_ids)[:200]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--runs", default=None, help="where the trained check models go (default: a temporary dir)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch sees none); nothing to check", file=sys.stderr)
        return 1
    os.environ["TRITON_INTERPRET"] = "0"
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = slug()
    report = {"environment": environment(), "steps": args.steps}
    ok = True
    t_all = time.perf_counter()
    if not args.skip_tests:
        report["tests"] = run_tests(results, name)
        ok &= report["tests"]["exit_code"] == 0
    runs = Path(args.runs or tempfile.mkdtemp(prefix="gpu-check-"))
    trained = []
    if not args.skip_train:
        report["train"] = {}
        for c in CONFIGS:
            try:
                r = train_one(f"configs/gpu/{c}.json", runs / c, args.steps)
                trained.append(str(runs / c))
                print(f"train {c}: {r['steps']} steps in {r['wall_s']:.1f} s, {r['train_tokens_per_s']:.0f} tokens/s, "
                      f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, test ppl {r['test_perplexity']:.2f}",
                      flush=True)
                ok &= r["finite"] and r["status"] == "ok"
            except Exception as e:  # noqa: BLE001 - report every part, fail at the end
                r = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
                print(f"train {c}: FAILED {r['error']}\n{r['traceback']}", flush=True)
                ok = False
            report["train"][c] = r
    shipped = [f"assets/models/{m}" for m in SHIPPED if (Path("assets/models") / m / "model.safetensors").is_file()]
    report["generate"] = []
    for d in trained + shipped:
        try:
            g = generate_one(d)
            print(f"generate {d}: {g['dtype']} {g['kernel_paths']} {g['tokens_per_s']:.0f} tokens/s", flush=True)
            ok &= g["triton_taken"]
        except Exception as e:  # noqa: BLE001
            g = {"model": d, "error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
            print(f"generate {d}: FAILED {g['error']}\n{g['traceback']}", flush=True)
            ok = False
        report["generate"].append(g)
    report["decode"] = run_module(results / f"decode_zoo_{name}.json", "bench.decode_zoo", *(trained + shipped))
    ok &= report["decode"]["exit_code"] == 0
    if (Path("assets/models/smollm2-135m") / "model.safetensors").is_file():
        report["decode_vs_hf"] = run_module(results / f"decode_vs_hf_{name}.json", "bench.decode_vs_hf",
                                            "--device", "cuda", "--dtype", "bfloat16")
        ok &= report["decode_vs_hf"]["exit_code"] == 0
    else:
        report["decode_vs_hf"] = {"skipped": "assets/models/smollm2-135m is missing (gpu_check.sh imports it from "
                                              "the wheel's parts under .pack/, see docs/gpu.md)"}
    # where a pruned training step's time goes, beside its dense twin's in the same run (vs_dense: target >= 0.5)
    report["train_profile"] = run_module(results / f"train_step_profile_mha-pruned_{name}.json",
                                         "bench.train_step_profile",
                                         "--config", "configs/gpu/mha-pruned.json", "--alphas", "1.02,2,8",
                                         "--steps", "3", "--batch", "8", "--device", "cuda")
    if not args.skip_bench:
        report["bench"] = run_bench(results, name, (trained + shipped)[:4])
        ok &= report["bench"]["exit_code"] == 0
    report["seconds"] = time.perf_counter() - t_all
    report["ok"] = bool(ok)
    out = results / f"gpu_check_{name}.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu-check {'passed' if ok else 'FAILED'} in {report['seconds']:.0f} s: {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
