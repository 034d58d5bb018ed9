"""How many kernels one training step launches, and how many aten calls it makes, for a run config's model beside
its dense twin: on a GPU a pruned step of configs/gpu/mha-pruned.json waits on the host (an H200 was busy 24 of its
42-51 ms), so what the step dispatches is what it is won or lost by, and it can be counted on any
machine.

    python -m bench.train_launches --config configs/gpu/mha-pruned.json [--alphas 1.02,2] [--json FILE]

Counted on the CPU at a toy shape (the config's layers, width and heads; --batch x --context tokens, vocabulary
--vocab), forward + backward + a foreach AdamW (models.train and bench.train_step_profile clip
the gradient first and use the fused AdamW on a GPU, one kernel for every parameter: foreach here, so the counts
stay comparable across results files), under bf16 autocast as models.train runs on a GPU, with the Triton
kernels under the interpreter (bench.step_launches's counting: views and allocations launch nothing; aten_calls
counts every call but SDPA's own inner ones). Two things are counted as a GPU runs them rather than as the CPU
does: attention (SDPA: one kernel forward and one backward, one more to sum a broadcast bias's gradient over the
heads; the CPU would decompose it) and the foreach optimizer (one kernel per foreach op; CUDA splits long lists
into a few). The counts are an estimate of the GPU's (the profile's device_kernels is the measurement), made to
compare two versions of a step.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit runs: the kernels run on the CPU

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from bench import env  # noqa: E402
from bench.step_launches import Launches, triton_counted  # noqa: E402


class _Calls(TorchDispatchMode):
    """Every aten call (launching or not): on a host-bound step each costs the host its dispatch."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _heads_inner(t: torch.Tensor) -> torch.Tensor:
    """t [B,H,T,D] laid out as [B,T,H,D] in memory, as CUDA's flash and memory-efficient kernels write their output
    and gradients (the CPU's math path writes [B,H,T,D], whose transpose back would be counted as a copy)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t


@contextmanager
def sdpa_as_on_cuda(counter: Counter):
    """F.scaled_dot_product_attention counted as one kernel each way (flash / memory-efficient on CUDA), plus the
    sum of a bias gradient over the heads it was broadcast to; computed by the real SDPA outside the counting."""
    real = F.scaled_dot_product_attention

    class OneKernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, mask, kw):
            counter["sdpa forward"] += 1
            ctx.save_for_backward(q, k, v, mask)
            ctx.kw = kw
            with _disable_current_modes():
                return _heads_inner(real(q, k, v, attn_mask=mask, **kw))

        @staticmethod
        def backward(ctx, g):
            q, k, v, mask = ctx.saved_tensors
            counter["sdpa backward"] += 1
            with _disable_current_modes(), torch.enable_grad():
                ins = [t.detach().requires_grad_(need) for t, need in zip((q, k, v, mask), ctx.needs_input_grad)
                       if t is not None]
                mask_in = ins[3] if mask is not None else None
                out = real(*ins[:3], attn_mask=mask_in, **ctx.kw)
                wanted = [t for t in ins if t.requires_grad]
                got = iter(torch.autograd.grad(out, wanted, g))
                grads = [next(got) if t is not None and need else None
                         for t, need in zip((q, k, v, mask), ctx.needs_input_grad)]
                grads[:3] = [None if g is None else _heads_inner(g) for g in grads[:3]]
            if mask is not None and ctx.needs_input_grad[3] and mask.shape[1] == 1 and q.shape[1] > 1:
                counter["sdpa bias gradient summed over heads"] += 1
            return (*grads, None)

    def sdpa(q, k, v, attn_mask=None, **kw):
        return OneKernel.apply(q, k, v, attn_mask, kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real


def count(model, alpha, batch: int, context: int, gamma: float = 0.3) -> dict:
    """Kernels and aten calls of one training step of `model` (train mode) at `alpha` (None: dense)."""
    from models.pruning import pair_count, sparsity_loss
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=True)
    if alpha is not None:
        model.set_alpha(alpha)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = model(x, targets=y)
            loss = res.loss if res.prune_mass is None else \
                res.loss + sparsity_loss(res.prune_mass, gamma, pair_count(model.config.n_layers, context))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with env("MIXSCOPE_KERNELS", "triton"):
        step()  # (the optimizer's state is built in its first step)
        counts: Counter[str] = Counter()
        with sdpa_as_on_cuda(counts), triton_counted(counts), Launches() as mode:
            step()
        counts.update(mode.ops)
        with sdpa_as_on_cuda(Counter()), triton_counted(Counter()), _Calls() as calls:  # (not the interpreter's)
            step()
    total = sum(counts.values())
    return {"model": "dense" if alpha is None else "pruned", "alpha": alpha, "kernels_per_step": total,
            "kernels_per_layer": round(total / model.config.n_layers, 2), "aten_calls": calls.n,
            "by_op": dict(counts.most_common())}


def rows(config: str, alphas: list[float], batch: int, context: int, vocab: int) -> list[dict]:
    from models.adapters import set_trainable_params, trainable_params
    from models.train import load_run_config
    from models.transformer import DecoderLM
    cfg, tc, _ = load_run_config(config)
    cfg = dataclasses.replace(cfg, context=context, vocab_size=vocab)
    out = []
    cases = [(dataclasses.replace(cfg, prune=False, prune_distance=False, prune_sinks=0), False, [None])]
    if cfg.prune:
        cases.append((cfg, tc.freeze_base, alphas))
    for c, freeze, case_alphas in cases:
        for alpha in case_alphas:
            torch.manual_seed(0)
            model = DecoderLM(c).train()
            set_trainable_params(model, trainable_params(model, freeze))
            out.append(count(model, alpha, batch, context))
            r = out[-1]
            print(f"{r['model']} alpha={alpha}: {r['kernels_per_step']} kernels, {r['aten_calls']} aten calls a step",
                  file=sys.stderr)
    return out


def main(argv=None) -> int:
    from bench import cpu_model, report
    ap = argparse.ArgumentParser(prog="python -m bench.train_launches", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/gpu/mha-pruned.json")
    ap.add_argument("--alphas", default="1.02,2")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import triton
    from models.files import code_version
    result = {"benchmark": "train_launches", "commit": code_version(), "config": args.config, "batch": args.batch,
              "context": args.context,
              "vocab": args.vocab, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu (kernels counted, not timed)", "cpu": cpu_model(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__},
              "note": __doc__.split("\n\n")[2].replace("\n", " "),
              "rows": rows(args.config, [float(a) for a in args.alphas.split(",")], args.batch, args.context,
                           args.vocab)}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
