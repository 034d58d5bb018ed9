"""Causal softmax attention variants (Xue & Aletras, arXiv 2310.07911; docs/methods.md): MHA, SHA, MQA,
SKV, EL-ATT (the head-embedding variants are in mhe.py), and GQA for imported models.

Projection weights are stored as [d_m, heads, d_h], so W_Q[:, i] is the paper's W_i^Q.
Every variant reduces to q [B,H,T,D] against k, v [B,G,S,D] with G key/value groups;
MQA and both MHE variants keep a single group, so their cache is one head wide.
"""
from __future__ import annotations

import math
import threading

import torch
from torch import nn

import kernels
from kernels.reference import rotate_half
from models.backends.full import FULL
from models.errors import ConfigError
from models.mixers.base import Mixer, register
from models.pruning import ContextPruning


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


_TABLES: dict = {}  # (positions, width, theta, dtype, device) -> rotary_tables of every position
_TABLES_LOCK = threading.Lock()


def rotary_table(n: int, d: int, theta: float, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] of positions 0..n-1, computed once per process (a fixed-shape step looks its position up
    on the device, kernels.step_write: the angles are no kernels of their own). Plain tensors, as the caches
    are: a captured graph may read them outside inference mode."""
    key = (n, d, theta, dtype, str(device))
    got = _TABLES.get(key)
    if got is None:
        with _TABLES_LOCK:  # one table per key, ever: a captured graph may hold the first one's address
            got = _TABLES.get(key)
            if got is None:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # (its memory: the graph's)
                    raise RuntimeError("the rotary table is made before a CUDA graph capture (a warm-up step)")
                with torch.inference_mode(False), torch.no_grad():
                    got = _TABLES[key] = rotary_tables(torch.arange(n, device=device), d, theta, dtype)
    return got


def projection(d_model: int, heads: int, d_head: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(d_model, heads, d_head) * std)


class Attention(Mixer):
    """Shared machinery: project, rotate, hand q/k/v to the backend; softmax through the kernel dispatch with the
    per-head maps, concat, W_O."""

    out_names = ("W_O", "b_O")
    decodes_compacted = True   # context pruning's compacted cache (models.backends.compacted)
    replays_policies = True    # an eviction policy over a whole text in one forward (models.pruning.replay)
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
        self.W_O = nn.Parameter(torch.randn(n_heads * cfg.d_head, cfg.d_model) * cfg.init_std
                                / math.sqrt(2 * cfg.n_layers))
        self.pruning = (ContextPruning(cfg.d_model, cfg.prune_r, cfg.prune_beta, cfg.prune_distance, cfg.prune_sinks)
                        if cfg.prune else None)
        self.pattern, self.pattern_k = cfg.pattern, cfg.pattern_k
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.context = cfg.context  # (the rotary table of a fixed-shape step covers it)
        self.b_O = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.attn_bias else None

    n_groups = property(lambda self: self.n_heads)

    def projections(self) -> tuple | None:
        """The (weight [d_m,n,d_h], bias or None) pairs whose products with x make up `project`'s q, k, v (in
        `from_parts`'s order), when that is all `project` does; None otherwise. A fixed-shape decode step runs them
        as one product (models.packing)."""
        return None

    def packable_projections(self) -> tuple | None:
        return self.projections() if type(self).project is Attention.project else None

    def from_parts(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v from the products of `projections`, each [B,n,T,d_h]."""
        return tuple(parts)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.from_parts([split_heads(x, w, b) for w, b in self.projections()])

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

    def attend(self, q, k, v, bias, record, keep=None, causal=True, lengths=None, merge_counts=None,
               bias_is_causal=False):
        """softmax(q k^T * scale + bias) v through the kernel dispatch, then W_O; fills `record` when asked.
        lengths [B]: each row reads its first lengths[b] slots; merge_counts: a fixed-shape state's workspace;
        bias_is_causal: bias is -inf wherever the causal mask masks (kernels.attention)."""
        want = record is not None and record.attention_maps
        o, probs = kernels.attention(q, k, v, scale=self.scale, bias=bias, need_weights=want, causal=causal,
                                     lengths=lengths, merge_counts=merge_counts, bias_is_causal=bias_is_causal,
                                     **self.head_maps())
        if record is not None:
            if want:
                record.attn = probs
            if keep is not None:
                record.keep = keep
        return self.output(o)

    def forward(self, x, cache=None, record=None, positions=None):
        """Project and rotate here; the state handed in (None: the whole sequence) attends and owns the masking
        and eviction (models/backends)."""
        state = FULL if cache is None else cache
        q, k, v = state.project(self, x, record)                                         # [B,H|G,T,D]
        if self.rope_theta is None:
            return state.attend(self, x, q, k, v, record)
        # rotary embedding, Llama's half-split convention (kernels.reference.rotate_half)
        # a fixed-shape step rotates as it writes (kernels.step_write; a gradient takes its reference there)
        if state.rotates(q, record):
            table = rotary_table(self.context, self.d_head, self.rope_theta, q.dtype, q.device)
            return state.attend(self, x, q, k, v, record, rope=(*table, positions.reshape(-1)))
        cos, sin = rotary_tables(positions, self.d_head, self.rope_theta, q.dtype)
        return state.attend(self, x, rotate_half(q, cos, sin), rotate_half(k, cos, sin), v, record)


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

    def projections(self):
        return (self.W_Q, self.b_Q), (self.W_K, self.b_K), (self.W_V, self.b_V)


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

    def projections(self):
        return (self.W_Q, None), (self.W_K, None), (self.W_V, None)


@register("skv")
class SKV(Attention):
    """Per-head W_i^Q and W_i^{KV}: K_i = V_i = X W_i^{KV}."""

    kv_shared = True

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        self.W_Q = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)
        self.W_KV = projection(cfg.d_model, cfg.n_heads, cfg.d_head, cfg.init_std)

    def projections(self):
        return (self.W_Q, None), (self.W_KV, None)

    def from_parts(self, parts):
        q, kv = parts
        return q, kv, kv


@register("el-att")
class ELAtt(Attention):
    """Per-head W_i^Q only: K_i = V_i = X_i, the i-th d_h-wide slice of the input."""

    kv_shared = True

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        if cfg.n_heads * cfg.d_head != cfg.d_model:
            raise ConfigError(f"el-att slices the input into heads: n_heads*d_head ({cfg.n_heads}*{cfg.d_head}) "
                              f"must equal d_model ({cfg.d_model})")

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
