"""Decode cost of context pruning: per-step latency, tokens/s and cache bytes against context length, dense
(static cache) vs pruned (compacted cache), at batch 1 and at the largest batch whose cache fits a budget.

    python -m bench.pruning_decode --dense DIR --pruned DIR [--contexts 128,256,512,1024] [--json FILE]
    python -m bench.pruning_decode --synthetic [...]     # random weights; pruned beta set for a target sparsity
    --data DIR   prompts from DIR/test.npy (real text) instead of random token ids

Ratios are against the dense model measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

from bench import cpu_model

from models.checkpoint import load_model_dir
from models.config import ModelConfig
from models.decode import Decoder
from models.device import add_arguments as add_device_arguments, describe as device_name, inference_dtype, resolve
from models.transformer import DecoderLM


def synthetic_pair(context: int, beta: float, seed: int = 0) -> tuple[DecoderLM, DecoderLM]:
    base = dict(mixer="mha", vocab_size=8192, context=context, d_model=128, n_layers=4, n_heads=8)
    torch.manual_seed(seed)
    dense = DecoderLM(ModelConfig(**base)).eval()
    pruned = DecoderLM(ModelConfig(**base, prune=True, prune_r=64)).eval()
    pruned.load_state_dict(dense.state_dict(), strict=False)
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(beta)
    return dense, pruned


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def token_rows(batch: int, length: int, vocab: int, text=None, seed: int = 0) -> torch.Tensor:
    """[batch, length] token ids: consecutive windows of real text (a trained pruned model drops what it
    learned to drop there; random ids say little about that), or uniform random ids."""
    if text is None:
        return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
    need = batch * length
    rows = np.resize(np.asarray(text), need) if len(text) < need else np.asarray(text[:need])  # a short split repeats
    return torch.from_numpy(rows.astype(np.int64)).view(batch, length)


@torch.inference_mode()
def decode_run(model, batch: int, context: int, steps: int, compact: bool, seed: int = 0, text=None) -> dict:
    """Prefill context - steps tokens, then time `steps` one-token decode steps (the text's next tokens)."""
    dev = model.wte.weight.device
    ids = token_rows(batch, context, model.config.vocab_size, text, seed).to(dev)
    prompt, nxt = ids[:, :context - steps], ids[:, context - steps:]
    dec = Decoder(model, batch, "compacted" if compact else "static", capacity=None if compact else context)
    dec.extend(prompt, last_only=True)
    times = []
    for i in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        dec.step(nxt[:, i])
        _sync(dev)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {"batch": batch, "context": context, "median_step_ms": med * 1000, "tokens_per_s": batch / med,
           "cache_bytes": dec.state.nbytes()}
    if compact:
        live = dec.state.live_tokens()
        out["kept_fraction"] = live / (model.config.n_layers * batch * context)
    return out


def largest_batch(bytes_per_sequence: float, budget: int, cap: int) -> int:
    return max(1, min(cap, int(budget // max(bytes_per_sequence, 1))))


def run(dense, pruned, contexts: list[int], steps: int, budget: int, max_batch: int, batch1_only: bool = False,
        text=None) -> list[dict]:
    rows = []
    for c in contexts:
        d1 = decode_run(dense, 1, c, steps, compact=False, text=text)
        p1 = decode_run(pruned, 1, c, steps, compact=True, text=text)
        row = {"context": c, "dense_b1": d1, "pruned_b1": p1,
               "latency_ratio_pruned_to_dense": p1["median_step_ms"] / d1["median_step_ms"],
               "cache_ratio_pruned_to_dense": p1["cache_bytes"] / d1["cache_bytes"]}
        if batch1_only:
            rows.append(row)
            print(f"context {c}: dense {d1['median_step_ms']:.2f} ms, pruned {p1['median_step_ms']:.2f} ms "
                  f"(kept {p1['kept_fraction']:.0%})", file=sys.stderr)
            continue
        bd = largest_batch(d1["cache_bytes"], budget, max_batch)
        bp = largest_batch(p1["cache_bytes"], budget, max_batch)
        row["dense_budget"] = decode_run(dense, bd, c, steps, compact=False, text=text)
        row["pruned_budget"] = decode_run(pruned, bp, c, steps, compact=True, text=text)
        row["throughput_ratio_at_budget"] = row["pruned_budget"]["tokens_per_s"] / row["dense_budget"]["tokens_per_s"]
        rows.append(row)
        print(f"context {c}: dense {d1['median_step_ms']:.2f} ms, pruned {p1['median_step_ms']:.2f} ms "
              f"(kept {p1['kept_fraction']:.0%}), budget batches {bd}/{bp}, "
              f"throughput x{row['throughput_ratio_at_budget']:.2f}",
              file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pruning_decode")
    ap.add_argument("--dense")
    ap.add_argument("--pruned")
    ap.add_argument("--synthetic", action="store_true", help="random weights (no trained pruned model needed)")
    ap.add_argument("--beta", type=float, default=-1.5, help="synthetic: the pruned model's beta (lower drops more)")
    ap.add_argument("--contexts", default="128,256,512,1024")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--budget-mb", type=float, default=64.0, help="cache memory budget for the large-batch runs")
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (set, not inherited: 2 cores thrash easily)")
    ap.add_argument("--data",
                    help="prompts from DIR/test.npy (real text, in the models' tokenizer) instead of random ids")
    ap.add_argument("--batch1-only", action="store_true", help="skip the runs at the cache budget (large models)")
    ap.add_argument("--json")
    add_device_arguments(ap, dtype="float32")
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    if args.synthetic:
        dense, pruned = synthetic_pair(max(contexts), args.beta)
        dev = resolve(args.device)
        dense, pruned = (m.to(device=dev, dtype=inference_dtype(dev, args.dtype)) for m in (dense, pruned))
        source = {"kind": "synthetic", "beta": args.beta, "note": "random weights: latency and memory only, no quality"}
    elif args.dense and args.pruned:
        dense, pruned = (load_model_dir(p, device=args.device, dtype=args.dtype).model.eval()
                         for p in (args.dense, args.pruned))
        source = {"kind": "trained", "dense": args.dense, "pruned": args.pruned}
        for m in (dense, pruned):
            if max(contexts) > m.config.context:
                if m.config.positions != "rope":
                    ap.error(f"context {max(contexts)} exceeds {m.config.context}, the learned position table's size")
                # rotary positions have no table: a fine-tune's shorter context is a training choice, and the
                # pruning rule is applied past it as it is (the row says so)
                source["context_raised_from"] = m.config.context
                m.config.context = max(contexts)
    else:
        ap.error("give --dense and --pruned model directories, or --synthetic")
    text = None
    if args.data:
        from models.data.corpus import load_tokens
        text = load_tokens(args.data, "test")
        source["prompts"] = f"{args.data}/test.npy, consecutive windows"
    else:
        source.setdefault("prompts", "uniform random token ids")
    rows = run(dense, pruned, contexts, args.steps, int(args.budget_mb * 2**20), args.max_batch, args.batch1_only, text)
    result = {"benchmark": "pruning_decode", "device": device_name(dense.wte.weight.device),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "models": source, "steps": args.steps, "budget_bytes": int(args.budget_mb * 2**20), "rows": rows}
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
