"""Causal lag convolution of the Extractors in Triton (ME: one weight per lag; WE/HE: one per lag and channel).

y[b, i, c] = sum_{j <= i} x[b, j, c] * w[i - j, (c)] for the output positions i = start..S-1: the whole
sequence at prefill, the last position alone at a decode step. SHE's lag weights are matrices; it stays on
the reference's FFT/batched-matmul path (bench.kernels measures it against the matmul rate).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import precision


@triton.jit
def _lag_kernel(X, W, Y, sxb, sxs, syb, sys, S, C, start, n_out,
                PER_CHANNEL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr,
                BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: b x S x C can pass 2^31
    pt = tl.program_id(1)
    pc = tl.program_id(2)
    offs_o = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_i = start + offs_o                      # the output positions of this tile
    i_mask = offs_o < n_out
    offs_c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    hi = tl.minimum(S, start + (pt + 1) * BLOCK_T)  # sources after the tile's last output never contribute
    for j0 in range(0, hi, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_mask = offs_j < S
        x = tl.load(X + b * sxb + offs_j[:, None] * sxs + offs_c[None, :], mask=j_mask[:, None] & c_mask[None, :],
                    other=0.0).to(tl.float32)                                        # [J, C]
        lag = offs_i[:, None] - offs_j[None, :]                                      # [T, J]
        lmask = (lag >= 0) & i_mask[:, None] & j_mask[None, :]
        lag = tl.where(lmask, lag, 0)
        if PER_CHANNEL:
            w = tl.load(W + lag[:, :, None] * C + offs_c[None, None, :], mask=lmask[:, :, None] & c_mask[None, None, :],
                        other=0.0).to(tl.float32)                                    # [T, J, C]
            acc += tl.sum(w * x[None, :, :], 1)
        else:
            w = tl.load(W + lag, mask=lmask, other=0.0).to(tl.float32)              # [T, J]: a Toeplitz tile
            acc += tl.dot(w, x, input_precision=PRECISION)
    tl.store(Y + b * syb + offs_o[:, None] * sys + offs_c[None, :], acc.to(Y.dtype.element_ty),
             mask=i_mask[:, None] & c_mask[None, :])


def lag_conv(x: torch.Tensor, w: torch.Tensor, start: int = 0) -> torch.Tensor:
    """x [B,S,C], w [L] or [L,C] (L >= S) -> [B, S-start, C]; see kernels.reference.lag_conv."""
    b, s, c = x.shape
    if w.dim() not in (1, 2):
        raise ValueError("the Triton lag convolution takes per-lag ([L]) or per-lag-and-channel ([L,C]) weights")
    if s > w.shape[0]:
        raise ValueError(f"sequence of {s} positions exceeds the {w.shape[0]} lag weights")
    if not 0 <= start < s:
        raise ValueError(f"start must be in [0, {s}), got {start}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.contiguous()
    n_out = s - start
    y = torch.empty(b, n_out, c, dtype=x.dtype, device=x.device)
    per_channel = w.dim() == 2
    bt = min(32 if per_channel else 64, max(16, triton.next_power_of_2(n_out)))
    bj = 16 if per_channel else 32
    bc = min(32 if per_channel else 64, max(16, triton.next_power_of_2(c)))
    grid = (b, triton.cdiv(n_out, bt), triton.cdiv(c, bc))
    _lag_kernel[grid](x, w, y, x.stride(0), x.stride(1), y.stride(0), y.stride(1), s, c, start, n_out,
                      PER_CHANNEL=per_channel, PRECISION=precision(x.dtype), BLOCK_T=bt, BLOCK_J=bj, BLOCK_C=bc)
    return y
