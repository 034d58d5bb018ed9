"""Pre-LN decoder language model: token + learned position embeddings, [LN -> mixer, LN -> GELU FFN]
blocks with residuals, final LN, output head tied to the token embedding (nanoGPT's shape)."""
from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from models import packing
from models.adapters import Adapter, new_A
from models.cache import DecodeCache
from models.config import ModelConfig
from models.mixers import LayerRecord, build_mixer
from models.pruning import CompactCache, CompactDecodeCache, policies


class FeedForward(nn.Module):
    """down(act(up(x))) with GELU (exact or tanh), or SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.ffn
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ffn_bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ffn_bias)
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ffn_bias) if cfg.ffn == "swiglu" else None
        self.drop = nn.Dropout(cfg.dropout)
        for lin, std in ((self.up, cfg.init_std), (self.gate, cfg.init_std),
                         (self.down, cfg.init_std / math.sqrt(2 * cfg.n_layers))):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)

    def forward(self, x, packed: tuple | None = None):
        """packed: gate and up side by side (models.packing, a fixed-shape decode step): one product for both."""
        if self.kind == "swiglu":
            g, u = packing.gate_up(x, *packed) if packed else (self.gate(x), self.up(x))
            h = kernels.silu_mul(g, u)  # one kernel on a GPU at inference
        else:
            h = F.gelu(self.up(x), approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.drop(self.down(h))


class _AddNorm:
    """forward(x) is the norm of x; forward(x, residual) is (x + residual, its norm), the block's residual sum
    and the next norm in one kernel on a GPU at inference (kernels.add_norm; vLLM's norms take a residual the
    same way). A forward hook sees the call either way."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        s, y = kernels.add_norm(x, residual, self.weight, getattr(self, "bias", None), eps, self.rms)
        return y if residual is None else (s, y)


class RMSNorm(_AddNorm, nn.RMSNorm):
    rms = True


class LayerNorm(_AddNorm, nn.LayerNorm):
    rms = False


def norm(cfg: ModelConfig) -> nn.Module:
    return (RMSNorm if cfg.norm == "rmsnorm" else LayerNorm)(cfg.d_model, eps=cfg.ln_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, shared_A: nn.Parameter | None = None):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.mixer = build_mixer(cfg)
        self.ln_2 = norm(cfg)
        self.ffn = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.adapter_mixer = self.adapter_ffn = None
        if cfg.adapter:  # after each sub-layer, before the residual add (COMPACTER++: feed-forward only)
            make = lambda: Adapter(cfg.d_model, cfg.d_model // cfg.adapter_reduction, cfg.adapter,  # noqa: E731
                                   cfg.phm_n, cfg.phm_rank, shared_A)
            self.adapter_ffn = make()
            if cfg.adapter != "compacter++":
                self.adapter_mixer = make()

    def forward(self, x, cache=None, record=None, positions=None, mixer_out=None, pending=None, defer=False):
        """mixer_out: a function h -> h given the token mixer's output [B,T,d_m] (before any adapter and the residual
        sum), whose return goes on instead (DecoderLM.forward's mixer_out, for one block).
        pending: the previous block's last output, not yet added to x (its sum is then ln_1's kernel); defer: return
        (x, h) with the feed-forward output h not added either (a decode step's blocks chain this way: one kernel
        a layer fewer)."""
        if pending is None:
            a = self.ln_1(x)
        else:
            x, a = self.ln_1(x, pending)
        h = self.mixer(a, cache, record, positions)
        if mixer_out is not None:
            h = mixer_out(h)
        if self.adapter_mixer is not None:
            h = self.adapter_mixer(h)
        x, h = self.ln_2(x, self.drop(h))  # x + h, and ln_2 of it
        h = self.ffn(h, packing.step_weights(cache, h, record).get("gate_up"))
        if self.adapter_ffn is not None:
            h = self.adapter_ffn(h)
        return (x, h) if defer else x + h


@contextmanager
def evaluating(model: nn.Module):
    """Inference mode inside the block (no dropout; context pruning's step function), then the mode the
    model had before."""
    was = model.training
    if not was:  # already in inference mode: write nothing (a model shared by app sessions stays untouched)
        yield model
        return
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


@dataclass
class ModelOutput:
    logits: torch.Tensor | None          # [B,T,vocab] (None with hidden_only)
    loss: torch.Tensor | None = None     # mean next-token cross-entropy, when targets were given
    cache: DecodeCache | None = None
    diagnostics: list[LayerRecord] | None = None  # per layer, only when asked for
    prune_mass: torch.Tensor | None = None  # training with pruning: sum over layers of sum_{j<k} I_{k,j}
    hidden: torch.Tensor | None = None   # [B,T,d_model] after the final norm, with hidden_only


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.wte.weight, std=cfg.init_std)
        self.wpe = None
        if cfg.positions == "learned":
            self.wpe = nn.Embedding(cfg.context, cfg.d_model)
            nn.init.normal_(self.wpe.weight, std=cfg.init_std)
        self.lm_head = None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Parameter(torch.randn(cfg.vocab_size, cfg.d_model) * cfg.init_std)
        self.drop = nn.Dropout(cfg.dropout)
        # COMPACTER: one set of A_i for every adapter in the model
        self.adapter_A = new_A(cfg.phm_n) if cfg.adapter in ("compacter", "compacter++") else None
        self.blocks = nn.ModuleList(Block(cfg, self.adapter_A) for _ in range(cfg.n_layers))
        self.ln_f = norm(cfg)

    def adapter_params(self) -> dict[str, nn.Parameter]:
        """COMPACTER's shared A_i belong to the model (see models.adapters.get_adapter_params)."""
        return {} if self.adapter_A is None else {"adapter_A": self.adapter_A}

    def check_fits(self, n: int, what: str = "tokens") -> None:
        """The one context-length check: n positions must fit the context window (learned position tables and
        the decode caches end there), else a ValueError that says what to do."""
        if n > self.config.context:
            raise ValueError(f"{n} {what} exceed the context window of {self.config.context}; take a window")

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> DecodeCache:
        capacity = self.config.context if capacity is None else min(capacity, self.config.context)
        p = self.wte.weight
        return DecodeCache([b.mixer.new_cache(batch, capacity, p.dtype, p.device) for b in self.blocks])

    def new_compact_cache(self, batch: int = 1, capacity: int = 16, policy=None,
                          fixed: bool = False) -> CompactDecodeCache:
        """The compacted cache (context pruning's data structure; rows may have different lengths). Attention
        mixers only: an Extractor's state is a window of past inputs indexed by lag, which slots cannot hold.
        policy: a heuristic eviction policy (models.pruning.policies); on a model with learned pruning the policy
        decides instead of the rule (its own weights, the rule off, as models.pruning.replay runs it). fixed: compaction
        in place and no shrinking, so that fix_shapes() can make the decode steps keep their shapes (models.graphs)."""
        if not self.blocks[0].mixer.decodes_compacted:
            raise ValueError(f"the compacted cache (generate_batch) serves attention mixers, not {self.config.mixer}: "
                             "an Extractor mixes its past inputs by lag; generate() decodes it with the static cache")
        if policy is not None and self.config.pattern != "dense":
            raise ValueError(f"an eviction policy ({policy.name}) runs on a softmax model without a fixed pattern; "
                             f"this one attends through a {self.config.pattern} window")
        why = policy is not None and policies.not_decodable(type(policy), self.blocks[0].mixer.n_groups)
        if why:
            raise ValueError(why)
        p = self.wte.weight
        learned = policy is None and self.config.prune  # the rule decides: its decode constants read once, here
        # a per-KV-group policy: one row of slots per (batch row, group), each holding one group's K/V
        g = self.blocks[0].mixer.n_groups if policy is not None and policy.per_group else 1
        layers = []
        for b in self.blocks:
            spec = b.mixer.cache_spec(policy is None)
            if g > 1:
                spec = {name: (1, *shape[1:]) for name, shape in spec.items()}
            layers.append(CompactCache(spec, batch * g, capacity, p.dtype, p.device, policy,
                                       b.mixer.pruning.decode_constants() if learned else None, groups=g,
                                       fixed=fixed))
        return CompactDecodeCache(layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache=None,
                diagnostics: bool = False, positions: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                last_only: bool = False, attention_maps: bool = True, hidden_only: bool = False,
                residual=None, mixer_out=None) -> ModelOutput:
        """idx [B,T] token ids; embeds [B,T,d_m], when given, stands in for wte(idx) (attributions take gradients
        there without hooking the model, which app sessions share). With a cache, idx holds the next T positions
        and the cache is extended. With a CompactDecodeCache, positions [B,T] give each row's own positions and
        valid [B,T] marks real tokens (False: padding of a shorter row, neither stored nor allowed to drop
        anything; None: all real).
        last_only: logits [B,1,V] for the last position alone (generation, attributions). diagnostics: each layer's
        LayerRecord comes back in ModelOutput.diagnostics (attention_maps=False: without the attention
        probabilities). hidden_only: the final-norm states in ModelOutput.hidden and no logits (the caller applies
        output_weight a chunk of positions at a time: models.scoring.head_logprobs). residual: a function (i, x)
        -> x given the residual stream [B,T,d_m] entering block i, whose return enters it instead; mixer_out: a
        function (i, h) -> h given block i's token mixer output, whose return the block goes on with (activation
        patching reads and replaces them there: models.pruning.intervene; no hook is put on the model, which app
        sessions share)."""
        b, t = idx.shape
        compact_fixed = fixed = False
        if isinstance(cache, CompactDecodeCache):
            # a fixed-shape step (CompactDecodeCache.fix_shapes): positions from the device, no host check (the
            # caller, models.decode.Decoder, keeps the count and checks the context)
            compact_fixed = cache.next_pos is not None and t == 1 and valid is None and not diagnostics
            if compact_fixed:
                positions = cache.next_pos.clone()
            elif positions is None:
                raise ValueError("the compacted cache needs positions [B,T] for the new tokens")
            else:
                self.check_fits(int(positions.max() if valid is None else positions[valid].max()) + 1, "positions")
            for layer in cache.layers:
                layer.q_pos, layer.valid = positions, valid
            positions = positions.clamp(0, self.config.context - 1)
        else:
            start = 0 if cache is None else cache.length
            self.check_fits(start + t, "positions")
            # a static-shape step (DecodeCache.fix_shapes): the position is the device-side cursor, no host count
            fixed = isinstance(cache, DecodeCache) and cache.cursor is not None and t == 1 and not diagnostics
            if fixed and start + 1 > cache.capacity:  # index_copy_ past the buffers would be a device-side assert
                raise ValueError(f"cache full: {start} + 1 positions exceed capacity {cache.capacity}")
            # (a copy: the rotary tables are memoised on the positions tensor, and the cursor outlives this forward)
            positions = cache.cursor.clone() if fixed else torch.arange(start, start + t, device=idx.device)
        x = self.wte(idx) if embeds is None else embeds
        if self.wpe is not None:
            x = x + self.wpe(positions)
        x = self.drop(x)
        # attention_maps=False: the pruning keep masks alone, no [H,T,T] attention probabilities (the Pruning page
        # of a 30-layer model over 1,000 tokens would otherwise hold 1 GB of them)
        records = [LayerRecord(attention_maps) for _ in self.blocks] if diagnostics else None
        # a fixed-shape step leaves each block's residual sum to the next block's norm (nothing reads x between)
        defer = (fixed or compact_fixed) and residual is None and mixer_out is None
        pending = None
        for i, block in enumerate(self.blocks):
            if residual is not None:
                x = residual(i, x)
            x = block(x, None if cache is None else cache.layers[i], None if records is None else records[i], positions,
                      None if mixer_out is None else functools.partial(mixer_out, i), pending, defer)
            if defer:
                x, pending = x
        if pending is not None:
            x = x + pending
        mass = None
        if self.config.prune:  # each layer's sparsity mass handed over and cleared: a module attribute would hold the
            # step's autograd graph until the next forward (an H200's CUDA-graph capture after an eager step failed
            # so, 2026-11-28: the graph kept the parameters' AccumulateGrad nodes, tied to the default stream)
            masses = [b.mixer.prune_mass for b in self.blocks]
            for b in self.blocks:
                b.mixer.prune_mass = None
            if self.training and cache is None and all(m is not None for m in masses):  # (not with the rule off)
                mass = sum(masses)
        if compact_fixed:
            cache.step_done()
        elif isinstance(cache, CompactDecodeCache) and cache.next_pos is not None:
            if valid is not None:
                raise ValueError("a fixed-shape compacted cache takes rows of one length (no padding)")
            cache.fix_shapes(cache.layers[0].q_pos[:, -1:] + 1)  # several tokens counted on the host: follow
        if isinstance(cache, DecodeCache) and cache.cursor is not None:
            if fixed:
                cache.step_done()  # the host's count is the caller's (a replayed graph runs no Python)
            else:
                cache.fix_shapes()    # a call of several tokens counted on the host: the cursor follows
        if (last_only or hidden_only) and targets is not None:
            raise ValueError("last_only and hidden_only give no logits for every position; a loss needs them all")
        if last_only:  # one position's logits: T x vocab floats (50 k vocabulary, 8 k tokens: 1.6 GB) never exist
            x = x[:, -1:]
        if hidden_only:  # [B,T,vocab] logits never exist whole (16 windows of 8 k tokens: 26 GB in float32)
            return ModelOutput(logits=None, cache=cache, diagnostics=records, hidden=self.ln_f(x))
        logits = self.ln_f(x) @ self.output_weight().t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return ModelOutput(logits=logits, loss=loss, cache=cache, diagnostics=records, prune_mass=mass)

    def output_weight(self) -> torch.Tensor:
        """The LM head [vocab, d_model]: the token embedding when they are tied."""
        return self.wte.weight if self.lm_head is None else self.lm_head

    def set_alpha(self, alpha: float) -> None:
        """The alpha of every layer's alpha-sigmoid (training; inference always uses the step)."""
        for b in self.blocks:
            if getattr(b.mixer, "pruning", None) is not None:
                b.mixer.pruning.alpha = alpha

    def cache_bytes_per_token(self) -> int:
        """Decode-state bytes each new position adds, summed over layers."""
        return sum(b.mixer.cache_bytes_per_token(self.wte.weight.dtype)[0] for b in self.blocks)
