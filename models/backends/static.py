"""Decoding over the static cache (models.cache.LayerCache, preallocated): append the new positions and attend
over everything so far; with context pruning, the new queries drop what they drop (the step rule), for their own
attention too, and the cache remembers it in `alive` (nothing is freed: that is the compacted cache's job). A
fixed-shape step over the same buffers is models.backends.fixed."""
from __future__ import annotations

from models.backends import additive
from models.backends.full import pattern_bias


def attend(mixer, cache, x, q, k, v, record):
    past = cache.append(**mixer.cache_entries(x, k, v))
    kk = past["k"]                                                 # [B,G,S,D]
    vv = kk if mixer.kv_shared else past["v"]
    if mixer.pruning is None:
        bias, keep = pattern_bias(mixer, q.shape[0], q.shape[2], kk.shape[2], q.dtype, q.device)
        return mixer.attend(q, kk, vv, bias, record, keep)
    s = cache.length
    allowed = mixer.pruning.step_keep(x, past["k_int"], cache.alive[:, :s])  # [B,T,S]
    cache.alive[:, :s] = allowed[:, -1]
    return mixer.attend(q, kk, vv, additive(allowed, q.dtype)[:, None], record, allowed.to(q.dtype))
