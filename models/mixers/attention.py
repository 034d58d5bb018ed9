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


def split_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [B,T,d_m] @ w [d_m,n,d_h] (+ b [n,d_h]) -> [B,n,T,d_h]."""
    y = x @ w.flatten(1)
    if b is not None:
        y = y + b.flatten()
    return y.unflatten(-1, w.shape[1:]).transpose(1, 2)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding, the half-split convention of Llama: x [B,H,T,D]; positions [T] or [B,T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[..., None] * inv                      # [T, D/2] or [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def projection(d_model: int, heads: int, d_head: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(d_model, heads, d_head) * std)


class Attention(Mixer):
    """Shared machinery: project, (cache), attend, per-head output map, concat, W_O."""

    out_names = ("W_O", "b_O")
    kv_shared = False  # K is V (SKV, EL-ATT): cache only K
    supports = ()      # architecture options this variant accepts beyond the defaults: "bias", "rope"

    @classmethod
    def check_config(cls, cfg):
        if cfg.attn_bias and "bias" not in cls.supports:
            raise ConfigError(f"attn_bias is supported by mha and gqa, not {cfg.mixer}")
        if cfg.positions == "rope" and "rope" not in cls.supports:
            raise ConfigError(f"rotary positions are supported by mha, sha, mqa and gqa, not {cfg.mixer} "
                              "(they would break its K = V or head-embedding identities)")

    def __init__(self, cfg, n_heads: int):
        super().__init__()
        self.n_heads, self.d_head = n_heads, cfg.d_head
        self.scale = 1.0 / math.sqrt(cfg.d_head)
        # GPT-2 residual scaling: output projections start smaller in deeper models
        self.W_O = nn.Parameter(torch.randn(n_heads * cfg.d_head, cfg.d_model) * cfg.init_std / math.sqrt(2 * cfg.n_layers))
        self.pruning = ContextPruning(cfg.d_model, cfg.prune_r, cfg.prune_beta) if cfg.prune else None
        self.prune_mass = None  # training: sum over j < k of I_{k,j}, batch mean (for the sparsity loss)
        self.pattern, self.pattern_k = cfg.pattern, cfg.pattern_k
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.b_O = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.attn_bias else None

    n_groups = property(lambda self: self.n_heads)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def head_maps(self) -> dict[str, torch.Tensor]:
        """Per-head query/output maps the kernel applies (MHE: from one shared Q); none for the others."""
        return {}

    def cache_spec(self):
        spec = {"k": (self.n_groups, self.d_head)}
        if not self.kv_shared:
            spec["v"] = (self.n_groups, self.d_head)
        if self.pruning is not None:
            spec["k_int"] = (self.pruning.r,)
        return spec

    def output(self, o: torch.Tensor) -> torch.Tensor:
        y = o.transpose(1, 2).flatten(2) @ self.W_O
        return y if self.b_O is None else y + self.b_O

    def forward(self, x, cache=None, record=None, positions=None):
        q, k, v = self.project(x)
        if self.rope_theta is not None:
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
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
        o, probs = kernels.attention(q, k, v, scale=self.scale, bias=bias, need_weights=record is not None,
                                     **self.head_maps())
        if record is not None:
            record["attn"] = probs
            if keep is not None:
                record["keep"] = keep
        return self.output(o)

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
        kk = past["k"]
        vv = kk if self.kv_shared else past["v"]
        if self.pruning is not None and q.shape[2] == 1 and record is None:  # a decode step: one fused pass
            prune = {"q_int": x[:, 0] @ self.pruning.W_Qint, "k_int": past["k_int"], "beta": float(self.pruning.beta),
                     "live": live, "pos": slot_pos, "q_pos": q_pos[:, 0], "valid": valid[:, 0]}
            o, keep = kernels.compact_decode(q, kk, vv, scale=self.scale, prune=prune, **self.head_maps())
            cache.update_live(keep, q_pos[:, :1].expand_as(keep))
            return self.output(o)
        allowed = live[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, :, None])  # [B,T,S]
        if self.pruning is not None:
            kept = self.pruning.survival(x, past["k_int"], slot_pos, q_pos, valid)
            allowed = allowed & kept
            last = (valid.long() * torch.arange(valid.shape[1], device=x.device)).argmax(1)  # last valid row
            rows = torch.arange(x.shape[0], device=x.device)
            dropped = ~kept                                                      # from its first drop on
            trigger = torch.where(dropped.any(1), torch.gather(q_pos, 1, dropped.long().argmax(1)), -1)
            cache.update_live(kept[rows, last], trigger)
        allowed = torch.where(valid[:, :, None], allowed, (slot_pos >= 0)[:, None, :])  # padding rows: no NaN
        bias = additive(allowed, q.dtype)[:, None]
        o, probs = kernels.attention(q, kk, vv, scale=self.scale, bias=bias, need_weights=record is not None,
                                     causal=False, **self.head_maps())
        if record is not None:
            record |= {"attn": probs, "slot_pos": slot_pos}
        return self.output(o)


@register("mha")
class MHA(Attention):
    """Per-head W_i^Q, W_i^K, W_i^V (with kv_heads < n_heads: grouped-query attention)."""

    supports = ("bias", "rope")

    def __init__(self, cfg, n_heads: int | None = None, kv_heads: int | None = None):
        super().__init__(cfg, cfg.n_heads if n_heads is None else n_heads)
        n, std = self.n_heads, cfg.init_std
        self.kv_heads = n if kv_heads is None else kv_heads
        self.W_Q = projection(cfg.d_model, n, cfg.d_head, std)
        self.W_K = projection(cfg.d_model, self.kv_heads, cfg.d_head, std)
        self.W_V = projection(cfg.d_model, self.kv_heads, cfg.d_head, std)
        self.b_Q = self.b_K = self.b_V = None
        if cfg.attn_bias:
            self.b_Q = nn.Parameter(torch.zeros(n, cfg.d_head))
            self.b_K = nn.Parameter(torch.zeros(self.kv_heads, cfg.d_head))
            self.b_V = nn.Parameter(torch.zeros(self.kv_heads, cfg.d_head))

    n_groups = property(lambda self: self.kv_heads)

    def project(self, x):
        return split_heads(x, self.W_Q, self.b_Q), split_heads(x, self.W_K, self.b_K), split_heads(x, self.W_V, self.b_V)


@register("sha")
class SHA(MHA):
    """A single head of width d_h; W_O maps d_h -> d_m."""

    supports = ("rope",)

    def __init__(self, cfg):
        super().__init__(cfg, n_heads=1)


@register("mqa")
class MQA(Attention):
    """Per-head W_i^Q, one shared W^K and W^V."""

    supports = ("rope",)

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
        super().check_config(cfg)
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

    def project(self, x):  # one shared Q head: the kernel applies each head's map (head_maps)
        return split_heads(x, self.W_Q), split_heads(x, self.W_K), split_heads(x, self.W_V)


@register("mhe-mul")
class MHEMul(MHE):
    """psi(A, e) = A * (e + 1). Q~_i K~_i^T = Q diag(g_i) K^T, g_i = (1+e_i^Q)(1+e_i^K); A_i V~_i = (A_i V) diag(1+e_i^V)."""

    def query_scale(self) -> torch.Tensor:
        """g_i [n, d_h]: the effective per-head diagonal query scaling."""
        return (1 + self.e_Q) * (1 + self.e_K)

    def head_maps(self):
        return {"q_mul": self.query_scale(), "o_mul": 1 + self.e_V}


@register("mhe-add")
class MHEAdd(MHE):
    """psi(A, e) = A + e. (Q+e_i^Q)(K+e_i^K)^T differs from (Q+e_i^Q)K^T by a constant per softmax row,
    so e^K has no effect (zero gradient; kept because the paper counts it); A_i (V+e_i^V) = A_i V + e_i^V."""

    def head_maps(self):
        return {"q_add": self.e_Q, "o_add": self.e_V}


@register("gqa")
class GQA(MHA):
    """Grouped-query attention: n_kv_heads key/value heads, each shared by n_heads / n_kv_heads queries
    (the Llama family). Not one of the papers' variants: it is here for imported models."""

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.n_heads % cls.kv_heads_of(cfg):
            raise ConfigError(f"gqa: n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cls.kv_heads_of(cfg)}")

    @staticmethod
    def kv_heads_of(cfg) -> int:
        return cfg.n_kv_heads or max(1, cfg.n_heads // 2)

    def __init__(self, cfg):
        super().__init__(cfg, kv_heads=self.kv_heads_of(cfg))
