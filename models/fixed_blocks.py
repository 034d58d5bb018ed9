"""The blocks of a fixed-shape decode step (models.decode.Decoder with fixed shapes or CUDA graphs; models.graphs).

At batch 1 such a step costs about its kernel count. Nothing reads the residual stream between two blocks, so each
block's last residual sum is left to the next block's norm, which adds and normalises in one kernel
(kernels.add_norm, as vLLM's norms take a residual); only the last sum is made here. The same sums as
Block.forward, in the same order: the equal-output tests compare the two paths."""
from __future__ import annotations

import torch


def run(blocks, x: torch.Tensor, state, positions: torch.Tensor) -> torch.Tensor:
    """x [B,1,d_m] through every block over `state`'s layers (no diagnostics, no patching)."""
    pending = None
    for block, layer in zip(blocks, state.layers):
        x, a = (x, block.ln_1(x)) if pending is None else block.ln_1(x, pending)
        x, pending = block.sublayers(x, a, layer, None, positions)
    return x + pending
