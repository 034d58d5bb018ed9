"""Interaction scores, the keep structure I, the survival rule and the sparsity loss (docs/methods.md;
Anagnostidis et al., arXiv 2305.15805).

Per layer: W^Qint, W^Kint in R^{d_m x r} and a scalar beta, shared by all heads.
    x_{n,j} = (Q_int)_n . (K_int)_j / sqrt(r) + beta
    I_{k,j} = prod_{n=j+1..k} sigma(x_{n,j}) (j < k),  I_{k,k} = 1,  I_{k,j} = 0 (j > k)
and every head attends with softmax(Q K^T / sqrt(d_h) + log I). sigma is the alpha-sigmoid during
training (alpha raised from 1 to 8 on a cosine schedule) and the step 1[x > 0] at inference.
A token never drops itself, and once dropped (sigma = 0) it stays dropped for every later token.
    L = L_lm + gamma / (L_layers n (n - 1)) sum_layers sum_{j<k} I_{k,j}

Two deviations from the paper, each off unless the config asks (ModelConfig.prune_distance, prune_sinks):
- distance: x_{n,j} gains -lambda^l log(n - j), a learned scalar per layer that starts at 0 (the paper's rule).
  GPT-2 adds absolute positions to the residual stream, so its x_{n,j} can tell how far back token j is; a
  rotary model (SmolLM2) keeps positions inside attention, and without this term its rule cannot express
  "keep the recent window". With lambda > 0 a token lives about exp((q.k/sqrt(r) + beta) / lambda) steps:
  its content sets its lifetime.
- sinks: the first S positions of a text are never dropped (StreamingLLM's attention sinks).
"""
from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from kernels import settings
# the rule's pure maths (its precision included) lives with the kernels, which restate it; this module keeps the
# parameters and the calls
from kernels.keep_rule import (HALF, distance_term, gates, keep_mass, log_keep_from_gates, rule_dtype, survives,
                               widen)

# lambda of a window init: large enough that a content spread of 1 changes a key's life by a factor of e^(1/4)
# (0.78-1.28x), not by e, so the start is close to the window; small enough that training can move it
WINDOW_LAMBDA = 4.0


def pair_count(n_layers: int, n: int) -> int:
    """L_layers n (n - 1): the normaliser of the sparsity loss for sequences of n tokens."""
    return n_layers * n * (n - 1)


def sparsity_loss(mass: torch.Tensor, gamma: float, pairs: int) -> torch.Tensor:
    """gamma / (L_layers n (n - 1)) sum_layers sum_{j<k} I_{k,j}; mass is that double sum (batch mean) and
    pairs = pair_count(L_layers, n)."""
    return gamma * mass / pairs


class ContextPruning(nn.Module):
    """The interaction projections of one layer, and the keep structure I they define."""

    def __init__(self, d_model: int, r: int, beta: float, distance: bool = False, sinks: int = 0):
        super().__init__()
        self.r = r
        self.W_Qint = nn.Parameter(torch.randn(d_model, r) / math.sqrt(d_model))
        self.W_Kint = nn.Parameter(torch.randn(d_model, r) / math.sqrt(d_model))
        self.beta = nn.Parameter(torch.tensor(float(beta)))  # positive: nothing is dropped at first
        # lambda of the distance term (a deviation, see the module docstring); 0 at first: the paper's rule
        self.lam = nn.Parameter(torch.zeros(())) if distance else None
        self.sinks = sinks
        self.alpha = math.inf  # set by the trainer while training; inf (the step) at inference

    def _apply(self, fn, recurse=True):
        """model.to(bf16) and friends move these parameters but never round them to half precision: a parameter
        the conversion made bf16 / fp16 is taken again from its value before, in float32, on its new device."""
        held = {name: p.data for name, p in self._parameters.items() if p is not None}
        super()._apply(fn, recurse)
        for name, data in held.items():
            p = self._parameters[name]
            if p.dtype in HALF:
                p.data = data.to(device=p.device, dtype=rule_dtype(data.dtype))
        return self

    @torch.no_grad()
    def decode_constants(self) -> dict:
        """What the decode kernels read of the rule: beta and lambda as Python floats (0.0 without the distance
        term), the sink count, and [W^Qint | W^Kint] in the rule's precision (Q_int and K_int of a new token in
        one product of the widened hidden state). The decode cache computes this once and keeps it
        (models.backends.compacted): the model itself is never written to during inference."""
        return {"beta": float(self.beta), "lam": 0.0 if self.lam is None else float(self.lam), "sinks": self.sinks,
                "qk": torch.cat([self.W_Qint, self.W_Kint], 1)}

    def q_int(self, x: torch.Tensor) -> torch.Tensor:
        """Q_int = x W^Qint in the rule's precision (outside autocast, which would round it to bf16)."""
        with torch.autocast(x.device.type, enabled=False):
            x = widen(x)
            return x @ self.W_Qint.to(x.dtype)

    def adapter_params(self) -> dict[str, nn.Parameter]:
        """What trains in a parameter-efficient fine-tune with pruning (models.adapters.get_adapter_params)."""
        return dict(self.named_parameters())

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> float:
        """Data-dependent init for a pretrained base. The paper's N(0, 1/sqrt(d_m)) init assumes unit-scale inputs
        (GPT-2's LayerNorm); a base whose normed inputs are small (SmolLM2's RMSNorm: RMS 0.05-0.4) would leave
        every x_{n,j} at beta, the alpha-sigmoid saturated at 1 and the sparsity loss without a gradient. Dividing
        W^Qint and W^Kint by the RMS of this layer's real inputs x restores the spread the paper's init has.
        Returns that RMS."""
        rms = float(x.float().pow(2).mean().sqrt())
        self.W_Qint.div_(rms)
        self.W_Kint.div_(rms)
        return rms

    @torch.no_grad()
    def init_window(self, window: int, lam: float = WINDOW_LAMBDA) -> None:
        """Start the rule near StreamingLLM's recent window (needs the distance term): beta = lambda log(window -
        1/2), so with the content term at 0 and the step sigma a key outlives exactly the queries less than
        `window` positions after it (the half keeps the edge off x = 0, where rounding would decide). The content
        term, as calibrate leaves it (q.k / sqrt(r) of spread about 1), then lengthens or shortens each key's life
        by exp(q.k / sqrt(r) / lambda); training moves each layer's window and the content from there."""
        if self.lam is None:
            raise ValueError("a window init needs the distance term (model.prune_distance)")
        if window < 1 or lam <= 0:
            raise ValueError(f"window must be >= 1 and lambda > 0, got {window}, {lam}")
        self.lam.fill_(lam)
        self.beta.fill_(lam * math.log(window - 0.5))

    def current_alpha(self) -> float:
        return self.alpha if self.training else math.inf

    def scores(self, x_q: torch.Tensor, k_int: torch.Tensor, key_pos: torch.Tensor | None = None,
               q_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x_{n,j} for the query rows x_q [B,Tq,d] against interaction keys k_int [B,S,r] -> [B,Tq,S]; with
        the distance term, key_pos [S] or [B,S] and q_pos [Tq] or [B,Tq] say where each sits."""
        return self.scores_of(self.q_int(x_q), k_int, key_pos, q_pos)

    def scores_of(self, q_int: torch.Tensor, k_int: torch.Tensor, key_pos: torch.Tensor | None = None,
                  q_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x_{n,j} from interaction queries q_int [B,Tq,r] (x_q W^Qint) and keys k_int [B,S,r] -> [B,Tq,S], in
        the rule's precision."""
        q_int = widen(q_int)
        x = q_int @ k_int.to(q_int.dtype).transpose(1, 2) / math.sqrt(self.r) + self.beta.to(q_int.dtype)
        if self.lam is not None:
            x = x + distance_term(self.lam.to(x.dtype), key_pos[..., None, :], q_pos[..., :, None])
        return x

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """K_int = x W^Kint in the rule's precision, whatever x's dtype (outside autocast)."""
        with torch.autocast(x.device.type, enabled=False):
            x = widen(x)
            return x @ self.W_Kint.to(x.dtype)

    def log_keep(self, x: torch.Tensor, edit=None, mass: bool = False, log_dtype: torch.dtype | None = None):
        """Whole sequence x [B,T,d] -> (log I [B,T,T], I [B,T,T]); -inf / 0 above the diagonal. edit, when given,
        takes the gates sigma(x_{n,j}) [B,T,T] and returns them changed (an intervention forcing decisions:
        models.pruning.intervene); the keep structure follows from the changed gates as from the rule's own.
        mass=True adds a third, the layer's term of the sparsity loss (ContextPruning.mass of I); in training it
        comes out of the keep kernel's own pass (_LogKeep). log_dtype: the dtype training's keep kernel writes
        log I in, attention's (bf16 under autocast, where log I is its bias and would be cast to it after).

        log I accumulates log sigma (floored at 1e-40) in log space, so it is finite and never NaN; I itself
        is the plain cumulative product, exactly 0 once a token is dropped.

        Computed in the rule's precision, outside autocast (as every path scores): under CUDA autocast the
        cumulative sums and products ran in float32 on bf16 inputs, and the mixed-dtype backward failed (a
        masked_scatter_ dtype error on an H100)."""
        with torch.autocast(x.device.type, enabled=False):
            return self._log_keep(widen(x), edit, mass, log_dtype)

    def _log_keep(self, x: torch.Tensor, edit, mass: bool, log_dtype):
        q, k = self.q_int(x), self.keys(x)
        alpha = self.current_alpha()
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, self.beta, self.lam))
        if grad and math.isfinite(alpha):
            # training: the scores in one product with its scale and bias (a float32 rounding away from scores_of's,
            # which no training step needs to match: at a finite alpha no decision is taken), and one backward for
            # them and the whole chain after them (_LogKeep); the step (alpha = inf) has no gradient
            bias = self.beta.to(q.dtype)
            if self.lam is not None:
                pos = torch.arange(x.shape[1], device=x.device)  # (only here: a kernel a layer)
                bias = bias + distance_term(self.lam.to(q.dtype), pos[None, :], pos[:, None])     # [T, T]
            if edit is None:
                out = _LogKeep.apply(q, k, bias, 1 / math.sqrt(self.r), alpha, self.sinks, log_dtype)
                return out if mass else out[:2]
            scores = _scores(q, k, bias, 1 / math.sqrt(self.r))                                    # [B, n, j]
        else:
            pos = torch.arange(x.shape[1], device=x.device)
            scores = self.scores_of(q, k, pos, pos)  # (every decision's scores: the decode paths write the same sums)
        sig = gates(scores, alpha, self.sinks)
        log_i, keep = log_keep_from_gates(sig if edit is None else edit(sig))
        return (log_i, keep, self.mass(keep)) if mass else (log_i, keep)

    mass = staticmethod(keep_mass)  # sum_{j<k} I_{k,j} of one layer, batch mean: its term of the sparsity loss

    def survival(self, x_new: torch.Tensor, k_int: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """Inference: whether each key has survived every new query up to and including each row (the rule of
        `survives`, accumulated: only a later query can drop a key, and a drop is forever). The new query rows
        are in position order. key_pos [S] or [B,S], q_pos [T] or [B,T] -> [B,T,S] bool."""
        each = survives(self.scores(x_new, k_int, key_pos, q_pos), key_pos[..., None, :], q_pos[..., :, None],
                        None if valid is None else valid[:, :, None], self.sinks)
        return each.cumprod(dim=1).bool()

    def step_keep(self, x_new: torch.Tensor, k_int: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """Inference over the static cache: the T new queries are the last T of S positions. alive [B,S] says
        which positions were still kept before them. Returns keep [B,T,S] (bool) for the attention of each
        new row; keep[:, -1] is the new alive state."""
        t, s = x_new.shape[1], k_int.shape[1]
        j = torch.arange(s, device=x_new.device)
        q = torch.arange(s - t, s, device=x_new.device)
        return alive[:, None, :] & self.survival(x_new, k_int, j, q) & (j[None, :] <= q[:, None])


def _scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """x = q k^T * scale + bias [B,T,T] in one product (bias 0-dim or [T,T]): training's scores."""
    return torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)


class _LogKeep(torch.autograd.Function):
    """Interaction queries and keys q, k [B,T,r] and the scores' bias (beta, 0-dim, or with the distance term
    [T,T]) -> (log I, I, mass): the values log_keep_from_gates(gates(_scores(...))) and ContextPruning.mass give
    (log I rounded to log_dtype when one is given), with one hand-written backward (kernels.log_keep /
    log_keep_grad: Triton on a GPU, kernels.reference's PyTorch elsewhere, then the scores' two products with
    their scale inside and the bias's sum). Autograd's chain (interpolated sigma, clamp, log, where, cumsum,
    masked_fill, I's where, cumprod, where, and the mass's tril, sum, mean) ran an op and kept a [B,T,T] tensor per
    pass; this keeps two (I and sigma'/sigma), and the scores' backward is three kernels where autograd's took six
    (it scaled each product after it and made K's transposed gradient contiguous).

    Where the two differ: under log I's floor (in float32, under the smallest normal number, 1.2e-38) nothing
    passes. Autograd's chain passed I's own gradient there, the other sigmas' product times sigma', which is 0
    wherever sigma' is (at alpha 2 it is not at x = -1 exactly). Near alpha 1 in float32 it could also give
    NaN there (a gradient over 1e-40 overflowed, times a slope of 0); this gives 0."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor, scale: float, alpha: float, sinks: int,
                log_dtype=None):
        log_i, keep, ratio, mass = kernels.log_keep(_scores(q, k, bias, scale), alpha=alpha, sinks=sinks,
                                                    log_dtype=log_dtype)
        ctx.save_for_backward(keep, ratio, q, k)
        ctx.scale, ctx.bias_dim = scale, bias.dim()
        ctx.paths = kernels.recorder()  # the backward may run on another thread (CUDA): it notes its path here
        ctx.settings = settings.overrides()  # and the kernel switches' overrides it runs under there
        ctx.set_materialize_grads(False)
        return log_i, keep, mass

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_log, g_keep, g_mass):
        none = (None,) * 4  # (scale, alpha, sinks, log_dtype)
        if g_log is None and g_keep is None and g_mass is None:
            return (None, None, None, *none)
        keep, ratio, q, k = ctx.saved_tensors
        # where the forward ran, and where this runs; under the overrides the forward saw
        with kernels.recording_into(ctx.paths, kernels.recorder()), settings.override(**ctx.settings):
            dx = kernels.log_keep_grad(g_log, g_keep, keep, ratio, g_mass)                        # [B, n, j]
        need_q, need_k, need_bias = ctx.needs_input_grad[:3]
        # the scale rides in the product; with beta=0 baddbmm ignores its input, given a real tensor of the output's
        # shape all the same (an uninitialised one could hold NaN, which a compiled epilogue's input * 0 would keep)
        dq = torch.baddbmm(k, dx, k, beta=0, alpha=ctx.scale) if need_q else None
        dk = torch.baddbmm(q, dx.transpose(1, 2), q, beta=0, alpha=ctx.scale) if need_k else None
        dbias = (dx.sum() if ctx.bias_dim == 0 else dx.sum(0)) if need_bias else None
        return (dq, dk, dbias, *none)


def sparsity(keep: torch.Tensor) -> torch.Tensor:
    """Per query position k: the share of the k earlier tokens that are dropped ([B,T,T] -> [B,T]; 0 at k = 0)."""
    t = keep.shape[-1]
    earlier = torch.arange(t, device=keep.device)
    dropped = earlier - keep.tril(-1).float().sum(-1)
    return dropped / earlier.clamp_min(1)


def mean_sparsity(keep: torch.Tensor, count_first: bool, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The one averaging of `sparsity`: its mean over the queries start..stop-1 ([..., T, T] -> [...]).
    count_first: query 0, which has nothing earlier to drop, counts as 0 (a sum over a text's predictions
    divided by their number, as perplexity pools them); False leaves it out (the mean over queries that could
    drop something). Only matters when start is 0."""
    s = sparsity(keep)[..., start:stop]
    if start == 0 and not count_first:
        s = s[..., 1:]
    return s.mean(-1)


def drop_records(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From an inference keep matrix [B,T,T] (0/1): for each token j, the position k of the query that
    dropped it (its trigger, and the step at which it left the context), or -1 if it survived to the end."""
    b, t, _ = keep.shape
    dropped = (keep < 0.5) & torch.ones(t, t, dtype=torch.bool, device=keep.device).tril(-1)  # [B, k, j]
    first = torch.where(dropped, torch.arange(t, device=keep.device)[None, :, None], t).min(dim=1).values  # [B, j]
    return torch.where(first < t, first, -1), dropped.any(dim=1)
