"""Adaptively sparse attention (dynamic context pruning; Anagnostidis et al., arXiv 2305.15805), papers.md section 3.

Per layer: W^Qint, W^Kint in R^{d_m x r} and a scalar beta, shared by all heads.
    x_{n,j} = (Q_int)_n . (K_int)_j / sqrt(r) + beta
    I_{k,j} = prod_{n=j+1..k} sigma(x_{n,j}) (j < k),  I_{k,k} = 1,  I_{k,j} = 0 (j > k)
and every head attends with softmax(Q K^T / sqrt(d_h) + log I). sigma is the alpha-sigmoid during
training (alpha raised from 1 to 8 on a cosine schedule) and the step 1[x > 0] at inference.
A token never drops itself, and once dropped (sigma = 0) it stays dropped for every later token.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

LOG_FLOOR = 1e-40  # log(I) is taken of max(I, 1e-40) (papers.md): finite, never NaN


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


class ContextPruning(nn.Module):
    """The interaction projections of one layer, and the keep structure I they define."""

    def __init__(self, d_model: int, r: int, beta: float):
        super().__init__()
        self.r = r
        self.W_Qint = nn.Parameter(torch.randn(d_model, r) / math.sqrt(d_model))
        self.W_Kint = nn.Parameter(torch.randn(d_model, r) / math.sqrt(d_model))
        self.beta = nn.Parameter(torch.tensor(float(beta)))  # positive: nothing is dropped at first
        self.alpha = math.inf  # set by the trainer while training; inf (the step) at inference

    def current_alpha(self) -> float:
        return self.alpha if self.training else math.inf

    def scores(self, x_q: torch.Tensor, k_int: torch.Tensor) -> torch.Tensor:
        """x_{n,j} for the query rows x_q [B,Tq,d] against interaction keys k_int [B,S,r] -> [B,Tq,S]."""
        return (x_q @ self.W_Qint) @ k_int.transpose(1, 2) / math.sqrt(self.r) + self.beta

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.W_Kint

    def log_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequence x [B,T,d] -> (log I [B,T,T], I [B,T,T]); -inf / 0 above the diagonal.

        log I accumulates log sigma (floored at 1e-40) in log space, so it is finite and never NaN; I itself
        is the plain cumulative product, exactly 0 once a token is dropped."""
        t = x.shape[1]
        sig = alpha_sigmoid(self.scores(x, self.keys(x)), self.current_alpha())         # [B, n, j]
        later = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-1)           # n > j
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        one, zero = torch.ones((), dtype=sig.dtype, device=x.device), torch.zeros((), dtype=sig.dtype, device=x.device)
        log_i = torch.where(later, sig.clamp_min(LOG_FLOOR).log(), zero).cumsum(dim=1)  # sum over j < n <= k
        keep = torch.where(causal, torch.where(later, sig, one).cumprod(dim=1), zero)
        return log_i.masked_fill(~causal, float("-inf")), keep

    def survival(self, x_new: torch.Tensor, k_int: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """Inference: whether each key has survived every new query up to and including each row (the step
        function; only a later query can drop a key, and a drop is forever; rows marked not valid drop
        nothing). The new query rows are in position order. key_pos [S] or [B,S], q_pos [T] or [B,T]
        -> [B,T,S] bool."""
        later = key_pos[..., None, :] < q_pos[..., :, None]
        survive = (self.scores(x_new, k_int) > 0) | ~later
        if valid is not None:
            survive = survive | ~valid[:, :, None]
        return survive.cumprod(dim=1).bool()

    def step_keep(self, x_new: torch.Tensor, k_int: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Inference over the static cache: the T new queries are the last T of S positions. alive [B,S] says
        which positions were still kept before them. Returns keep [B,T,S] (bool) for the attention of each
        new row; keep[:, -1] is the new alive state."""
        t, s = x_new.shape[1], k_int.shape[1]
        j = torch.arange(s, device=x_new.device)
        q = torch.arange(s - t, s, device=x_new.device)
        return alive[:, None, :] & self.survival(x_new, k_int, j, q) & (j[None, :] <= q[:, None])

def sparsity(keep: torch.Tensor) -> torch.Tensor:
    """Per query position k: the share of the k earlier tokens that are dropped ([B,T,T] -> [B,T]; 0 at k = 0)."""
    t = keep.shape[-1]
    earlier = torch.arange(t, device=keep.device)
    dropped = earlier - keep.tril(-1).float().sum(-1)
    return dropped / earlier.clamp_min(1)


def pattern_mask(t: int, s: int, pattern: str, k: int, device=None) -> torch.Tensor | None:
    """The fixed sparse baselines (papers.md section 3) as a [T,S] bool mask for the last T of S positions
    (True = may attend; the causal limit is applied by the attention itself). local: the k most recent
    tokens (self included). strided (Child et al.): token i sees j when floor(i/k) = floor(j/k), and the
    summary tokens k-1, 2k-1, ..."""
    if pattern == "dense":
        return None
    i = torch.arange(s - t, s, device=device)[:, None]
    j = torch.arange(s, device=device)[None]
    if pattern == "local":
        return j > i - k
    if pattern == "strided":
        return (i // k == j // k) | (j % k == k - 1)
    raise ValueError(f"unknown pattern {pattern!r}")


def drop_records(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From an inference keep matrix [B,T,T] (0/1): for each token j, the position k of the query that
    dropped it (its trigger, and the step at which it left the context), or -1 if it survived to the end."""
    b, t, _ = keep.shape
    dropped = (keep < 0.5) & torch.ones(t, t, dtype=torch.bool, device=keep.device).tril(-1)  # [B, k, j]
    first = torch.where(dropped, torch.arange(t, device=keep.device)[None, :, None], t).min(dim=1).values  # [B, j]
    return torch.where(first < t, first, -1), dropped.any(dim=1)
