"""Inference over the compacted cache (models.pruning.compact_cache.CompactCache, context pruning's inference
data structure): the new tokens take free slots, then either the learned rule (context pruning's step, through the
fused decode kernel on a decode step) or a heuristic eviction policy (models.pruning.policies) decides what each
row lets go, and the cache compacts when worth it. Under a policy a learned rule is off (the cache keeps no K_int).
"""
from __future__ import annotations

import torch

import kernels
from models.backends import additive, group_rows
from models.pruning import eviction
from models.pruning.patterns import pattern_allows


def rule_constants(mixer, cache) -> dict:
    """What the decode kernels read of the learned rule (beta, lambda, sinks, [W^Qint | W^Kint]): the cache's,
    read when DecoderLM.new_compact_cache built it (computed here for a cache built by hand); nothing is written
    to the (shared) model during inference."""
    if cache.rule_constants is None:
        cache.rule_constants = mixer.pruning.decode_constants()
    return cache.rule_constants


class _GroupRows:
    """The mixer as one KV group's rows see it: attention with that group's query heads over its own slots, W_O
    left for by_group to apply once every head is back in its place."""

    def __init__(self, mixer):
        self._mixer = mixer

    def __getattr__(self, name):
        return getattr(self._mixer, name)

    def head_maps(self):
        return {}

    def output(self, o):
        return o

    def attend(self, q, k, v, bias, record, keep=None, causal=True, lengths=None, merge_counts=None):
        return kernels.attention(q, k, v, scale=self._mixer.scale, bias=bias, causal=causal, lengths=lengths,
                                 merge_counts=merge_counts)[0]


def attend(mixer, cache, x, q, k, v, record, rope=None):
    """rope: the angle tables and positions of q and k, not rotated yet (a fixed-shape step:
    FixedCompactCache.rotates)."""
    if cache.groups > 1:
        return by_group(mixer, cache, x, q, k, v, record)
    return attend_rows(mixer, cache, x, q, k, v, record, rope)


def by_group(mixer, cache, x, q, k, v, record):
    """A per-KV-group policy (H2O's and SnapKV's own form): the cache's rows are (batch row, group) pairs, so head
    i's query joins the row of group i // (H/G) and every path below runs unchanged on rows."""
    if record is not None:
        raise ValueError("per-group eviction keeps no diagnostics while decoding: the Pruning page replays it")
    g = cache.groups
    q_pos, valid = cache.q_pos, cache.valid
    cache.q_pos = q_pos.repeat_interleave(g, 0)
    cache.valid = None if valid is None else valid.repeat_interleave(g, 0)
    try:
        o = attend_rows(_GroupRows(mixer), cache, x.repeat_interleave(g, 0), *group_rows(mixer, q, k, v), None)
    finally:
        cache.q_pos, cache.valid = q_pos, valid
    return mixer.output(o.reshape(q.shape))


def attend_rows(mixer, cache, x, q, k, v, record, rope=None):
    """Insert the new tokens, let them drop what they drop (applied to their own attention too), attend over
    the live slots, compact."""
    if mixer.training:
        raise RuntimeError("the compacted cache is for inference (model.eval())")
    q_pos, valid = cache.q_pos, cache.valid                                   # [B,T]; valid None: all real
    if cache.decode_step(q, record):
        return decode(mixer, cache, x, q, k, v, rope)
    if rope is not None:
        raise ValueError("only a fixed-shape decode step takes q and k unrotated")
    if cache.policy is not None and not cache.policy.at_prompt_end:
        if q.shape[2] == 1:  # one token per row, but some rows are padding (or diagnostics were asked for)
            raise ValueError(f"{cache.policy.method}: a decode step with padding rows or diagnostics is not supported "
                             "under an eviction policy; decode rows of one length, without diagnostics")
        raise ValueError(f"{cache.policy.method} evicts as each token arrives: feed the prompt one token per call "
                         "(models.generate.stream does)")
    rule = mixer.pruning if cache.policy is None else None
    valid = torch.ones_like(q_pos, dtype=torch.bool) if valid is None else valid
    cache.insert(mixer.cache_entries(x, k, v, None if rule is not None else False), q_pos, valid)
    past = cache.view()
    slot_pos, live = cache.pos[:, :cache.end], cache.live[:, :cache.end]     # [B,S]
    kk = past["k"]
    vv = kk if mixer.kv_shared else past["v"]
    if rule is not None and q.shape[2] == 1 and record is None:  # a decode step with padding rows
        c = rule_constants(mixer, cache)
        prune = {"q_int": rule.q_int(x[:, 0]), "k_int": past["k_int"], "beta": c["beta"], "live": live,
                 "pos": slot_pos, "q_pos": q_pos[:, 0], "valid": valid[:, 0], "lam": c["lam"], "sinks": c["sinks"]}
        o, keep = kernels.compact_decode(q, kk, vv, scale=mixer.scale, prune=prune, **mixer.head_maps())
        cache.update_live(keep, q_pos[:, :1].expand_as(keep))
        return mixer.output(o)
    allowed = live[:, None, :] & (slot_pos[:, None, :] <= q_pos[:, :, None])  # [B,T,S]
    if mixer.pattern != "dense":  # the local / strided baselines, by position (slots are not in order)
        allowed = allowed & pattern_allows(q_pos[:, :, None], slot_pos[:, None, :], mixer.pattern, mixer.pattern_k)
    if rule is not None:
        kept = rule.survival(x, past["k_int"], slot_pos, q_pos, valid)
        allowed = allowed & kept
        last = (valid.long() * torch.arange(valid.shape[1], device=x.device)).argmax(1)  # last valid row
        rows = torch.arange(x.shape[0], device=x.device)
        dropped = ~kept                                                      # from its first drop on
        trigger = torch.where(dropped.any(1), torch.gather(q_pos, 1, dropped.long().argmax(1)), -1)
        cache.update_live(kept[rows, last], trigger)
    allowed = torch.where(valid[:, :, None], allowed, (slot_pos >= 0)[:, None, :])  # padding rows: no NaN
    out = mixer.attend(q, kk, vv, additive(allowed, q.dtype)[:, None], record, causal=False)
    if eviction.compresses(cache.policy, q.shape[2]):
        if cache.valid is not None:
            raise ValueError(f"{cache.policy.method} compresses a prompt of real tokens only (no padding rows)")
        compress_prompt(mixer, cache, q, kk, vv, q_pos)
    if record is not None:
        record.slot_pos = slot_pos
    return out


def decode(mixer, cache, x, q, k, v, rope=None):
    """One new token per row, every row real: the fast path (no host synchronisation, no sort). The cache writes
    the token and says what the step reads (CompactCache.write_token: slot `end` and the slots before it; a
    fixed-shape cache's cursor and its whole buffers, each row's read length with them); with pruning, one fused
    pass scores it against the live slots, attends over what survives and says what survives; the compaction
    question is asked every few steps. rope (fixed shapes only): q and k come unrotated, and are rotated as K is
    written (kernels.step_write)."""
    q_pos = cache.q_pos
    rule = mixer.pruning if cache.policy is None else None
    if rule is not None:
        c = rule_constants(mixer, cache)
        qk = kernels.rule_product(x, c["qk"])  # the rule scores in float32 at least (kernels.keep_rule.HALF)
        q_int, k_int = qk[..., :rule.r], qk[..., rule.r:]
    else:
        q_int, k_int = None, False
    q, (past, live, pos, trig, lengths, counts) = cache.write_token(q, mixer.cache_entries(x, k, v, k_int), rope)
    kk = past["k"]
    vv = kk if mixer.kv_shared else past["v"]
    if cache.policy is not None:
        return policy_decode(mixer, cache, q, kk, vv, q_pos)
    if mixer.pruning is None:  # a dense or fixed-pattern model on the compacted cache
        allowed = live
        if mixer.pattern != "dense":
            allowed = allowed & pattern_allows(q_pos, pos, mixer.pattern, mixer.pattern_k)
        cache.count_seen(allowed)
        return mixer.attend(q, kk, vv, additive(allowed, q.dtype)[:, None, None], None, causal=False, lengths=lengths,
                            merge_counts=counts)
    # with the cache's drop notes: the kernel writes keep over `live` and notes what this query dropped in place
    # (CompactCache.update_kept's work, without its four kernels a layer)
    prune = {"q_int": q_int[:, 0], "k_int": past["k_int"], "beta": c["beta"], "live": live,
             "pos": pos, "q_pos": q_pos[:, 0], "valid": None, "lam": c["lam"], "sinks": c["sinks"], "trig": trig}
    o, keep = kernels.compact_decode(q, kk, vv, scale=mixer.scale, prune=prune, lengths=lengths, merge_counts=counts,
                                     **mixer.head_maps())
    cache.count_seen(keep)
    cache.kept_in_place(every=cache.check_every)
    return mixer.output(o)


def policy_decode(mixer, cache, q, kk, vv, q_pos):
    """A decode step under a heuristic eviction policy: models.pruning.eviction.step says under which mask the
    query attends and what each row keeps; here the query attends over the cache's slots (with its weights when
    the policy reads them) and the cache notes the drops."""
    out = []

    def attend(mask, weights):
        cache.count_seen(mask)
        bias = additive(mask, q.dtype)[:, None, None]
        if not weights:
            out.append(mixer.attend(q, kk, vv, bias, None, causal=False))
            return None
        o, probs = kernels.attention(q, kk, vv, scale=mixer.scale, bias=bias, need_weights=True, causal=False,
                                     **mixer.head_maps())
        out.append(mixer.output(o))
        return probs[:, :, 0].float()

    live, pos = cache.live[:, :cache.end], cache.pos[:, :cache.end]
    keep = eviction.step(cache.policy, live, pos, q_pos[:, 0], attend, cache.slot_state)
    cache.update_kept(keep, q_pos, every=cache.check_every)
    return out[0]


def compress_prompt(mixer, cache, q, kk, vv, q_pos):
    """After a prompt (all rows real), a prompt-mode policy compresses it once (models.pruning.eviction.compress);
    here a block of prompt queries attends over the cache's slots when the policy reads their attention, and the
    cache notes the drops."""
    def probs(a, b, allowed):  # [B,H,b-a,S] (MHE: H heads from one q)
        return kernels.attention(q[:, :, a:b], kk, vv, scale=mixer.scale, bias=additive(allowed, q.dtype)[:, None],
                                 need_weights=True, causal=False, **mixer.head_maps())[1]

    keep, by = eviction.compress(cache.policy, cache.live[:, :cache.end], cache.pos[:, :cache.end], q_pos, probs)
    cache.update_live(keep, by.expand_as(keep))
