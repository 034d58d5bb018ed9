"""Attention backends: what an attention mixer's q, k, v attend over, and who decides what is masked or evicted.

The mixer (models/mixers/attention.py) projects and rotates; then the state it was handed does the rest through
its `attend(mixer, x, q, k, v, record)`:

full.py        FULL, no state: a whole sequence (training, scoring) under the causal mask, a fixed local /
               strided pattern, or context pruning's learned log I
static.py      attend over models.cache.LayerCache: gpt-fast's preallocated decode cache, with the
               learned rule's step mask when the model prunes
compacted.py   attend over models.pruning.CompactCache: context pruning's compacted cache, where the
               learned rule or a heuristic eviction policy (models.pruning.policies) frees what it drops
models.pruning.replay.LayerReplay   an eviction policy over a whole text in one forward

The backends call back into the mixer for what belongs to the variant: `cache_entries` (what a position adds
to a cache), `attend` (softmax through the kernel dispatch, per-head maps, W_O), `pruning` (the learned rule's
projections), `pattern`, `kv_shared`, `scale`, `head_maps()`.
"""
from __future__ import annotations

import torch

import kernels


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
