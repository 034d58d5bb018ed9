"""Decode cost of an eviction policy per KV group against the same policy per layer, at the same budget: per-step
latency of `generate` under each (the compacted cache; per group, a row of slots per KV group), and the dense
static cache beside them, measured in the same run, interleaved.

    python -m bench.policy_decode [--model assets/models/smollm2-135m] [--prompt 512] [--new 64] [--budget 128]
        [--policies h2o,h2o-layer,tova-group,tova] [--repeats 3] [--threads 2] [--json FILE]

Without --model: a random GQA model of SmolLM2's attention shape (9 query heads over 3 KV groups, 8 layers).
Do not run it beside training or tests (2 cores: anything else running changes the times).
"""
from __future__ import annotations

import argparse
import platform
import statistics
from datetime import datetime, timezone

import torch

from bench import cpu_model, report


def step_ms(model, ids, new: int, policy) -> float:
    from models.generate import generate
    res = generate(model, ids, new, greedy=True, policy=policy, cache="static" if policy is None else "auto")
    return 1e3 / res.decode_tokens_per_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_decode", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--policies", default="h2o,h2o-layer,tova-group,tova")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from models.pruning import policies
    if args.model:
        from models.checkpoint import load_model_dir
        model = load_model_dir(args.model, device="cpu", dtype="float32").model.eval()
    else:
        from models.config import ModelConfig
        from models.transformer import DecoderLM
        torch.manual_seed(0)
        model = DecoderLM(ModelConfig(mixer="gqa", n_kv_heads=3, n_heads=9, d_head=64, d_model=576, n_layers=8,
                                      vocab_size=8192, context=2048, positions="rope", norm="rmsnorm",
                                      ffn="swiglu")).eval()
    ids = torch.randint(0, model.config.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    names = ["dense"] + args.policies.split(",")
    make = {n: (lambda n=n: None if n == "dense" else policies.make(n, args.budget)) for n in names}
    for n in names:  # warm-up
        step_ms(model, ids[:32], 4, make[n]())
    times = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            times[n].append(step_ms(model, ids, args.new, make[n]()))
    med = {n: statistics.median(v) for n, v in times.items()}
    rows = [{"method": n, "ms_per_step": med[n], "vs_dense": med[n] / med["dense"]} for n in names]
    pairs = {}
    for n in names[1:]:
        kind = policies.parse(n)[0]
        layer_form = {"h2o": "h2o-layer", "tova-group": "tova", "snapkv": "snapkv-layer"}.get(kind.name)
        if kind.per_group and layer_form in med:
            pairs[f"{n} / {layer_form}"] = med[n] / med[layer_form]
    result = {"benchmark": "policy_decode", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu", "cpu": cpu_model(), "threads": args.threads,
              "model": args.model or "random GQA 9/3, 8 layers",
              "groups": model.blocks[0].mixer.n_groups, "prompt": args.prompt, "new_tokens": args.new,
              "budget": args.budget, "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "note": "steady-state ms per decode step (models.generate), median of interleaved repeats; a step "
                      "policy reads the prompt token by token, so only the new tokens are timed",
              "rows": rows, "per_group_over_per_layer": pairs, "seconds": times}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
