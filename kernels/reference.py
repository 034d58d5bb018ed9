"""Plain-PyTorch reference of every kernel. The Triton kernels are tested against these.

Shapes: B batch, H query heads, G key/value groups (H % G == 0, head h reads group h // (H/G)),
T new (query) positions, S cached + new (key) positions, D head width, C channels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.alpha_sigmoid import alpha_sigmoid_slope
from kernels.keep_rule import (LOG_FLOOR, below_diagonal, distance_term, keep_mass, log_keep_from_gates,
                               survives)  # the one survival rule (docs/methods.md#the-survival-rule)


def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool, True where allowed: the T queries are the last T of the S positions."""
    q_pos = torch.arange(s - t, s, device=device).unsqueeze(1)
    return torch.arange(s, device=device).unsqueeze(0) <= q_pos


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, bias: torch.Tensor | None = None,
              need_weights: bool = False, causal: bool = True, q_mul=None, q_add=None, o_mul=None,
              o_add=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention with grouped K/V: q [B,H,T,D], k/v [B,G,S,D] -> out [B,H,T,D].

    bias: an additive log-mask [B,1,T,S] shared by the heads (context pruning's log I), or None.
    causal=False leaves all masking to bias (the compacted cache, whose slots are not in position order; a pruned
    training step, whose log I is -inf above the diagonal).
    q_mul/q_add/o_mul/o_add [H,D]: per-head maps of the head-embedding variants (MHE): head h attends with
    q * q_mul[h] + q_add[h] and outputs o * o_mul[h] + o_add[h]; q may then be one shared head [B,1,T,D].
    Returns (out, probs [B,H,T,S] or None). K/V are never expanded to H heads.
    """
    out, probs = _attention(_head_queries(q, k, q_mul, q_add), k, v, scale, bias, need_weights, causal)
    if o_mul is not None:
        out = (out * o_mul[:, None]).to(v.dtype)
    if o_add is not None:
        out = (out + o_add[:, None]).to(v.dtype)
    return out, probs


def _head_queries(q, k, q_mul, q_add):
    """MHE's per-head query maps applied. Under autocast q and K/V arrive in bf16 while MHE's maps are float32
    parameters: the maps promote q, and SDPA wants one dtype, so the product runs in K/V's dtype (what the Triton
    kernels do) and the output comes back in it."""
    if q_mul is not None:
        q = q * q_mul[:, None]
    if q_add is not None:
        q = q + q_add[:, None]
    return q.to(k.dtype)


def _grouped_scores(q, k, scale):
    """q [B,H,T,D] against k [B,G,S,D] -> scores [B,G,R,T,S] (R = H/G heads per group), K never expanded."""
    b, h, t, d = q.shape
    g = k.shape[1]
    if h % g:
        raise ValueError(f"{h} query heads cannot share {g} key/value groups")
    return (q.reshape(b, g, h // g, t, d) @ k.unsqueeze(2).transpose(-1, -2)) * scale


def attention_scores(q, k, *, scale: float, q_mul=None, q_add=None, **_) -> torch.Tensor:
    """The raw scores q k^T * scale [B,H,T,S] attention() would softmax (MHE query maps applied; no mask, no
    bias): what a rule that replays attention step by step over a whole text needs (models.pruning.replay)."""
    s = _grouped_scores(_head_queries(q, k, q_mul, q_add), k, scale)
    return s.flatten(1, 2)


def _attention(q, k, v, scale, bias, need_weights, causal):
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    if h % g:
        raise ValueError(f"{h} query heads cannot share {g} key/value groups")
    if not need_weights and (t == 1 or not causal):  # one query sees every key; or the bias says it all
        mask = None if bias is None else bias.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g != h), None
    if not need_weights and causal and bias is None and t == s:
        # a whole sequence (dense training, a prefill from empty): SDPA's own causal flag, with which flash and cuDNN
        # skip the blocks above the diagonal and nothing builds a mask (for T < S its flag aligns top-left, not as
        # the cache needs, so the mask is built below)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=g != h), None
    allowed = causal_mask(t, s, q.device) if causal else torch.ones(t, s, dtype=torch.bool, device=q.device)
    if not need_weights:
        mask = allowed
        if bias is not None:
            mask = bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=g != h), None
    scores = _grouped_scores(q, k, scale)                               # [B,G,R,T,S]
    if bias is not None:
        scores = scores + bias.unsqueeze(1).to(scores.dtype)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = probs @ v.unsqueeze(2)                                        # [B,G,R,T,D]
    return out.reshape(b, h, t, d), probs.reshape(b, h, t, s)


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, bias=None, lengths=None,
           prune: dict | None = None, **maps):
    """One query per sequence q [B,H|1,1,D] over a cache k/v [B,G,S,D] (the decode kernel's twin).

    lengths [B]: sequence b sees slots [0, lengths[b]). prune (the compacted pruning cache): q_int [B,r],
    k_int [B,S,r], beta, live [B,S], pos [B,S] (slot positions, -1 unused), q_pos [B], valid [B] (None: every
    row real), and optionally lam (the distance term's lambda), sinks and trig. A live slot stays live by
    kernels.keep_rule.survives on x = q_int . k_int / sqrt(r) + beta - lam log(q_pos - pos); a
    padding row (valid False) drops nothing and attends to every used slot. Returns out,
    or (out, keep [B,S]: the live mask after this query) with prune. trig [B,S] (int64, the cache's drop notes):
    the step's bookkeeping in place, as the kernel does it: live becomes keep, and trig takes q_pos at every slot
    this query dropped; keep is then live itself.
    """
    if prune is not None and prune["valid"] is None and bias is None:
        out, keep = _decode_all_real(q, k, v, scale, prune, maps, lengths)
        return out, _note_drops(prune, keep)
    b, s = q.shape[0], k.shape[2]
    allowed = torch.ones(b, s, dtype=torch.bool, device=q.device)
    if lengths is not None:
        allowed &= torch.arange(s, device=q.device)[None] < lengths[:, None]
    keep = None
    if prune is not None:
        valid = torch.ones_like(prune["q_pos"], dtype=torch.bool) if prune["valid"] is None else prune["valid"]
        pos, q_pos, valid = prune["pos"], prune["q_pos"][:, None], valid[:, None]
        x = prune["q_int"][:, None, :] @ prune["k_int"].transpose(1, 2) / prune["q_int"].shape[-1] ** 0.5
        x = _with_distance(x[:, 0] + prune["beta"], prune, pos, q_pos)
        keep = prune["live"] & survives(x, pos, q_pos, valid, prune.get("sinks", 0)) & allowed  # none after lengths
        allowed &= torch.where(valid, keep & (pos <= q_pos), pos >= 0)
    mask = torch.zeros(b, 1, 1, s, dtype=q.dtype, device=q.device).masked_fill(~allowed[:, None, None], float("-inf"))
    if bias is not None:
        mask = mask + bias.reshape(b, 1, 1, s)
    out, _ = attention(q, k, v, scale=scale, bias=mask, causal=False, **maps)
    return out if prune is None else (out, _note_drops(prune, keep))


def _note_drops(prune: dict, keep: torch.Tensor) -> torch.Tensor:
    """With prune["trig"]: the slots dropped (live, not kept) noted with the query's position, live set to keep
    (keep is within live), in place; returns the mask the caller reads (live itself then)."""
    trig = prune.get("trig")
    if trig is None:
        return keep
    live = prune["live"]
    trig.copy_(torch.where(live & ~keep, prune["q_pos"][:, None], trig))
    live.copy_(keep)
    return live


def _with_distance(x, prune, pos, q_pos):
    """x plus the distance term -lam log(q_pos - pos) when the rule has one (lam != 0)."""
    lam = prune.get("lam", 0.0)
    # (a fill, not a copy from the host: a CUDA graph may capture this)
    return x if not lam else x + distance_term(torch.full((), lam, dtype=x.dtype, device=x.device), pos, q_pos)


def _decode_all_real(q, k, v, scale, prune, maps, lengths=None):
    """decode() when every row is real, in as few operations as the rule allows (the CPU decode step is
    bound by their count): every live slot's position precedes the query's, so the slots attended are
    exactly the ones kept (and none from lengths[b] on)."""
    q_int = prune["q_int"][:, None, :]
    beta = (torch.full((), prune["beta"], dtype=q_int.dtype, device=q_int.device) if isinstance(prune["beta"], float)
            else prune["beta"])
    # q.k / sqrt(r) + beta
    x = torch.baddbmm(beta, q_int, prune["k_int"].transpose(1, 2), alpha=q_int.shape[-1] ** -0.5)[:, 0]
    x = _with_distance(x, prune, prune["pos"], prune["q_pos"][:, None])
    keep = prune["live"] & survives(x, prune["pos"], prune["q_pos"][:, None], sinks=prune.get("sinks", 0))
    if lengths is not None:
        keep = keep & (torch.arange(k.shape[2], device=k.device) < lengths[:, None])
    if maps:
        mask = torch.where(keep, 0.0, float("-inf")).to(q.dtype)[:, None, None]  # [B,1,1,S]
        return attention(q, k, v, scale=scale, bias=mask, causal=False, **maps)[0], keep
    g, h = k.shape[1], q.shape[1]
    if q.dtype != k.dtype:
        q = q.to(k.dtype)
    # a boolean mask (True: attend) saves building the additive one
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None], scale=scale, enable_gqa=g != h), keep


def log_keep(x: torch.Tensor, *, alpha: float, sinks: int = 0, log_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context pruning's keep structure for training, from the scores x [B,T,T] (x_{n,j}, query n, key j):
    (log I, I, ratio, mass), -inf / 0 / 0 on and above the diagonal as kernels.keep_rule.log_keep_from_gates
    writes them, with sigma the alpha-sigmoid and the first `sinks` keys held at 1. ratio is what the backward
    (log_keep_grad) needs of sigma: sigma'(x) / sigma(x) below the diagonal where sigma is at or above log I's
    floor (whose clamp passes no gradient) and a normal number of its dtype, else 0. In float32 that gradient
    floor is 1.2e-38, not 1e-40: a GPU kernel may flush smaller (subnormal) values to 0, and dividing by one
    would be inf; the Triton kernel and this reference keep the same floor. mass is the sparsity loss's term of
    the layer, sum_{j<k} I_{k,j} with the batch mean taken (keep_rule.keep_mass), a 0-dim tensor. log_dtype: log I
    rounded to it (attention's dtype, where log I is the bias), else x's."""
    sig, slope = alpha_sigmoid_slope(x, alpha)
    if sinks:
        sig[..., :sinks], slope[..., :sinks] = 1, 0
    masks = below_diagonal(x.shape[-1], x.device)
    log_i, keep = log_keep_from_gates(sig, masks)
    later = masks[0]
    zero = torch.zeros((), dtype=sig.dtype, device=x.device)
    floor = max(LOG_FLOOR, torch.finfo(sig.dtype).tiny)
    mass = keep_mass(keep)
    log_i = log_i if log_dtype is None else log_i.to(log_dtype)
    return log_i, keep, torch.where(later & (sig >= floor), slope / sig, zero), mass


def log_keep_grad(g_log: torch.Tensor | None, g_keep: torch.Tensor | None, keep: torch.Tensor,
                  ratio: torch.Tensor, g_mass: torch.Tensor | None = None) -> torch.Tensor:
    """dL/dx from the gradients of log I, I and mass (any may be None; g_mass 0-dim) and log_keep's I and ratio:
        W = dL/d(log I) + (dL/dI + dL/dmass / B [below the diagonal]) * I on and below the diagonal (0 above),
        R_{n,j} = sum_{k >= n} W_{k,j},  dL/dx_{n,j} = R_{n,j} * ratio_{n,j},
    since d log I_{k,j} / d log sigma_{n,j} = 1 and dI_{k,j} / d log sigma_{n,j} = I_{k,j} for j < n <= k, and
    mass is the batch mean of the sum of I below the diagonal. (I on the diagonal is 1 and ratio 0 there: whether
    the mass term reaches it changes nothing.)"""
    if g_log is None and g_keep is None and g_mass is None:
        return torch.zeros_like(keep)  # (as the Triton kernel, which then writes zeros)
    later, causal = below_diagonal(keep.shape[-1], keep.device)
    g_i = g_keep
    if g_mass is not None:
        per_pair = torch.where(later, g_mass / keep.shape[0], 0).to(keep.dtype)  # [T, T]
        g_i = per_pair if g_i is None else g_i + per_pair
    g_log = None if g_log is None else g_log.to(keep.dtype)  # (log I may have been handed on in bf16)
    w = g_i * keep if g_log is None else g_log if g_i is None else g_log + g_i * keep
    w = w.masked_fill(~causal, 0)  # what reaches the -inf (log I) and 0 (I) above the diagonal stops there
    return w.flip(1).cumsum(1).flip(1) * ratio


def lag_conv(x: torch.Tensor, w: torch.Tensor, start: int = 0, method: str = "auto") -> torch.Tensor:
    """Extractor lag sum y_i = sum_{j<=i} x_j * w_{i-j} for i = start..S-1 (lag 0 = the paper's w_1).

    x [B,S,C]. w is [L] (ME: one scalar per lag), [L,C] (WE/HE: per channel) or
    [L,C,C_out] (SHE: a matrix per lag, x_j W_{i-j}). Returns [B, S-start, C or C_out].
    method: "direct" (a causal convolution whose kernel spans every lag up to S-1, run only over
    the outputs asked for: O((S-start) S C) for ME/WE/HE, O((S-start) S C C_out) for SHE), "fft"
    (whole sequences only: O(S log S) per channel, and SHE becomes one C x C_out product per
    frequency), or "auto" (fft for whole sequences longer than 16, else direct).
    """
    b, s, c = x.shape
    if s > w.shape[0]:
        raise ValueError(f"sequence of {s} positions exceeds the {w.shape[0]} lag weights")
    if method == "auto":
        method = "fft" if start == 0 and s > 16 else "direct"
    if method == "fft":
        if start:
            raise ValueError("the fft method computes whole sequences only (start=0)")
        return _lag_conv_fft(x, w[:s])
    # conv1d is a cross-correlation: kernel tap k meets lag s-1-k, hence the flip.
    taps = w[:s].flip(0)
    if w.dim() == 1:
        weight, groups = taps.view(1, 1, s).expand(c, 1, s), c
    elif w.dim() == 2:
        weight, groups = taps.t().unsqueeze(1), c
    else:
        weight, groups = taps.permute(2, 1, 0), 1
    xp = F.pad(x.transpose(1, 2), (s - 1, 0))[..., start:]
    return F.conv1d(xp, weight, groups=groups).transpose(1, 2)


def _lag_conv_fft(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal convolution by FFT, zero-padded to 2S so nothing wraps around. Half types (bf16 under autocast)
    are transformed in float32: cuFFT has no bf16, and its fp16 needs power-of-two lengths."""
    s, out_dtype = x.shape[1], x.dtype
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    xf = torch.fft.rfft(x, n=2 * s, dim=1)                     # [B,F,C]
    wf = torch.fft.rfft(w.to(x.dtype), n=2 * s, dim=0)         # [F] | [F,C] | [F,C,C_out]
    if w.dim() == 1:
        yf = xf * wf[:, None]
    elif w.dim() == 2:
        yf = xf * wf
    else:
        yf = torch.einsum("bfi,fio->bfo", xf, wf)
    return torch.fft.irfft(yf, n=2 * s, dim=1)[:, :s].to(out_dtype)


# --- the small ops of a one-token decode step (kernels.triton_step fuses each into one launch) ---

def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in Llama's half-split convention: x [..., D] by the angles' cos, sin [..., D]
    (broadcast): x * cos + (-x2, x1) * sin, with x1, x2 the halves of x, computed in x's dtype."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


def step_write(q: torch.Tensor, new: dict, buffers: dict, cursor: torch.Tensor, rope=None, slots=None) -> torch.Tensor:
    """A fixed-shape decode step's cache writes at the cursor [1] (int64, on the device), and its rotary: new holds
    the new position's entries (k, v [B,G,1,D]; the rule's k_int [B,1,r]), each written into its buffer of
    `buffers` ([B,G,S,D], [B,S,r]) at slot cursor. rope: (cos, sin [P,D] angle tables of positions 0..P-1, at [1]
    or [B] the row's position): q [B,H,1,D] and k are rotated first, and the rotated q returned (else q itself).
    slots: (live [B,S] bool, pos [B,S], q_pos [B,1]) of the compacted cache: the slot becomes live at q_pos."""
    if rope is not None:
        cos, sin, at = rope
        c, s = cos[at].view(-1, 1, 1, cos.shape[-1]), sin[at].view(-1, 1, 1, sin.shape[-1])
        q, new = rotate_half(q, c, s), dict(new, k=rotate_half(new["k"], c, s))
    for name, value in new.items():
        buf = buffers[name]
        buf.index_copy_(buf.dim() - 2, cursor, value)
    if slots is not None:
        live, pos, q_pos = slots
        live.index_fill_(1, cursor, True)
        pos.index_copy_(1, cursor, q_pos)
    return q


def rule_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The pruning rule's projection of a hidden state in float32 at least: x @ w with a half-precision x widened
    first (w [d, n] in the rule's precision, [W^Qint | W^Kint] for a decode step)."""
    return (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x) @ w


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(g) * u."""
    return F.silu(g) * u


def add_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
             eps: float, rms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual sum and the norm of it: s = x + h (x itself when h is None) and RMSNorm(s) (rms) or
    LayerNorm(s) over the last dimension, with the optional affine weight (and LayerNorm's bias)."""
    s = x if h is None else x + h
    shape = (s.shape[-1],)
    return s, F.rms_norm(s, shape, weight, eps) if rms else F.layer_norm(s, shape, weight, bias, eps)
