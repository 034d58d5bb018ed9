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


def additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask as an additive attention bias: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
