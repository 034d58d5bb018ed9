"""Kernel functions behind one dispatch: Triton for CUDA tensors, the reference otherwise.

`MIXSCOPE_KERNELS=reference|triton` overrides the choice. The app, `generate` and the
benchmarks all call these functions, so they run the same code.
"""
from __future__ import annotations

import os

from kernels import reference

# Triton implementations register here by op name (none are built yet: see README).
TRITON: dict[str, object] = {}
_last_path: dict[str, str] = {}


def backend_for(op: str, tensor) -> str:
    forced = os.environ.get("MIXSCOPE_KERNELS", "").strip().lower()
    if forced not in ("", "reference", "triton"):
        raise ValueError(f"MIXSCOPE_KERNELS must be 'reference' or 'triton', got {forced!r}")
    if forced == "triton":
        if op not in TRITON:
            raise RuntimeError(f"MIXSCOPE_KERNELS=triton, but this build has no Triton kernel for {op!r}")
        return "triton"
    if forced == "reference":
        return "reference"
    return "triton" if tensor.is_cuda and op in TRITON else "reference"


def _call(op: str, tensor, *args, **kwargs):
    path = backend_for(op, tensor)
    _last_path[op] = path
    impl = TRITON[op] if path == "triton" else getattr(reference, op)
    return impl(tensor, *args, **kwargs)


def last_paths() -> dict[str, str]:
    """Which implementation each op used on its latest call (shown by the app)."""
    return dict(_last_path)


def attention(q, k, v, *, scale: float, bias=None, need_weights: bool = False, causal: bool = True):
    return _call("attention", q, k, v, scale=scale, bias=bias, need_weights=need_weights, causal=causal)


def lag_conv(x, w, start: int = 0):
    return _call("lag_conv", x, w, start)
