"""The eviction engine: how a policy (models.pruning.policies) is driven over a cache, in one place for both of its
callers. Compacted decoding (models.backends.compacted) runs it over the cache's slots one query at a time;
a replay (models.pruning.replay) runs it over one layer's raw scores with the positions as slots. Each caller
moves its own data (the attention kernel and the cache's slots, or a slice of a [R,h,T,T] score tensor) and hands
the engine a callback that attends; the engine says under which mask, when, and what the policy keeps.

Rows and slots are as policies.py has them: live [R,S] bool, pos [R,S] (-1: unused), q_pos the queries'
positions. The rules:

  step    (step mode, one query at position q arriving with its slot already live) A policy that reads no
          attention decides first, keep = step(live, pos, q), and the query attends over keep; one that reads it
          attends over everything live, p = softmax over the live slots [R,h,S], then keep = step(live, pos, q, p).
          A hindsight policy reads instead what the later queries pay in the full model (the caller's p).
          A prompt-mode policy keeps every token after its prompt: keep = live.
  prompt  (prompt mode, once, after a prompt of n > 1 real tokens read with nothing evicted) The policy reads
          received[r,h,j] = sum over its prompt queries m of softmax_j(scores[m] over the live slots at positions
          <= m), summed in blocks of CHUNK queries, in float32; then keep = compress(live, pos, n, received).
  drops   A slot is noted with the position of the query whose step took it out of the held set: the query
          itself in step mode, the last prompt query in prompt mode (it attended over the whole prompt, then the
          cache shrank). CompactCache.update_kept / update_live write these notes into `trig`.
"""
from __future__ import annotations

import torch

from models.backends import CHUNK


def rows_of(policy, mixer) -> int:
    """How many rows of slots a layer holds under this policy: one per KV group for a per-group policy (the
    group's heads decide together), else one (the layer decides for all its groups)."""
    return mixer.n_groups if policy is not None and policy.per_group else 1


def step(policy, live, pos, q_pos, attend, state=None) -> torch.Tensor:
    """One query's step: what each row keeps [R,S] after it (the query's own slot included).

    live, pos [R,S]: the row's slots, the query's own live already; q_pos [R]: the query's position; state: the
    policy's per-slot state (Policy.state), updated in place. attend(mask, weights): the caller's query attends over
    the slots of mask [R,S]; with weights it returns its attention probabilities [R,h,S] in float32 (each head
    summing to 1 over mask), else None. It is called exactly once, with the mask the query attends under."""
    if policy.at_prompt_end:
        attend(live, False)
        return live
    if not policy.uses_attention:                 # decides by position before the query attends
        keep = policy.step(live, pos, q_pos)
        attend(keep, False)
        return keep
    probs = attend(live, True)                    # attends over all it holds, then decides from that attention
    return policy.step(live, pos, q_pos, probs, state)


def compresses(policy, n: int) -> bool:
    """Whether a call of n new tokens is a prompt this policy compresses: a prompt-mode policy, more than one
    token (a one-token prompt is decoded, and a decode step keeps everything)."""
    return policy is not None and policy.at_prompt_end and n > 1


def prompt_queries(policy, n: int, t: int | None = None) -> range:
    """The queries (indices into the text) whose attention a prompt-mode policy reads after an n-token prompt:
    none for a policy that reads no attention; the last `window` prompt queries (all of them for window None);
    for a hindsight policy the queries after the prompt, n..t-1, in the full model (a replay's only)."""
    if not policy.uses_attention:
        return range(0)
    if policy.hindsight:
        return range(n, t)
    return range(0 if policy.window is None else max(0, n - policy.window), n)


def causal(live, pos, q_pos) -> torch.Tensor:
    """live, pos [R,S], q_pos [R,c] -> [R,c,S] bool: query i may read slot j when j is live and not later."""
    return live[:, None, :] & (pos[:, None, :] <= q_pos[:, :, None])


def received(live, pos, q_pos, queries: range, probs) -> torch.Tensor:
    """The attention the queries pay each slot, summed over those queries per row and head: [R,h,S] float32.

    q_pos [R,T]: the positions of the queries `queries` indexes; probs(a, b, allowed): the caller's attention
    probabilities [R,h,b-a,S] of queries a..b-1 under allowed [R,b-a,S] (causal over the live slots). Blocks of
    CHUNK queries bound the memory; with no queries, the one empty block gives zeros."""
    first, last = queries.start, queries.stop
    blocks = [(a, min(a + CHUNK, last)) for a in range(first, last, CHUNK)] or [(first, first)]
    got = None
    for a, b in blocks:
        part = probs(a, b, causal(live, pos, q_pos[:, a:b])).float().sum(2)
        got = part if got is None else got + part
    return got


def compress(policy, live, pos, q_pos, probs=None, later=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt-mode policy's one compression after a prompt of real tokens: (keep [R,S], by [R,1]), what each row
    keeps and the position noted as dropping what went (the last prompt query).

    live, pos [R,S]: the slots holding the prompt; q_pos [R,n]: the prompt queries' positions (the prompt is
    q_pos[:, -1] + 1 tokens); probs: as in received, for a policy that reads attention; later: for a hindsight
    policy, what its prompt_queries pay each prompt slot in the full model [R,h,S] (only a replay has it)."""
    got = None
    if policy.hindsight:
        got = later
    elif policy.uses_attention:
        got = received(live, pos, q_pos, prompt_queries(policy, q_pos.shape[1]), probs)
    return policy.compress(live, pos, q_pos[:, -1] + 1, got), q_pos[:, -1:]


def drops(notes, held, keep, by) -> torch.Tensor:
    """notes [R,S] (the dropping position per slot, -1: held so far) after a step that took held [R,S] to keep:
    every slot that went is noted with `by` (an int, or a tensor that broadcasts: the dropping query's position)."""
    return torch.where(held & ~keep, by, notes)
