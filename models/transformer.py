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
from models import fixed_blocks
from models.adapters import Adapter, new_A
from models.backends import State, Step, check_fits
from models.backends.full import FULL, WholeSequence
from models.cache import DecodeCache
from models.config import ModelConfig
from models.fixed_shape import FixedDecodeCache
from models.mixers import LayerRecord, build_mixer
from models.pruning import eviction, policies
from models.pruning.compact_cache import CompactCache, CompactDecodeCache
from models.pruning.fixed_compact import FixedCompactCache, FixedCompactDecodeCache


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

    def forward(self, x):
        if self.kind == "swiglu":
            return self.from_gate_up(self.gate(x), self.up(x))
        h = F.gelu(self.up(x), approximate="tanh" if self.kind == "gelu_tanh" else "none")
        return self.drop(self.down(h))

    def from_gate_up(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """SwiGLU's rest from its gate and up products (a fixed-shape step makes both in one: models.packing)."""
        return self.drop(self.down(kernels.silu_mul(g, u)))  # one kernel on a GPU at inference


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

    def forward(self, x, cache=None, record=None, positions=None, mixer_out=None):
        """mixer_out: a function h -> h given the token mixer's output [B,T,d_m] (before any adapter and the residual
        sum), whose return goes on instead (DecoderLM.forward's mixer_out, for one block)."""
        x, h = self.sublayers(x, self.ln_1(x), cache, record, positions, mixer_out)
        return x + h

    def sublayers(self, x, a, cache=None, record=None, positions=None, mixer_out=None):
        """The block after ln_1: x the residual stream entering it, a = ln_1(x). Returns (x plus the mixer's output,
        the feed-forward's output), the last residual sum left to the caller (models.fixed_blocks hands it to the
        next block's norm)."""
        state = FULL if cache is None else cache
        h = self.mixer(a, state, record, positions)
        if mixer_out is not None:
            h = mixer_out(h)
        if self.adapter_mixer is not None:
            h = self.adapter_mixer(h)
        x, h = self.ln_2(x, self.drop(h))  # x + h, and ln_2 of it
        h = state.feed_forward(self.ffn, h, record)
        if self.adapter_ffn is not None:
            h = self.adapter_ffn(h)
        return x, h


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
    cache: State | None = None          # the state passed in, as the call left it
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
        """n positions must fit the context window (models.backends.check_fits)."""
        check_fits(n, self.config.context, what)

    def new_cache(self, batch: int = 1, capacity: int | None = None, fixed: bool = False) -> DecodeCache:
        """The static decode cache (gpt-fast's, preallocated). fixed: its fixed-shape form, whose one-token steps
        keep their shapes once fix_shapes() has run (models.fixed_shape; models.graphs)."""
        capacity = self.config.context if capacity is None else min(capacity, self.config.context)
        p = self.wte.weight
        layers = [b.mixer.new_cache(batch, capacity, p.dtype, p.device) for b in self.blocks]
        return FixedDecodeCache(layers) if fixed else DecodeCache(layers)

    def new_compact_cache(self, batch: int = 1, capacity: int = 16, policy=None,
                          fixed: bool = False) -> CompactDecodeCache:
        """The compacted cache (context pruning's data structure; rows may have different lengths). Attention
        mixers only: an Extractor's state is a window of past inputs indexed by lag, which slots cannot hold.
        policy: a heuristic eviction policy (models.pruning.policies); on a model with learned pruning the policy
        decides instead of the rule (its own weights, the rule off, as models.pruning.replay runs it). fixed: the
        fixed-shape form (models.pruning.fixed_compact: compaction in place and no shrinking), whose one-token steps
        keep their shapes once fix_shapes() has run (models.graphs)."""
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
        g = eviction.rows_of(policy, self.blocks[0].mixer)
        layers, layer_class = [], FixedCompactCache if fixed else CompactCache
        for b in self.blocks:
            spec = b.mixer.cache_spec(policy is None)
            if g > 1:
                spec = {name: (1, *shape[1:]) for name, shape in spec.items()}
            layers.append(layer_class(spec, batch * g, capacity, p.dtype, p.device, policy,
                                      b.mixer.pruning.decode_constants() if learned else None, groups=g))
        return FixedCompactDecodeCache(layers) if fixed else CompactDecodeCache(layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: State | None = None,
                diagnostics: bool = False, positions: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                last_only: bool = False, attention_maps: bool = True, hidden_only: bool = False,
                residual=None, mixer_out=None) -> ModelOutput:
        """idx [B,T] token ids; embeds [B,T,d_m], when given, stands in for wte(idx) (attributions take gradients
        there without hooking the model, which app sessions share). cache: the attention state the blocks run over
        (models.backends.State: a decode cache, which idx's T new positions extend, a replay, an intervention;
        None: the whole sequence). positions [B,T] and valid [B,T]: a compacted cache's per-row positions and
        real-token marks (models.pruning.compact_cache.CompactDecodeCache.begin).
        last_only: logits [B,1,V] for the last position alone (generation, attributions). diagnostics: each layer's
        LayerRecord comes back in ModelOutput.diagnostics (attention_maps=False: without the attention
        probabilities). hidden_only: the final-norm states in ModelOutput.hidden and no logits (the caller applies
        output_weight a chunk of positions at a time: models.scoring.head_logprobs). residual: a function (i, x)
        -> x given the residual stream [B,T,d_m] entering block i, whose return enters it instead; mixer_out: a
        function (i, h) -> h given block i's token mixer output, whose return the block goes on with (activation
        patching reads and replaces them there: models.pruning.intervene; no hook is put on the model, which app
        sessions share)."""
        if (last_only or hidden_only) and targets is not None:
            raise ValueError("last_only and hidden_only give no logits for every position; a loss needs them all")
        state = WholeSequence(len(self.blocks), self.training and self.config.prune) if cache is None else cache
        step = state.begin(idx, self.config.context, positions, valid, plain=not diagnostics)
        x = self.wte(idx) if embeds is None else embeds
        if self.wpe is not None:
            x = x + self.wpe(step.positions)
        # attention_maps=False: the pruning keep masks alone, no [H,T,T] attention probabilities (the Pruning page
        # of a 30-layer model over 1,000 tokens would otherwise hold 1 GB of them)
        records = [LayerRecord(attention_maps) for _ in self.blocks] if diagnostics else None
        x = self._run_blocks(self.drop(x), state, step, records, residual, mixer_out)
        state.end(step)
        if last_only:  # one position's logits: T x vocab floats (50 k vocabulary, 8 k tokens: 1.6 GB) never exist
            x = x[:, -1:]
        if hidden_only:  # [B,T,vocab] logits never exist whole (16 windows of 8 k tokens: 26 GB in float32)
            return ModelOutput(logits=None, cache=cache, diagnostics=records, hidden=self.ln_f(x))
        logits = self.ln_f(x) @ self.output_weight().t()
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return ModelOutput(logits=logits, loss=loss, cache=cache, diagnostics=records, prune_mass=state.prune_mass())

    def _run_blocks(self, x, state: State, step: Step, records, residual, mixer_out) -> torch.Tensor:
        if step.fixed and residual is None and mixer_out is None:
            return fixed_blocks.run(self.blocks, x, state, step.positions)
        for i, block in enumerate(self.blocks):
            if residual is not None:
                x = residual(i, x)
            x = block(x, state.layers[i], None if records is None else records[i], step.positions,
                      None if mixer_out is None else functools.partial(mixer_out, i))
        return x

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
