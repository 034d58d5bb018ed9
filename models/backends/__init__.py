"""Attention states: what an attention mixer's q, k, v attend over, and who decides what is masked or evicted.

DecoderLM.forward runs its blocks over one `State` (its `cache=` argument, or a `WholeSequence` when there is
none). The state says where the new tokens sit (`begin`), hands each block its layer (`layers[i]`), and does
what the call leaves behind (`end`); the model never asks which kind of state it holds. Each layer's `attend(mixer,
x, q, k, v, record)` is the backend: the mixer (models/mixers/attention.py) projects and rotates, the layer's state
does the rest.

full.py        WholeSequence: a whole sequence (training, scoring) under the causal mask, a fixed local /
               strided pattern, or context pruning's learned log I; it also collects the sparsity loss's terms
static.py      attend over models.cache.LayerCache: gpt-fast's preallocated decode cache, with the
               learned rule's step mask when the model prunes
compacted.py   attend over models.pruning.compact_cache.CompactCache: context pruning's compacted cache, where the
               learned rule or a heuristic eviction policy (models.pruning.policies) frees what it drops; a
               fixed-shape cache (models.pruning.fixed_compact) says where its step writes and what it reads
fixed.py       a fixed-shape step over the static cache's buffers (models.fixed_shape.FixedLayerCache): written at
               a device-side cursor, read up to it, so that a CUDA graph can replay it (models.graphs)
models.pruning.replay.Replay              an eviction policy over a whole text in one forward
models.pruning.intervene.Intervention     the learned rule with forced decisions over a whole text

The backends call back into the mixer for what belongs to the variant: `cache_entries` (what a position adds
to a cache), `attend` (softmax through the kernel dispatch, per-head maps, W_O), `pruning` (the learned rule's
projections), `pattern`, `kv_shared`, `scale`, `head_maps()`.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

import kernels
from models import packing

# prompt queries per block when a policy reads the whole prompt's attention (the compacted cache's prompt
# compression and the policy replay sum it in the same blocks, so they sum in the same order)
CHUNK = 256


def check_fits(n: int, context: int, what: str = "tokens") -> None:
    """The one context-length check: n positions must fit the context window (learned position tables and the
    decode caches end there), else a ValueError that says what to do."""
    if n > context:
        raise ValueError(f"{n} {what} exceed the context window of {context}; take a window")


class Step(NamedTuple):
    """What `State.begin` tells the forward: the new tokens' positions ([T] or [B,T], inside the position table),
    whether the call is a fixed-shape decode step (one token a row, every shape kept so that a CUDA graph can
    replay it), and which new tokens are real (None: all)."""
    positions: torch.Tensor
    fixed: bool = False
    valid: torch.Tensor | None = None


class LayerState:
    """What one block's state offers besides `attend`: the mixer's q/k/v projections, rotation and the feed-forward.
    Every state computes them plainly, except a fixed-shape decode state on a one-token step, whose layers hold
    packed weights (`packed`, set by models.packing.attach): q|k|v and SwiGLU's gate|up each as one product."""

    packed: dict | None = None

    def project(self, mixer, x: torch.Tensor, record):
        """q, k, v [B,H|G,T,D] of the layer-normed input x [B,T,d_m]."""
        packed = packing.step_weights(self, x, record).get("qkv")
        return mixer.from_parts(packing.project(x, *packed)) if packed else mixer.project(x)

    def feed_forward(self, ffn, h: torch.Tensor, record) -> torch.Tensor:
        packed = packing.step_weights(self, h, record).get("gate_up")
        return ffn.from_gate_up(*packing.gate_up(h, *packed)) if packed else ffn(h)

    def rotates(self, q: torch.Tensor, record) -> bool:
        """Whether this call hands q and k over unrotated, with their angle tables and positions as `rope`, for the
        state to rotate as it writes (a fixed-shape step: kernels.step_write)."""
        return False


class State:
    """The interface of every attention state DecoderLM.forward runs over. `layers[i]` is block i's state, whose
    `attend(mixer, x, q, k, v, record)` returns the mixer's output. This base serves a state over a whole text
    from position 0 (a replay, an intervention); the decode caches override `begin`, their fixed-shape forms
    (models.fixed_shape) `end` too."""

    layers: Sequence

    def begin(self, idx: torch.Tensor, context: int, positions: torch.Tensor | None = None,
              valid: torch.Tensor | None = None, plain: bool = True) -> Step:
        """Before the blocks, for new tokens idx [B,T]: their positions. positions / valid: a compacted cache's
        own per-row positions and real-token marks; plain: no diagnostics were asked for (a fixed-shape step
        records nothing)."""
        check_fits(idx.shape[1], context, "positions")
        return Step(torch.arange(idx.shape[1], device=idx.device))

    def end(self, step: Step) -> None:
        """After the blocks: what the call leaves to do (a fixed-shape state's cursors move on)."""

    def prune_mass(self) -> torch.Tensor | None:
        """Training with context pruning: sum over layers of sum_{j<k} I_{k,j} (the sparsity loss's numerator)
        for this forward; None when no such terms were made."""
        return None


def additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as an additive attention bias: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def group_rows(mixer, q, k, v):
    """q [B,H,T,D], k, v [B,G,S,D] -> q [B*G,H/G,T,D], k, v [B*G,1,S,D]: each (batch row, KV group) a row of its
    own holding that group's query heads (head i reads group i // (H/G)), for attention per group."""
    if mixer.head_maps():
        raise ValueError("per-group rows on a mixer with per-head query maps (MHE has one group)")
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    return q.reshape(b * g, h // g, t, d), k.reshape(b * g, 1, s, d), v.reshape(b * g, 1, s, d)


def attend_by_group(mixer, q, k, v, allowed: torch.Tensor, record=None) -> torch.Tensor:
    """The mixer's output when each KV group sees its own keys: q [B,H,T,D], k, v [B,G,S,D], allowed [B,R,T,S]
    bool with R = G (a mask per group, as per-group eviction leaves) or 1 (one mask for the layer). Per group, the
    batch's rows and the groups become the rows of one attention call, so every kernel path serves it."""
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    if allowed.shape[1] == 1:
        return mixer.attend(q, k, v, additive(allowed, q.dtype), record, causal=False)
    want = record is not None and record.attention_maps
    o, probs = kernels.attention(*group_rows(mixer, q, k, v), scale=mixer.scale,
                                 bias=additive(allowed.reshape(b * g, 1, t, s), q.dtype), need_weights=want,
                                 causal=False)
    if want:
        record.attn = probs.reshape(b, h, t, s)
    return mixer.output(o.reshape(b, h, t, d))
