"""How many kernels one fixed-shape decode step launches, by op: at batch 1 a step replayed from a CUDA graph
costs about its kernel count times a few microseconds (SmolLM2-135M's weights take some 0.08 ms to read at an
H100's bandwidth; 800 small kernels take several times that), so the count is what the batch-1 decode target
is won or lost by, and it can be counted on any machine.

    python -m bench.step_launches [--json FILE]

Counted on the CPU with the Triton kernels running under the interpreter (the path a GPU takes): every aten op
of the step that would launch a kernel (views, allocations and other metadata ops launch none), plus every
Triton launch. Composite ops are counted as they decompose, except RMSNorm, which CUDA builds of torch (2.8 on)
run as one fused kernel and the CPU build decomposes into six: it counts one. cuBLAS may split a matmul into more
than one kernel on some shapes: one each here.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from collections import Counter
from contextlib import contextmanager
from datetime import datetime, timezone

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit runs: the kernels run on the CPU

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from bench import env  # noqa: E402

# aten ops that move no data on the device: views and metadata, allocations (a graph's memory pool holds them)
NOT_KERNELS = {
    "view", "_unsafe_view", "expand", "as_strided", "transpose", "t", "permute", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow", "unflatten", "view_as",
    "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "_reshape_alias",
    "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense",
    "_record_function_enter_new", "_record_function_exit",  # (profiler marks, the optimizer's: no device work)
}


# composite ops a CUDA build runs as one kernel (torch >= 2.8 has a fused RMSNorm kernel for CUDA tensors)
ONE_KERNEL_ON_CUDA = {"rms_norm", "_fused_rms_norm"}


class Launches(TorchDispatchMode):
    """Counts, by op name, what the step would launch on a GPU (Triton launches are added by `triton_counted`)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "dropout" and not args[2]:
            return args[0]  # dropout at inference returns its input (its composite form clones here)
        if name in ONE_KERNEL_ON_CUDA:
            self.ops["_fused_rms_norm"] += 1
            with _disable_current_modes():
                return func(*args, **(kwargs or {}))
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # a composite op (matmul, linear under inference mode): count what it runs
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        if name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def triton_counted(counter: Counter):
    """Each Triton kernel of kernels/ counted once per launch as `triton:<name>`; the interpreter's own tensor
    traffic (copies to and from numpy) runs outside the dispatch mode and is not counted."""
    import importlib

    import triton
    saved = []

    class Counted:
        def __init__(self, fn, name):
            self.fn, self.name = fn, name

        def __getitem__(self, grid):
            launch = self.fn[grid]

            def run(*args, **kwargs):
                counter[f"triton:{self.name}"] += 1
                with _disable_current_modes():
                    return launch(*args, **kwargs)
            return run

    for module_name in ("triton_attention", "triton_keep", "triton_lag", "triton_step"):
        try:
            module = importlib.import_module(f"kernels.{module_name}")
        except ImportError:  # an older checkout (the before-and-after counts run the same script on both)
            continue
        for name, value in vars(module).items():
            # launched from Python: the `_kernel`s (the other jit functions are called inside them)
            if isinstance(value, triton.runtime.jit.KernelInterface) and name.endswith("_kernel"):
                saved.append((module, name, value))
                setattr(module, name, Counted(value, name))
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def count_step(model, state: str = "static", prompt: int = 12, capacity: int = 64) -> Counter:
    """Kernels of one fixed-shape batch-1 decode step of `model` (eval, CPU) after a `prompt`-token prefill, with
    the Triton kernels on (MIXSCOPE_KERNELS=triton for the call)."""
    from models.decode import Decoder
    with env("MIXSCOPE_KERNELS", "triton"):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (prompt + 2,), generator=gen)
        with torch.inference_mode():
            dec = Decoder(model, 1, state, capacity=capacity, fixed=True)
            dec.prefill([ids[:prompt].tolist()])
            dec.step(ids[prompt:prompt + 1])   # the first fixed step (a capture warms up on such steps too)
            if state == "compacted":
                dec.before_fixed_step()
            counts: Counter[str] = Counter()
            with triton_counted(counts), Launches() as mode:
                dec.model(ids[prompt + 1:prompt + 2].view(1, 1), cache=dec.state, last_only=True)
            counts.update(mode.ops)
    return counts


def smollm2_shaped(prune: bool = False):
    """SmolLM2-135M's architecture (30 layers, GQA 9/3, rotary, RMSNorm, SwiGLU, 49k vocabulary) with random
    weights: the count depends on the shapes, not the values (the shipped deltas need the 538 MB base)."""
    from models.config import ModelConfig
    from models.transformer import DecoderLM
    cfg = ModelConfig(mixer="gqa", vocab_size=49152, context=2048, d_model=576, n_layers=30, n_heads=9,
                      n_kv_heads=3, d_head=64, d_ff=1536, ln_eps=1e-5, norm="rmsnorm", positions="rope",
                      rope_theta=100000.0, ffn="swiglu", ffn_bias=False, tie_embeddings=True, prune=prune)
    cfg.validate()
    torch.manual_seed(0)
    return DecoderLM(cfg).eval()


def rows(shipped: list[str], dtypes: list[torch.dtype]) -> list[dict]:
    """Each case in each dtype: a bf16 model launches conversions a float32 one does not (the learned rule scores
    in float32, kernels.keep_rule.HALF)."""
    import copy

    from models.checkpoint import load_model_dir
    # the SmolLM2 deltas the app ships prune with the learned rule: they decode over the compacted cache
    cases = [("smollm2-135m shape", smollm2_shaped(), "static"),
             ("smollm2-135m shape, pruned", smollm2_shaped(prune=True), "compacted")]
    for d in shipped:
        model = load_model_dir(d, device="cpu").model.eval()
        cases.append((d, model, "static"))
        if model.config.prune:
            cases.append((d, model, "compacted"))
    out = []
    for name, model, state in cases:
        for dtype in dtypes:
            counts = count_step(copy.deepcopy(model).to(dtype), state)
            total = sum(counts.values())
            out.append({"model": name, "cache": state, "dtype": str(dtype).removeprefix("torch."),
                        "n_layers": model.config.n_layers, "kernels_per_step": total,
                        "kernels_per_layer": round(total / model.config.n_layers, 2),
                        "by_op": dict(counts.most_common())})
            print(f"{name} ({state}, {dtype}): {total} kernels a step, {total / model.config.n_layers:.1f} a layer",
                  file=sys.stderr)
    return out


def main(argv=None) -> int:
    from bench import cpu_model, report
    ap = argparse.ArgumentParser(prog="python -m bench.step_launches", description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=["assets/models/mha", "assets/models/mha-1024-pruned"],
                    help="shipped model directories to count besides SmolLM2's shape")
    ap.add_argument("--dtypes", default="bfloat16,float32",
                    help="comma-separated model dtypes (bfloat16: what a GPU decodes in; float32: the app's default)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    import triton
    result = {"benchmark": "step_launches", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": "cpu (kernels counted, not timed)", "cpu": cpu_model(), "batch": 1,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__},
              "note": __doc__.split("\n\n")[2].replace("\n", " "), "rows": rows(args.models, dtypes)}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
