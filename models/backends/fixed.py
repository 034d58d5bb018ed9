"""The fixed-shape attention step over the static cache's buffers (models.fixed_shape.FixedLayerCache, after
fix_shapes): every shape and address the same at each step, nothing asked of the host, so that a CUDA graph can
replay it (models.graphs). The compacted cache's fixed-shape step is models.backends.compacted.decode, over what
models.pruning.fixed_compact.FixedCompactCache.write_token hands it."""
from __future__ import annotations

import torch

import kernels
from models.backends import additive


def attend_static(mixer, cache, x, q, k, v, rope=None):
    """One token per row: write at the device-side cursor, attend over the whole buffers with each row reading
    its first cursor + 1 slots (the decode kernel skips the rest). Every write (K, V, the rule's K_int) is one op
    (kernels.step_write); rope: the angle tables and the position when q and k are not rotated yet, which it
    rotates too. With pruning, the step rule runs over every slot and the slots after the query keep their alive
    bit. Only dense patterns (a local / strided window is placed by the host's length)."""
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
