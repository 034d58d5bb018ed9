"""The alpha-sigmoid of adaptively sparse attention (papers.md section 3) and its alpha schedule.

sigma_alpha(x) = argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy) = alpha-entmax([x, 0])[0]:
the ordinary sigmoid at alpha = 1, clip((x + 1)/2, 0, 1) at alpha = 2, saturating at +-1/(alpha - 1) for
alpha > 1, and the step 1[x > 0] at alpha = inf (inference).
"""
from __future__ import annotations

import functools
import math

import torch


def _f(p: torch.Tensor, alpha: float) -> torch.Tensor:
    """The x at which the alpha-sigmoid equals p (its inverse on the open interval)."""
    a1 = alpha - 1.0
    return (p.pow(a1) - (1 - p).pow(a1)) / a1


class _AlphaSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        lim = 1.0 / (alpha - 1.0)
        # bisection on p (f is increasing on [0, 1]) to below the working precision: float64 inputs in
        # float64 (2^-54), anything else in float32 (2^-30); near alpha = 1, f cancels badly in float32
        work = torch.float64 if x.dtype == torch.float64 or alpha < 1.05 else torch.float32
        steps = 54 if work == torch.float64 else 30
        xd = x.detach().to(work).clamp(-lim, lim)
        lo, hi = torch.zeros_like(xd), torch.ones_like(xd)
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            below = _f(mid, alpha) < xd
            lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
        p = 0.5 * (lo + hi)
        p = torch.where(xd >= lim, torch.ones_like(p), torch.where(xd <= -lim, torch.zeros_like(p), p))
        ctx.alpha = alpha
        ctx.save_for_backward(p, x)
        return p.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        p, x = ctx.saved_tensors
        alpha, lim = ctx.alpha, 1.0 / (ctx.alpha - 1.0)
        inside = (x.to(p.dtype).abs() < lim) & (p > 0) & (p < 1)
        # entmax Jacobian for [x, 0]: s1 s2 / (s1 + s2) with s = p^(2 - alpha)
        tiny = torch.finfo(p.dtype).tiny
        d = 1.0 / (p.clamp_min(tiny).pow(alpha - 2) + (1 - p).clamp_min(tiny).pow(alpha - 2))
        return grad * torch.where(inside, d, torch.zeros_like(d)).to(grad.dtype), None


TABLE_POINTS = 8193


@functools.lru_cache(maxsize=4)
def _table(alpha: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """sigma_alpha and its derivative on a uniform grid over [-1/(alpha-1), 1/(alpha-1)], exact (float64)."""
    lim = 1.0 / (alpha - 1.0)
    x = torch.linspace(-lim, lim, TABLE_POINTS, dtype=torch.float64)
    p = _AlphaSigmoid.apply(x, alpha)
    d = 1.0 / (p.clamp_min(1e-300).pow(alpha - 2) + (1 - p).clamp_min(1e-300).pow(alpha - 2))
    d = torch.where((p > 0) & (p < 1), d, torch.zeros_like(d))
    return p.float().to(device), d.float().to(device)


def _lerp_table(table: torch.Tensor, x: torch.Tensor, lim: float) -> torch.Tensor:
    u = (x.float().clamp(-lim, lim) + lim) * ((TABLE_POINTS - 1) / (2 * lim))
    i0 = u.floor().clamp(max=TABLE_POINTS - 2)
    w = u - i0
    i0 = i0.long()
    return table[i0] * (1 - w) + table[i0 + 1] * w


class _AlphaSigmoidTable(torch.autograd.Function):
    """Training speed: sigma_alpha by linear interpolation in an exact table (alpha is one number per
    step), its derivative likewise; about 1e-6 from the exact value."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        lim = 1.0 / (alpha - 1.0)
        p_tab, d_tab = _table(alpha, str(x.device))
        ctx.save_for_backward(x)
        ctx.alpha, ctx.lim, ctx.d_tab = alpha, lim, d_tab
        return _lerp_table(p_tab, x, lim).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        d = _lerp_table(ctx.d_tab, x, ctx.lim)
        d = torch.where(x.float().abs() < ctx.lim, d, torch.zeros_like(d))
        return grad * d.to(grad.dtype), None


def alpha_sigmoid(x: torch.Tensor, alpha: float, exact: bool | None = None) -> torch.Tensor:
    """argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy): the sigmoid at alpha = 1, clip((x+1)/2) at
    alpha = 2, saturating at +-1/(alpha-1) for alpha > 1, the step 1[x > 0] at alpha = inf.
    exact=None: bisection for float64 inputs, the interpolated table otherwise."""
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if alpha == 1:
        return torch.sigmoid(x)
    if math.isinf(alpha):
        return (x > 0).to(x.dtype)
    if alpha == 2:
        return ((x + 1) / 2).clamp(0, 1)
    if exact is None:
        exact = x.dtype == torch.float64
    return (_AlphaSigmoid if exact or alpha < 1.05 else _AlphaSigmoidTable).apply(x, float(alpha))


def alpha_schedule(step: int, total: int, start: float = 1.0, end: float = 8.0) -> float:
    """Cosine from `start` to `end` over `total` steps, then held (reference: 8 + 0.5 (1 - 8)(1 + cos(pi s / S)))."""
    s = min(step, total) / max(total, 1)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * s))
