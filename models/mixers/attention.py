"""Causal softmax attention variants (Xue & Aletras, arXiv 2310.07911), papers.md section 1.

Projection weights are stored as [d_m, heads, d_h], so W_Q[:, i] is the paper's W_i^Q.
Every variant reduces to q [B,H,T,D] against k, v [B,G,S,D] with G key/value groups;
MQA and both MHE variants keep a single group, so their cache is one head wide.
"""
from __future__ import annotations

import math

import torch
from torch import nn

import kernels
from models.config import ConfigError
from models.compact_cache import CompactCache
from models.mixers.base import Mixer, register
from models.mixers.pruning import ContextPruning, pattern_mask


def additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as an additive attention bias: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def split_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B,T,d_m] @ w [d_m,n,d_h] -> [B,n,T,d_h]."""
    return (x @ w.flatten(1)).unflatten(-1, w.shape[1:]).transpose(1, 2)


def projection(d_model: int, heads: int, d_head: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(d_model, heads, d_head) * std)


class Attention(Mixer):
    """Shared machinery: project, (cache), attend, per-head output map, concat, W_O."""

    out_names = ("W_O",)
    kv_shared = False  # K is V (SKV, EL-ATT): cache only K

    def __init__(self, cfg, n_heads: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, cfg.d_head
        self.scale = 1.0 / math.sqrt(cfg.d_head)
        # GPT-2 residual scaling: output projections start smaller in deeper models
        self.W_O = nn.Parameter(torch.randn(n_heads * cfg.d_head, cfg.d_model) * cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.pruning = ContextPruning(cfg.d_model, cfg.prune_r, cfg.prune_beta) if cfg.prune else None
        self.prune_mass = None  # training: sum over j < k of I_{k,j}, batch mean (for the sparsity loss)
        self.pattern, self.pattern_k = cfg.pattern, cfg.pattern_k

    n_groups = property(lambda self: self.n_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def head_outputs(self, o: torch.Tensor) -> torch.Tensor:
        return o

    def cache_spec(self):
        spec = {"k": (self.n_groups, self.d_head)}
        if not self.kv_shared:
            spec["v"] = (self.n_groups, self.d_head)
        if self.pruning is not None:
            spec["k_int"] = (self.pruning.r,)
        return spec

    def forward(self, x, cache=None, record=None):
        q, k, v = self.project(x)
        if isinstance(cache, CompactCache):
            return self.compact_step(x, q, k, v, cache, record)
        bias = keep = None
        if cache is None:
            if self.pruning is not None:
                log_i, keep = self.pruning.log_keep(x)
                bias = log_i[:, None]
                if self.training:
                    self.prune_mass = keep.tril(-1).sum((1, 2)).mean()
        else:
            new = {"k": k} if self.kv_shared else {"k": k, "v": v}
            if self.pruning is not None:
                if self.training:
                    raise RuntimeError("incremental decoding with context pruning runs at inference only (model.eval())")
                new["k_int"] = self.pruning.keys(x)
            past = cache.append(**new)
            k = past["k"]
            v = k if self.kv_shared else past["v"]
            if self.pruning is not None:
                s = cache.length
                keep = self.pruning.step_keep(x, past["k_int"], cache.alive[:, :s])
                cache.alive[:, :s] = keep[:, -1]
                bias = additive(keep, q.dtype)[:, None]
                keep = keep.to(q.dtype)
        fixed = pattern_mask(q.shape[2], k.shape[2], self.pattern, self.pattern_k, q.device)
        if fixed is not None:  # the local / strided baselines
            bias = additive(fixed, q.dtype)[None, None]
            keep = fixed.to(q.dtype)[None].expand(q.shape[0], -1, -1)
        o, probs = kernels.attention(q, k, v, scale=self.scale, bias=bias, need_weights=record is not None)
        if record is not None:
            record["attn"] = probs
            if keep is not None:
                record["keep"] = keep
        return self.head_outputs(o).transpose(1, 2).flatten(2) @ self.W_O

    def compact_step(self, x, q, k, v, cache: CompactCache, record=None):
        """Inference over the compacted cache: insert the new tokens, let them drop what they drop (the
        step function, applied to their own attention too), attend over the live slots, compact."""
        if self.training:
            raise RuntimeError("the compacted cache is for inference (model.eval())")
        q_pos, valid = cache.q_pos, cache.valid                                   # [B,T]
        new = {"k": k} if self.kv_shared else {"k": k, "v": v}
        if self.pruning is not None:
            new["k_int"] = self.pruning.keys(x)
        cache.insert(new, q_pos, valid)
        past = cache.view()
        slot_pos, live = cache.pos[:, :cache.end], cache.live[:, :cache.end]     # [B,S]
        earlier = slot_pos[:, None, :] < q_pos[:, :, None]                       # [B,T,S]
        allowed = live[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, :, None])
        if self.pruning is not None:
            survive = (self.pruning.scores(x, past["k_int"]) > 0) | ~earlier | ~valid[:, :, None]
            kept = survive.cumprod(dim=1).bool()                                 # a drop is forever
            allowed = allowed & kept
            last = (valid.long() * torch.arange(valid.shape[1], device=x.device)).argmax(1)  # last valid row
            rows = torch.arange(x.shape[0], device=x.device)
            first_drop = (~survive).long().argmax(1)                             # [B,S]
            trigger = torch.where((~survive).any(1), torch.gather(q_pos, 1, first_drop), -1)
            cache.update_live(kept[rows, last], trigger)
        allowed = torch.where(valid[:, :, None], allowed, (slot_pos >= 0)[:, None, :])  # padding rows: no NaN
        bias = additive(allowed, q.dtype)[:, None]
        kk = past["k"]
        o, probs = kernels.attention(q, kk, kk if self.kv_shared else past["v"], scale=self.scale, bias=bias,
                                     need_weights=record is not None, causal=False)
        if record is not None:
            record |= {"attn": probs, "slot_pos": slot_pos}
        return self.head_outputs(o).transpose(1, 2).flatten(2) @ self.W_O


@register("mha")
class MHA(Attention):
    """Per-head W_i^Q, W_i^K, W_i^V."""

    def __init__(self, cfg, n_heads: int | None = None):
        super().__init__(cfg, cfg.n_heads if n_heads is None else n_heads)
        n, std = self.n_heads, cfg.init_std
        self.W_Q = projection(cfg.d_model, n, cfg.d_head, std)
        self.W_K = projection(cfg.d_model, n, cfg.d_head, std)
        self.W_V = projection(cfg.d_model, n, cfg.d_head, std)

    def project(self, x):
        return split_heads(x, self.W_Q), split_heads(x, self.W_K), split_heads(x, self.W_V)


@register("sha")
class SHA(MHA):
    """A single head of width d_h; W_O maps d_h -> d_m."""

    def __init__(self, cfg):
        super().__init__(cfg, n_heads=1)


@register("mqa")
class MQA(Attention):
    """Per-head W_i^Q, one shared W^K and W^V."""

    n_groups = property(lambda self: 1)

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        self.W_Q = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)
        self.W_K = projection(cfg.d_model, 1, cfg.d_head, cfg.init_std)
        self.W_V = projection(cfg.d_model, 1, cfg.d_head, cfg.init_std)

    def project(self, x):
        return split_heads(x, self.W_Q), split_heads(x, self.W_K), split_heads(x, self.W_V)


@register("skv")
class SKV(Attention):
    """Per-head W_i^Q and W_i^{KV}: K_i = V_i = X W_i^{KV}."""

    kv_shared = True

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        self.W_Q = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)
        self.W_KV = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)

    def project(self, x):
        kv = split_heads(x, self.W_KV)
        return split_heads(x, self.W_Q), kv, kv


@register("el-att")
class ELAtt(Attention):
    """Per-head W_i^Q only: K_i = V_i = X_i, the i-th d_h-wide slice of the input."""

    kv_shared = True

    @classmethod
    def check_config(cls, cfg):
        if cfg.n_heads * cfg.d_head != cfg.d_model:
            raise ConfigError(f"el-att slices the input into heads: n_heads*d_head ({cfg.n_heads}*{cfg.d_head}) must equal d_model ({cfg.d_model})")

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        self.W_Q = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)

    def project(self, x):
        kv = x.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)
        return split_heads(x, self.W_Q), kv, kv


class MHE(Attention):
    """Head embeddings: one shared W^Q, W^K, W^V; head i sees psi(Q, e_i^Q), psi(K, e_i^K), psi(V, e_i^V).

    Computed exactly from the single shared K and V (papers.md identities), so the cache is one head.
    """

    n_groups = property(lambda self: 1)

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        d_m, n, d_h = cfg.d_model, cfg.n_heads, cfg.d_head
        self.W_Q = projection(d_m, 1, d_h, cfg.init_std)
        self.W_K = projection(d_m, 1, d_h, cfg.init_std)
        self.W_V = projection(d_m, 1, d_h, cfg.init_std)
        # small random, not zero: identical heads would stay identical
        self.e_Q = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)
        self.e_K = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)
        self.e_V = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)

    def shared_qkv(self, x):
        return split_heads(x, self.W_Q), split_heads(x, self.W_K), split_heads(x, self.W_V)


@register("mhe-mul")
class MHEMul(MHE):
    """psi(A, e) = A * (e + 1). Q~_i K~_i^T = Q diag(g_i) K^T, g_i = (1+e_i^Q)(1+e_i^K); A_i V~_i = (A_i V) diag(1+e_i^V)."""

    def query_scale(self) -> torch.Tensor:
        """g_i [n, d_h]: the effective per-head diagonal query scaling."""
        return (1 + self.e_Q) * (1 + self.e_K)

    def project(self, x):
        q, k, v = self.shared_qkv(x)
        return q * self.query_scale()[:, None, :], k, v

    def head_outputs(self, o):
        return o * (1 + self.e_V)[:, None, :]


@register("mhe-add")
class MHEAdd(MHE):
    """psi(A, e) = A + e. (Q+e_i^Q)(K+e_i^K)^T differs from (Q+e_i^Q)K^T by a constant per softmax row,
    so e^K has no effect (zero gradient; kept because the paper counts it); A_i (V+e_i^V) = A_i V + e_i^V."""

    def project(self, x):
        q, k, v = self.shared_qkv(x)
        return q + self.e_Q[:, None, :], k, v

    def head_outputs(self, o):
        return o + self.e_V[:, None, :]
