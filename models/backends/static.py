"""Decoding over the static cache (models.cache.LayerCache, preallocated): append the new positions and attend
over everything so far; with context pruning, the new queries drop what they drop (the step rule), for their own
attention too, and the cache remembers it in `alive` (nothing is freed: that is the compacted cache's job)."""
from __future__ import annotations

import torch

import kernels
from models.backends import additive
from models.backends.full import pattern_bias


def attend(mixer, cache, x, q, k, v, record, rope=None):
    if cache.fixed_step(q, record):
        return attend_fixed(mixer, cache, x, q, k, v, rope)
    if rope is not None:
        raise ValueError("only a static-shape step takes q and k unrotated")
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


def attend_fixed(mixer, cache, x, q, k, v, rope=None):
    """One token per row with every shape fixed (models.cache.DecodeCache.fix_shapes): write at the device-side
    cursor, attend over the whole buffers with each row reading its first cursor + 1 slots (the decode kernel
    skips the rest). Every write (K, V, the rule's K_int) is one op (kernels.step_write); rope: the angle tables
    and the position when q and k are not rotated yet, which it rotates too. With pruning, the step rule runs
    over every slot and the slots after the query keep their alive bit. Only dense patterns (a local / strided
    window is placed by the host's length)."""
    if mixer.pattern != "dense":
        raise ValueError(f"static-shape decode serves dense attention, not the {mixer.pattern} pattern")
    q = kernels.step_write(q, mixer.cache_entries(x, k, v), cache.buffers, cache.cursor, rope)
    past = cache.buffers
    kk = past["k"]
    vv = kk if mixer.kv_shared else past["v"]
    lengths = cache.filled.expand(q.shape[0])
    if mixer.pruning is None:
        return mixer.attend(q, kk, vv, None, None, causal=False, lengths=lengths, merge_counts=cache.merge_counts)
    j = torch.arange(cache.capacity, device=q.device)
    kept = cache.alive[:, None, :] & mixer.pruning.survival(x, past["k_int"], j, cache.cursor)   # [B,1,S]
    cache.alive.copy_(torch.where(j <= cache.cursor, kept[:, 0], cache.alive))
    return mixer.attend(q, kk, vv, additive(kept, q.dtype)[:, None], None, causal=False, lengths=lengths,
                        merge_counts=cache.merge_counts)
