"""Context pruning's keep structure for training in Triton: log I, I, sigma'/sigma and the sparsity loss's mass
from the scores in one pass, and the gradient back to the scores in one more (kernels.reference.log_keep /
log_keep_grad say what they compute).

In PyTorch the chain is some 40 elementwise passes over [B,T,T] float32 a layer forward (the interpolated
alpha-sigmoid alone is about 25), each a full read and write of the tensor; here each program owns a strip of key
columns j and walks the query rows n in tiles, carrying the running sum (log I) and product (I) of its columns from
tile to tile. Tiles wholly above the diagonal only write their constants. Each program also sums its strip's I
below the diagonal (the mass, summed over strips by the caller), so the step needs no tril, sum and mean over
[B,T,T] forward, nor a [B,T,T] gradient of I backward: the mass's gradient is one number. Float32 only (the exact
float64 bisection stays on the reference). The gradient's floor is float32's smallest normal
(kernels.reference.log_keep).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.alpha_sigmoid import _table
from kernels.keep_rule import LOG_FLOOR

BLOCK_N, BLOCK_J, WARPS = 32, 64, 4
SIGMOID, CLAMP, TABLE = 0, 1, 2  # alpha = 1, alpha = 2, the interpolated table (every other finite alpha)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _gates(X, P, D, offs, m, j, lim, scale, half, sinks, MODE: tl.constexpr):
    """sigma_alpha(x) and sigma'(x) for one tile, as kernels.reference.log_keep's alpha_sigmoid_slope computes them
    (a NaN score stays NaN in sigma, slope 0)."""
    x = tl.load(X + offs, mask=m, other=0.0)
    nan = x != x
    xs = tl.where(nan, 0.0, x)
    if MODE == 0:
        s = 1.0 / (1.0 + tl.exp(-xs))
        d = s * (1.0 - s)
    elif MODE == 1:
        y = (xs + 1.0) * 0.5
        s = tl.minimum(tl.maximum(y, 0.0), 1.0)
        d = tl.where((y >= 0.0) & (y <= 1.0), 0.5, 0.0)
    else:  # the index counted from the grid's centre, as alpha_sigmoid._lerp_tables does
        # scale = half / lim from the table's params, rounded from float64 as alpha_sigmoid._lerp_tables has it
        # (a GPU's float32 division is approximate); u clamped too: the product can pass half by an ulp, and w
        # outside [0, 1] made sigma negative at the grid's end (NaN log I on an H200 at alpha 4)
        u = tl.minimum(tl.maximum(tl.minimum(tl.maximum(xs, -lim), lim) * scale, -half), half)
        i0 = tl.minimum(tl.maximum(tl.floor(u), -half), half - 1)
        w = u - i0
        idx = (i0 + half).to(tl.int32)
        s = tl.load(P + idx) * (1.0 - w) + tl.load(P + idx + 1) * w
        d = tl.load(D + idx) * (1.0 - w) + tl.load(D + idx + 1) * w
        d = tl.where(tl.abs(xs) < lim, d, 0.0)
    s = tl.where(nan, x, s)
    d = tl.where(nan, 0.0, d)
    sink = j[None, :] < sinks
    return tl.where(sink, 1.0, s), tl.where(sink, 0.0, d)


@triton.jit
def _forward_kernel(X, P, D, PARAMS, LOG, KEEP, RATIO, PART, T, log_floor, sinks, inv_b,
                    MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: B x T x T passes 2^31 at batch 32, 8k tokens
    if MODE == 2:  # the table's (lim, half / lim, half), read on the device: a captured step's next alpha
        lim, scale, half = tl.load(PARAMS), tl.load(PARAMS + 1), tl.load(PARAMS + 2)  # changes no argument
    else:
        lim, scale, half = 1.0, 1.0, 1.0
    j0 = tl.program_id(1) * BLOCK_J
    j = j0 + tl.arange(0, BLOCK_J)
    jm = j < T
    base = b * T * T
    run_log = tl.zeros([BLOCK_J], tl.float32)
    run_keep = tl.full([BLOCK_J], 1.0, tl.float32)
    mass = tl.zeros([BLOCK_J], tl.float32)  # this strip's I below the diagonal, per column
    for n0 in range(0, T, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        offs = base + n[:, None].to(tl.int64) * T + j[None, :]
        m = (n < T)[:, None] & jm[None, :]
        if n0 + BLOCK_N <= j0:  # every query row before every key column: nothing to read
            tl.store(LOG + offs, tl.full([BLOCK_N, BLOCK_J], float("-inf"), LOG.dtype.element_ty), mask=m)
            tl.store(KEEP + offs, tl.zeros([BLOCK_N, BLOCK_J], tl.float32), mask=m)
            tl.store(RATIO + offs, tl.zeros([BLOCK_N, BLOCK_J], tl.float32), mask=m)
        else:
            s, d = _gates(X, P, D, offs, m, j, lim, scale, half, sinks, MODE)
            later = j[None, :] < n[:, None]
            causal = j[None, :] <= n[:, None]
            # the floor 1e-40 is a subnormal, which a GPU's log may flush to 0 (then -inf, floored here alike)
            ls = tl.log(s)
            term = tl.where(later, tl.maximum(ls, log_floor, propagate_nan=tl.PropagateNan.ALL), 0.0)
            csum = tl.cumsum(term, axis=0) + run_log[None, :]
            run_log += tl.sum(term, axis=0)
            g = tl.where(later, s, 1.0)
            cprod = tl.cumprod(g, axis=0) * run_keep[None, :]
            run_keep *= tl.reduce(g, 0, _mul)
            tl.store(LOG + offs, tl.where(causal, csum, float("-inf")).to(LOG.dtype.element_ty), mask=m)
            tl.store(KEEP + offs, tl.where(causal, cprod, 0.0), mask=m)
            mass += tl.sum(tl.where(later & m, cprod, 0.0), axis=0)
            # a gradient only from the smallest normal float32 up (as the reference): never d / (a flushed 0)
            tl.store(RATIO + offs, tl.where(later & (s >= 1.1754943508222875e-38), d / s, 0.0), mask=m)
    tl.store(PART + b * tl.num_programs(1) + tl.program_id(1), tl.sum(mass, axis=0) * inv_b)


@triton.jit
def _backward_kernel(GLOG, GKEEP, GMASS, KEEP, RATIO, DX, T, inv_b, HAS_LOG: tl.constexpr, HAS_KEEP: tl.constexpr,
                     HAS_MASS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BLOCK_J
    j = j0 + tl.arange(0, BLOCK_J)
    jm = j < T
    base = b * T * T
    run = tl.zeros([BLOCK_J], tl.float32)  # sum of W over the rows below this tile
    if HAS_MASS:  # dL/dmass / B reaches every I below the diagonal (read on the device: no host sync)
        g_pair = tl.load(GMASS) * inv_b
    tiles = tl.cdiv(T, BLOCK_N)
    for i in range(0, tiles):
        n0 = (tiles - 1 - i) * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        offs = base + n[:, None].to(tl.int64) * T + j[None, :]
        m = (n < T)[:, None] & jm[None, :]
        if n0 + BLOCK_N <= j0:  # above the diagonal: W is 0 and so is the ratio
            tl.store(DX + offs, tl.zeros([BLOCK_N, BLOCK_J], tl.float32), mask=m)
        else:
            w = tl.zeros([BLOCK_N, BLOCK_J], tl.float32)
            if HAS_LOG:
                w += tl.load(GLOG + offs, mask=m, other=0.0).to(tl.float32)
            if HAS_KEEP or HAS_MASS:
                keep = tl.load(KEEP + offs, mask=m, other=0.0)
                if HAS_KEEP:
                    w += tl.load(GKEEP + offs, mask=m, other=0.0) * keep
                if HAS_MASS:
                    w += tl.where(j[None, :] < n[:, None], g_pair * keep, 0.0)
            w = tl.where(m & (j[None, :] <= n[:, None]), w, 0.0)
            r = tl.cumsum(w, axis=0, reverse=True) + run[None, :]
            run += tl.sum(w, axis=0)
            tl.store(DX + offs, r * tl.load(RATIO + offs, mask=m, other=0.0), mask=m)


def _square(t: torch.Tensor) -> None:
    if t.dim() != 3 or t.shape[1] != t.shape[2] or t.dtype != torch.float32:
        raise ValueError(f"expected float32 scores [B,T,T], got {tuple(t.shape)} {t.dtype}")


def log_keep(x: torch.Tensor, *, alpha: float, sinks: int = 0, log_dtype: torch.dtype | None = None):
    """x [B,T,T] float32 -> (log I, I, ratio, mass); see kernels.reference.log_keep. log_dtype (float32, bf16 or
    fp16): log I rounded to it in the kernel (on a GPU to nearest even, as a cast after it would; Triton's CPU
    interpreter truncates)."""
    _square(x)
    if not 1 <= alpha < math.inf:
        raise ValueError(f"the Triton keep structure takes a finite alpha >= 1 (training), got {alpha}")
    x = x.contiguous()
    b, t, _ = x.shape
    if alpha == 1:
        mode, (p_tab, d_tab, params) = SIGMOID, (x, x, x)
    elif alpha == 2:
        mode, (p_tab, d_tab, params) = CLAMP, (x, x, x)
    else:  # (a TableSlot's buffers while one is in use: alpha_sigmoid._table)
        mode, (p_tab, d_tab, params) = TABLE, _table(float(alpha), str(x.device))
    log_i = torch.empty_like(x, dtype=log_dtype or x.dtype)
    keep, ratio = torch.empty_like(x), torch.empty_like(x)
    strips = triton.cdiv(t, BLOCK_J)
    part = torch.empty(b, strips, dtype=torch.float32, device=x.device)  # each strip's mass, over B already
    _forward_kernel[(b, strips)](x, p_tab, d_tab, params, log_i, keep, ratio, part, t, math.log(LOG_FLOOR), sinks,
                                 1.0 / b, MODE=mode, BLOCK_N=BLOCK_N, BLOCK_J=BLOCK_J, num_warps=WARPS)
    return log_i, keep, ratio, part.sum()


def log_keep_grad(g_log, g_keep, keep: torch.Tensor, ratio: torch.Tensor, g_mass=None) -> torch.Tensor:
    """dL/dx; see kernels.reference.log_keep_grad (g_mass: a 0-dim tensor on the device)."""
    _square(keep)
    b, t, _ = keep.shape
    dx = torch.empty_like(keep)
    g_log = None if g_log is None else g_log.contiguous()  # (bf16 when log I went on in it: read as float32)
    g_keep = None if g_keep is None else g_keep.float().contiguous()
    g_mass = None if g_mass is None else g_mass.float()
    _backward_kernel[(b, triton.cdiv(t, BLOCK_J))](
        keep if g_log is None else g_log, keep if g_keep is None else g_keep, keep if g_mass is None else g_mass,
        keep.contiguous(), ratio.contiguous(), dx, t, 1.0 / b, HAS_LOG=g_log is not None, HAS_KEEP=g_keep is not None,
        HAS_MASS=g_mass is not None, BLOCK_N=BLOCK_N, BLOCK_J=BLOCK_J, num_warps=WARPS)
    return dx
