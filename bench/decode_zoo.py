"""Batch-1 greedy decode of models through the app's loader (app.loading.load_for_app: CUDA, bf16), each
step eager (Python launching every kernel) and replayed from a CUDA graph (models.graphs), same run, same
prompt: tokens/s of both, their ratio, and whether the tokens agree. A pruned model runs over the static and the
compacted cache, and on a GPU over the compacted one again with the decode's keep pass (keep_pass: true).

    python -m bench.decode_zoo assets/models/mha ... [--tokens 128] [--repeats 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import datetime, timezone

import torch

from bench import env, report

PROMPT = "The committee met again on Tuesday. After a long debate about the harbour,"


def rate(model, ids, n, graphs, cache="static") -> tuple[list[int], float, dict]:
    from models.generate import generate
    res = generate(model, ids, n, greedy=True, cache=cache, graphs=graphs)
    return res.new_ids, res.decode_tokens_per_s, res.kernel_paths


def zoo(args) -> list[dict]:
    """A row per model and cache (and keep pass): eager and graph repeats interleaved; the rows one after another."""
    from models import graphs as graphs_module
    from app.loading import load_for_app
    rows = []
    for d in args.models:
        loaded = load_for_app(d, dtype="auto")
        model, ids = loaded.model, loaded.tokenizer.encode(PROMPT).ids
        # a pruned model also over the compacted cache (what it drops is freed; generation's default for it), and
        # on a GPU with the Triton decode's keep pass too (MIXSCOPE_KEEP_PASS: its end-to-end A/B)
        runs = [("static", False)]
        if loaded.config.prune:
            runs.append(("compacted", False))
            if model.wte.weight.is_cuda:
                runs.append(("compacted", True))
        for cache, keep_pass in runs:
            os.environ["MIXSCOPE_KEEP_PASS"] = "1" if keep_pass else "0"
            why = graphs_module.refusal(model, cache)
            can = why is None and model.wte.weight.is_cuda
            rate(model, ids, 8, False, cache)
            if can:
                rate(model, ids, 8, True, cache)  # captures the step (kept for the timed runs: the app's case too)
            eager, graphed = [], []
            for _ in range(args.repeats):  # interleaved
                want, r, paths = rate(model, ids, args.tokens, False, cache)
                eager.append(r)
                if can:
                    got, r, _ = rate(model, ids, args.tokens, True, cache)
                    graphed.append(r)
            row = {"model": d, "mixer": loaded.config.mixer, "pruned": loaded.config.prune, "cache": cache,
                   **({"keep_pass": keep_pass} if cache == "compacted" else {}),
                   "n_layers": loaded.config.n_layers, "dtype": str(model.wte.weight.dtype),
                   "kernel_paths": paths,  # (what the eager runs took: the keep pass is Triton's alone)
                   "eager_tokens_per_s": statistics.median(eager)}
            if can:
                row.update(graphs_tokens_per_s=statistics.median(graphed),
                           ratio=statistics.median(graphed) / statistics.median(eager),
                           identical_tokens=sum(a == b for a, b in zip(got, want)), tokens=args.tokens)
            else:
                row["graphs"] = why or "no CUDA device"
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        graphs_module.release(model)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_zoo", description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with env("MIXSCOPE_KEEP_PASS"):  # (zoo() switches it: the caller's setting back after)
        rows = zoo(args)
    result = {"benchmark": "decode_zoo", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "note": "steady-state tokens/s after the first new token (models.generate), median of interleaved "
                      "repeats, greedy, batch 1, a sync per token (streaming)", "rows": rows}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
