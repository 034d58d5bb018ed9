"""The alpha-sigmoid of adaptively sparse attention (papers.md section 3) and its alpha schedule.

sigma_alpha(x) = argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy) = alpha-entmax([x, 0])[0]:
the ordinary sigmoid at alpha = 1, clip((x + 1)/2, 0, 1) at alpha = 2, saturating at +-1/(alpha - 1) for
alpha > 1, and the step 1[x > 0] at alpha = inf (inference).
"""
from __future__ import annotations

import functools
import math

import torch


def _f_log(t: torch.Tensor, alpha: float) -> torch.Tensor:
    """The x at which the alpha-sigmoid equals p = e^t (its inverse, (p^(a-1) - (1-p)^(a-1)) / (a-1)). Below
    alpha 2 with expm1, so nothing cancels near alpha = 1; from 2 on with the powers themselves, since there both
    expm1 terms sit near -1 and their difference near x = 0 would cancel (3e-4 off at alpha 50)."""
    a1 = alpha - 1.0
    log_rest = torch.log1p(-torch.exp(t))
    if alpha < 2:
        return (torch.expm1(a1 * t) - torch.expm1(a1 * log_rest)) / a1
    return (torch.exp(a1 * t) - torch.exp(a1 * log_rest)) / a1


class _AlphaSigmoid(torch.autograd.Function):
    """sigma_alpha by bisection, exact to the working precision in relative terms: it solves for the smaller of
    sigma and 1 - sigma (sigma(-x) = 1 - sigma(x)) by bisecting its logarithm, so a tail value such as 1e-30
    comes out as itself (bisecting sigma directly stopped at 2^-55 and lifted log sigma to -38)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        p, q = _bisect(x, alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(q, x)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, x = ctx.saved_tensors
        return grad * derivative(q, x.to(q.dtype), ctx.alpha).to(grad.dtype), None


def _bisect(x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma_alpha(x) in x's dtype, q = min(sigma, 1 - sigma) in the working precision), see _AlphaSigmoid."""
    lim = 1.0 / (alpha - 1.0)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(work).tiny
    # log q lies in [log tiny, log 1/2]; 63 halvings of that span (31 in float32) reach the working precision
    steps = 63 if work == torch.float64 else 31
    xd = x.detach().to(work).clamp(-lim, lim)
    target = -xd.abs()                                   # q = sigma(-|x|) <= 1/2
    lo, hi = torch.full_like(xd, math.log(tiny)), torch.full_like(xd, -math.log(2.0))
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        below = _f_log(mid, alpha) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    # 0 at saturation, and below the smallest normal q the bracket can hold (float32 near alpha 1: x < -85)
    under = (target <= -lim) | (target < _f_log(torch.tensor(math.log(tiny), dtype=work), alpha))
    q = torch.where(under, torch.zeros_like(xd), (0.5 * (lo + hi)).exp())
    p = torch.where(xd > 0, 1 - q, q)
    p = torch.where(xd.isnan(), xd, p)   # a NaN score stays NaN (training reports the divergence)
    return p.to(x.dtype), q


def derivative(q: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """d sigma / dx from q = min(sigma, 1 - sigma) (the derivative is symmetric in the two): the entmax
    Jacobian for [x, 0], s1 s2 / (s1 + s2) with s = p^(2 - alpha); 0 where sigma saturates."""
    tiny = torch.finfo(q.dtype).tiny
    d = 1.0 / (q.clamp_min(tiny).pow(alpha - 2) + (1 - q).pow(alpha - 2))
    inside = (x.abs() < 1.0 / (alpha - 1.0)) & (q > 0)
    return torch.where(inside, d, torch.zeros_like(d))


TABLE_POINTS = 8193
TABLE_STEP = 0.005  # widest grid spacing; linear interpolation errs by at most ~2e-6, next to saturation
P_FLOOR = 1e-40     # log I's floor (papers.md; interaction.LOG_FLOOR): below it a value changes nothing


def table_range(alpha: float) -> float:
    """R such that the table on [-R, R] covers every x whose sigma_alpha is neither below P_FLOOR nor 1 in
    float32: 1/(alpha-1) where sigma saturates, or, nearer alpha = 1 where the saturation point runs off to
    infinity (1000 at alpha = 1.001), the x at which sigma falls to P_FLOOR, which stays under 93 (the
    sigmoid's)."""
    a1 = alpha - 1.0
    return min(1.0 / a1, -math.expm1(a1 * math.log(P_FLOOR)) / a1)


@functools.lru_cache(maxsize=4)
def _table(alpha: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """sigma_alpha and its derivative on a uniform grid over [-R, R] (table_range), exact (float64), then stored
    in float32. Built on `device` itself: alpha moves every training step, and a host-built table would cost
    each GPU step a host bisection and a copy."""
    lim = table_range(alpha)
    points = max(TABLE_POINTS, 2 * math.ceil(lim / TABLE_STEP) + 1)  # odd: the grid is symmetric about 0
    x = torch.linspace(-lim, lim, points, dtype=torch.float64, device=device)
    p = _AlphaSigmoid.apply(x, alpha)
    d = derivative(torch.minimum(p, p.flip(0)), x, alpha)  # p(-x) = 1 - p(x), unrounded (grid symmetric to 1e-14)
    return p.float(), d.float()


def _lerp_tables(tables: tuple[torch.Tensor, ...], x: torch.Tensor, lim: float) -> list[torch.Tensor]:
    """Linear interpolation of x in each table (all on one odd grid over [-lim, lim]), the index computed once.
    The index is counted from the centre so float32 keeps x's own precision near 0, where sigma is steepest (from
    the left end, x + lim rounds to the ulp of lim: up to 2e-6 off at alpha = 1.001)."""
    half = (tables[0].shape[0] - 1) // 2
    x = x.float()
    nan = x.isnan()
    u = x.nan_to_num(0.0).clamp(-lim, lim) * (half / lim)   # (a NaN would index out of range: NaN comes back below)
    i0 = u.floor().clamp(-half, half - 1)
    w = u - i0
    i0 = i0.long() + half
    return [torch.where(nan, x, table[i0] * (1 - w) + table[i0 + 1] * w) for table in tables]


class _AlphaSigmoidTable(torch.autograd.Function):
    """Training speed: sigma_alpha by linear interpolation in an exact table (alpha is one number per
    step), its derivative likewise; within about 2e-6 of the exact value. Past the table's ends sigma is 0 or 1
    and its derivative 0 (within P_FLOOR near alpha = 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        lim = table_range(alpha)
        p_tab, d_tab = _table(alpha, str(x.device))
        ctx.save_for_backward(x)
        ctx.alpha, ctx.lim, ctx.d_tab = alpha, lim, d_tab
        return _lerp_tables((p_tab,), x, lim)[0].to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        d = _table_slope(_lerp_tables((ctx.d_tab,), x, ctx.lim)[0], x, ctx.lim)
        return grad * d.to(grad.dtype), None


def _table_slope(d: torch.Tensor, x: torch.Tensor, lim: float) -> torch.Tensor:
    """The interpolated derivative, 0 past the table's ends (sigma is flat there)."""
    return torch.where(x.float().abs() < lim, d, torch.zeros_like(d))


def alpha_sigmoid(x: torch.Tensor, alpha: float, exact: bool | None = None) -> torch.Tensor:
    """argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy): the sigmoid at alpha = 1, clip((x+1)/2) at
    alpha = 2, saturating at +-1/(alpha-1) for alpha > 1, the step 1[x > 0] at alpha = inf.
    exact=None: bisection for float64 inputs, the interpolated table otherwise (every alpha: below 1.05 the
    float64 bisection over a [B,T,T] score tensor made a training step over 3x slower, bench.train_step_profile)."""
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
    return (_AlphaSigmoid if exact else _AlphaSigmoidTable).apply(x, float(alpha))


def alpha_sigmoid_slope(x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma_alpha(x), d sigma_alpha / dx) without autograd, each as the path alpha_sigmoid takes for x computes
    it (forward and backward): for a hand-written backward that fuses what follows sigma (interaction's log I)."""
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    with torch.no_grad():
        if alpha == 1:
            p = torch.sigmoid(x)
            return p, p * (1 - p)
        if math.isinf(alpha):
            return (x > 0).to(x.dtype), torch.zeros_like(x)
        if alpha == 2:  # clamp passes the gradient where (x + 1) / 2 lies in [0, 1], its ends included
            y = (x + 1) / 2
            return y.clamp(0, 1), torch.where((y >= 0) & (y <= 1), 0.5, 0.0).to(x.dtype)
        if x.dtype == torch.float64:
            p, q = _bisect(x, alpha)
            return p, derivative(q, x.to(q.dtype), alpha).to(x.dtype)
        lim = table_range(alpha)
        p, d = _lerp_tables(_table(alpha, str(x.device)), x, lim)
        return p.to(x.dtype), _table_slope(d, x, lim).to(x.dtype)


def alpha_schedule(step: int, total: int, start: float = 1.0, end: float = 8.0) -> float:
    """Cosine from `start` to `end` over `total` steps, then held (reference: 8 + 0.5 (1 - 8)(1 + cos(pi s / S)))."""
    s = min(step, total) / max(total, 1)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * s))
