"""Training throughput of our decoder (MHA mixer) against a plain nanoGPT-style model of the same size,
measured in the same run, interleaved step by step so both see the same machine state.

    python -m bench.train_throughput [--steps 30] [--json bench/results/train_throughput_cpu.json]

The reference is written the nanoGPT way: one fused QKV linear, scaled_dot_product_attention(is_causal),
GELU MLP, pre-LN, tied head. Same widths, same batch, same optimizer (AdamW), same loss.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.params import count_parameters
from models.device import describe as device_name
from models.transformer import DecoderLM


class RefBlock(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.d_model), nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(RefBlock(cfg.d_model, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def step_fn(model, loss_of):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x, y):
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train_throughput")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = ModelConfig(mixer="mha", vocab_size=8192, context=256, d_model=128, n_layers=4, n_heads=8)
    torch.manual_seed(0)
    ours, ref = DecoderLM(cfg), RefGPT(cfg)
    steps = {"ours": step_fn(ours, lambda m, x, y: m(x, targets=y).loss),
             "nanogpt_reference": step_fn(ref, lambda m, x, y: m(x, y))}
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.context))
    y = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.context))
    times = {k: [] for k in steps}
    for i in range(args.warmup + args.steps):
        for name, fn in steps.items():  # interleaved: both see the same machine state
            t0 = time.perf_counter()
            fn(x, y)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    tokens = args.batch_size * cfg.context
    result = {
        "benchmark": "train_throughput", "device": device_name(torch.device("cpu")),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "config": cfg.to_dict(), "batch_size": args.batch_size, "steps": args.steps,
        "params": {"ours": count_parameters(ours)["total"],
                   "nanogpt_reference": sum(p.numel() for p in ref.parameters())},
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
    }
    result["ratio_ours_to_reference"] = result["tokens_per_s"]["ours"] / result["tokens_per_s"]["nanogpt_reference"]
    text = json.dumps(result, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0 if math.isfinite(result["ratio_ours_to_reference"]) else 1


if __name__ == "__main__":
    sys.exit(main())
