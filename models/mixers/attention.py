"""Causal softmax attention variants (Xue & Aletras, arXiv 2310.07911), papers.md section 1: MHA, SHA, MQA,
SKV, EL-ATT (the head-embedding variants are in mhe.py), and GQA for imported models.

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
from models.mixers.base import Mixer, register
from models.pruning import CompactCache, ContextPruning, pattern_allows, pattern_mask
from models.pruning.compact_cache import ALIGN
from models.pruning.replay import LayerReplay


def additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as an additive attention bias: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def split_heads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [B,T,d_m] @ w [d_m,n,d_h] (+ b [n,d_h]) -> [B,n,T,d_h]."""
    y = x @ w.flatten(1)
    if b is not None:
        y = y + b.flatten()
    return y.unflatten(-1, w.shape[1:]).transpose(1, 2)


def rotary_tables(positions: torch.Tensor, d: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] (or [B, 1, T, D] for positions [B,T]) of the rotary angles. Every layer of one forward
    rotates by the same positions, so the tables are computed once and kept on the positions tensor itself
    (it lives as long as that forward; a tensor changed in place gets new tables)."""
    memo = positions.__dict__.setdefault("_rotary", {})
    key = (d, theta, dtype, positions._version if not positions.is_inference() else 0)  # (no version counter there)
    if key not in memo:
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
        ang = positions.to(torch.float32)[..., None] * inv                  # [T, D/2] or [B, T, D/2]
        ang = torch.cat([ang, ang], dim=-1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        memo[key] = (cos, sin)
    return memo[key]


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding, the half-split convention of Llama: x [B,H,T,D]; positions [T] or [B,T]."""
    d = x.shape[-1]
    cos, sin = rotary_tables(positions, d, theta, x.dtype)
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
        self.pruning = (ContextPruning(cfg.d_model, cfg.prune_r, cfg.prune_beta, cfg.prune_distance, cfg.prune_sinks)
                        if cfg.prune else None)
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

    def cache_spec(self, learned_rule: bool = True):
        """learned_rule False: a pruned model decoding under an eviction policy, its rule off (no K_int kept)."""
        spec = {"k": (self.n_groups, self.d_head)}
        if not self.kv_shared:
            spec["v"] = (self.n_groups, self.d_head)
        if self.pruning is not None and learned_rule:
            spec["k_int"] = (self.pruning.r,)
        return spec

    def output(self, o: torch.Tensor) -> torch.Tensor:
        y = o.transpose(1, 2).flatten(2) @ self.W_O
        return y if self.b_O is None else y + self.b_O

    def cache_entries(self, x, k, v, k_int=None) -> dict[str, torch.Tensor]:
        """What the new positions add to a decode cache: K (and V unless K is V), and K_int with pruning
        (computed here unless the caller already has it; k_int=False: the rule is off, none kept)."""
        new = {"k": k} if self.kv_shared else {"k": k, "v": v}
        if self.pruning is not None and k_int is not False:
            if self.training:
                raise RuntimeError("decoding with context pruning runs at inference only (model.eval())")
            new["k_int"] = self.pruning.keys(x) if k_int is None else k_int
        return new

    def attend(self, q, k, v, bias, record, keep=None, causal=True):
        """softmax(q k^T * scale + bias) v through the kernel dispatch, then W_O; fills `record` when asked."""
        want = record is not None and not record.get("skip_attn")
        o, probs = kernels.attention(q, k, v, scale=self.scale, bias=bias, need_weights=want, causal=causal,
                                     **self.head_maps())
        if record is not None:
            if want:
                record["attn"] = probs
            if keep is not None:
                record["keep"] = keep
        return self.output(o)

    def forward(self, x, cache=None, record=None, positions=None):
        q, k, v = self.project(x)                                      # [B,H,T,D], [B,G,T,D], [B,G,T,D]
        if self.rope_theta is not None:
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        if cache is None:
            return self.full(x, q, k, v, record)
        if isinstance(cache, CompactCache):
            return self.compact_step(x, q, k, v, cache, record)
        if isinstance(cache, LayerReplay):
            return self.replay_step(q, k, v, cache, record)
        return self.cached_step(x, q, k, v, cache, record)

    def replay_step(self, q, k, v, layer: LayerReplay, record):
        """A whole text under an eviction policy (models.pruning.replay): the policy steps through the positions
        over this layer's scores, then every query attends once over what it left. Learned pruning is off here."""
        if q.shape[0] != 1:
            raise ValueError("an eviction replay reads one text at a time (batch 1)")
        t = q.shape[2]
        scores = None
        if layer.needs_scores:
            scores = kernels.reference.attention_scores(q, k, scale=self.scale, **self.head_maps())[0]
        visible = layer.run(t, scores, q.device)
        return self.attend(q, k, v, additive(visible, q.dtype)[None, None], record, visible.to(q.dtype)[None], causal=False)

    def full(self, x, q, k, v, record):
        """A whole sequence (training, scoring): causal softmax attention, plus log I with context pruning
        (the alpha-sigmoid while training, the step at inference) or a fixed local/strided pattern."""
        if self.pruning is not None:
            log_i, keep = self.pruning.log_keep(x)                      # [B,T,T] each
            if self.training:
                self.prune_mass = self.pruning.mass(keep)
            return self.attend(q, k, v, log_i[:, None], record, keep)
        bias, keep = self.pattern_bias(q.shape[0], q.shape[2], k.shape[2], q.dtype, q.device)
        return self.attend(q, k, v, bias, record, keep)

    def cached_step(self, x, q, k, v, cache, record):
        """Decoding over the static cache: append the new positions; with pruning, the new queries drop what
        they drop (the step), for their own attention too, and the cache remembers it in `alive`."""
        past = cache.append(**self.cache_entries(x, k, v))
        kk = past["k"]                                                 # [B,G,S,D]
        vv = kk if self.kv_shared else past["v"]
        if self.pruning is None:
            bias, keep = self.pattern_bias(q.shape[0], q.shape[2], kk.shape[2], q.dtype, q.device)
            return self.attend(q, kk, vv, bias, record, keep)
        s = cache.length
        allowed = self.pruning.step_keep(x, past["k_int"], cache.alive[:, :s])  # [B,T,S]
        cache.alive[:, :s] = allowed[:, -1]
        return self.attend(q, kk, vv, additive(allowed, q.dtype)[:, None], record, allowed.to(q.dtype))

    def pattern_bias(self, b: int, t: int, s: int, dtype, device):
        """The local / strided baselines as (additive bias [1,1,T,S], keep [B,T,S]); (None, None) when dense."""
        fixed = pattern_mask(t, s, self.pattern, self.pattern_k, device)
        if fixed is None:
            return None, None
        return additive(fixed, dtype)[None, None], fixed.to(dtype)[None].expand(b, -1, -1)

    def compact_step(self, x, q, k, v, cache: CompactCache, record=None):
        """Inference over the compacted cache: insert the new tokens, let them drop what they drop (the
        step function, applied to their own attention too), attend over the live slots, compact."""
        if self.training:
            raise RuntimeError("the compacted cache is for inference (model.eval())")
        q_pos, valid = cache.q_pos, cache.valid                                   # [B,T]; valid None: all real
        if q.shape[2] == 1 and valid is None and record is None:
            return self.compact_decode(x, q, k, v, cache)
        if cache.policy is not None and not cache.policy.at_prompt_end:
            if q.shape[2] == 1:  # one token per row, but some rows are padding (or diagnostics were asked for)
                raise ValueError(f"{cache.policy.name}: a decode step with padding rows or diagnostics is not supported "
                                 "under an eviction policy; decode rows of one length, without diagnostics")
            raise ValueError(f"{cache.policy.name} evicts as each token arrives: feed the prompt one token per call "
                             "(models.generate.stream does)")
        rule = self.pruning if cache.policy is None else None  # under a policy a learned rule is off
        valid = torch.ones_like(q_pos, dtype=torch.bool) if valid is None else valid
        cache.insert(self.cache_entries(x, k, v, None if rule is not None else False), q_pos, valid)
        past = cache.view()
        slot_pos, live = cache.pos[:, :cache.end], cache.live[:, :cache.end]     # [B,S]
        kk = past["k"]
        vv = kk if self.kv_shared else past["v"]
        if rule is not None and q.shape[2] == 1 and record is None:  # a decode step with padding rows
            prune = {"q_int": x[:, 0] @ self.pruning.W_Qint, "k_int": past["k_int"], "beta": self.pruning.beta_value(),
                     "live": live, "pos": slot_pos, "q_pos": q_pos[:, 0], "valid": valid[:, 0],
                     **self.pruning.rule_terms()}
            o, keep = kernels.compact_decode(q, kk, vv, scale=self.scale, prune=prune, **self.head_maps())
            cache.update_live(keep, q_pos[:, :1].expand_as(keep))
            return self.output(o)
        allowed = live[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, :, None])  # [B,T,S]
        if self.pattern != "dense":  # the local / strided baselines, by position (slots are not in order)
            allowed = allowed & pattern_allows(q_pos[:, :, None], slot_pos[:, None, :], self.pattern, self.pattern_k)
        if rule is not None:
            kept = rule.survival(x, past["k_int"], slot_pos, q_pos, valid)
            allowed = allowed & kept
            last = (valid.long() * torch.arange(valid.shape[1], device=x.device)).argmax(1)  # last valid row
            rows = torch.arange(x.shape[0], device=x.device)
            dropped = ~kept                                                      # from its first drop on
            trigger = torch.where(dropped.any(1), torch.gather(q_pos, 1, dropped.long().argmax(1)), -1)
            cache.update_live(kept[rows, last], trigger)
        allowed = torch.where(valid[:, :, None], allowed, (slot_pos >= 0)[:, None, :])  # padding rows: no NaN
        out = self.attend(q, kk, vv, additive(allowed, q.dtype)[:, None], record, causal=False)
        if cache.policy is not None and cache.policy.at_prompt_end and q.shape[2] > 1:
            if cache.valid is not None:
                raise ValueError("SnapKV selects after a prompt of real tokens only (no padding rows)")
            self.snapkv_select(q, kk, vv, cache, q_pos)
        if record is not None:
            record["slot_pos"] = slot_pos
        return out

    def policy_decode(self, q, kk, vv, cache: CompactCache, q_pos):
        """A decode step under a heuristic eviction policy: StreamingLLM evicts by position before the query
        attends; TOVA and H2O read the query's attention over what is held, then evict; SnapKV decided at
        the end of the prompt and keeps every later token."""
        pol, live, pos = cache.policy, cache.live[:, :cache.end], cache.pos[:, :cache.end]
        if pol.at_prompt_end or not pol.uses_attention:
            keep = live if pol.at_prompt_end else pol.step(live, pos, q_pos[:, 0])
            cache.count_seen(keep)
            out = self.attend(q, kk, vv, additive(keep, q.dtype)[:, None, None], None, causal=False)
        else:
            cache.count_seen(live)
            o, probs = kernels.attention(q, kk, vv, scale=self.scale, bias=additive(live, q.dtype)[:, None, None],
                                         need_weights=True, causal=False, **self.head_maps())
            keep = pol.step(live, pos, q_pos[:, 0], probs[:, :, 0].float(), cache.slot_state)
            out = self.output(o)
        cache.update_kept(keep, q_pos, every=ALIGN)
        return out

    def snapkv_select(self, q, kk, vv, cache: CompactCache, q_pos):
        """After a prompt (all rows real): the last `window` queries' attention picks what the cache keeps."""
        pol = cache.policy
        w = min(pol.window, q.shape[2])
        slot_pos, live = cache.pos[:, :cache.end], cache.live[:, :cache.end]
        allowed = live[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, -w:, None])            # [B,w,S]
        _, probs = kernels.attention(q[:, :, -w:], kk, vv, scale=self.scale, bias=additive(allowed, q.dtype)[:, None],
                                     need_weights=True, causal=False, **self.head_maps())
        keep = pol.select(live, slot_pos, q_pos[:, -1] + 1, probs.float())
        cache.update_live(keep, q_pos[:, -1:].expand_as(keep))

    def compact_decode(self, x, q, k, v, cache: CompactCache):
        """One new token per row, every row real: the fast path (no host synchronisation, no sort). The token
        joins slot `end`; with pruning, one fused pass scores it against the live slots, attends over what
        survives and says what survives; the compaction question is asked every few steps."""
        q_pos = cache.q_pos
        rule = self.pruning if cache.policy is None else None  # under a policy a learned rule is off (no K_int)
        q_int, k_int = rule.decode_projections(x) if rule is not None else (None, False)
        cache.append(self.cache_entries(x, k, v, k_int), q_pos)
        past = cache.view()
        kk = past["k"]
        vv = kk if self.kv_shared else past["v"]
        live = cache.live[:, :cache.end]
        if cache.policy is not None:
            return self.policy_decode(q, kk, vv, cache, q_pos)
        if self.pruning is None:  # a dense or fixed-pattern model on the compacted cache
            allowed = live
            if self.pattern != "dense":
                allowed = allowed & pattern_allows(q_pos, cache.pos[:, :cache.end], self.pattern, self.pattern_k)
            cache.count_seen(allowed)
            return self.attend(q, kk, vv, additive(allowed, q.dtype)[:, None, None], None, causal=False)
        prune = {"q_int": q_int[:, 0], "k_int": past["k_int"], "beta": self.pruning.beta_value(),
                 "live": live, "pos": cache.pos[:, :cache.end], "q_pos": q_pos[:, 0], "valid": None,
                 **self.pruning.rule_terms()}
        o, keep = kernels.compact_decode(q, kk, vv, scale=self.scale, prune=prune, **self.head_maps())
        cache.count_seen(keep)
        cache.update_kept(keep, q_pos, every=ALIGN)
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
