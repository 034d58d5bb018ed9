"""An eviction policy over a whole text in one forward: the decisions decoding token by token would make.

Token by token (models.evaluate.score_token_by_token) a 30-layer model reads 1,000 tokens in 1,000 forwards. But
layer l's inputs at every position depend only on layers < l, so each layer can take all its queries and keys at
once: the policy then steps through the positions over that layer's raw scores (its softmax over what is held,
renormalised per step), which gives every query's visible set, and the layer attends once under that mask. The
decisions are models.pruning.eviction's, the engine the decode step runs too; the slots are the positions, in
order, as the compacted cache keeps them (appends at the end, stable compaction), so ties break alike;
tests/test_replay.py checks the two against each other.

A model with learned context pruning runs here with its rule off: its own weights, nothing dropped unless the
policy evicts it (policy None: nothing at all), which puts the learned rule and the heuristics on one model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from models import memory
from models.backends import LayerState, State, attend_by_group
from models.pruning import eviction
from models.pruning.eviction import rows_of
from models.scoring import target_logprobs
from models.transformer import evaluating



class LayerReplay(LayerState):
    """Stands in for one layer's decode cache in DecoderLM.forward; the attention mixer calls attend()."""

    def __init__(self, policy, prompt: int | None):
        self.policy, self.prompt = policy, prompt
        self.visible: torch.Tensor | None = None     # [R,T,T] bool: in row r (a KV group, or the layer) query n saw j
        self.dropped_at: torch.Tensor | None = None  # [R,T] long: the step that evicted j (-1: held to the end)

    def attend(self, mixer, x, q, k, v, record):
        """The attention backend of a replay: the policy steps through the positions over this layer's raw
        scores (per KV group or for the whole layer), then every query attends once over what it left. Learned
        pruning is off here."""
        if q.shape[0] != 1:
            raise ValueError("an eviction replay reads one text at a time (batch 1)")
        rows = rows_of(self.policy, mixer)
        scores = None
        if self.policy is not None and self.policy.uses_attention:
            scores = kernels.reference.attention_scores(q, k, scale=mixer.scale, **mixer.head_maps())[0]
            scores = scores.reshape(rows, -1, *scores.shape[1:])                        # [R,h,T,T]
        self.visible, self.dropped_at = evict(self.policy, q.shape[2], scores, self.prompt, q.device)
        return attend_by_group(mixer, q, k, v, self.visible[None], record)


class Replay(State):
    """The `cache` argument of DecoderLM.forward that runs `policy` in every layer over the whole text."""

    def __init__(self, policy, n_layers: int, prompt: int | None = None):
        if policy is not None and policy.at_prompt_end and prompt is None:
            raise ValueError(f"{policy.method} compresses a prompt once: give its length")
        self.layers = [LayerReplay(policy, prompt) for _ in range(n_layers)]


def _probs(row: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """row [R,h,S] raw scores, held [R,S] bool -> softmax over the held keys [R,h,S] (0 elsewhere), taken in the
    model's dtype and handed to the policy in float32, as the decode step does."""
    return row.masked_fill(~held[:, None], float("-inf")).softmax(-1).float()


def _block(scores: torch.Tensor):
    """scores [R,h,T,T] -> eviction.received's probs(a, b, allowed): queries a..b-1's softmax over the keys of
    allowed [R,b-a,S] (the positions 0..S-1), in the model's dtype."""
    return lambda a, b, allowed: scores[:, :, a:b, :allowed.shape[-1]].masked_fill(~allowed[:, None],
                                                                                   float("-inf")).softmax(-1)


def hindsight(scores: torch.Tensor) -> torch.Tensor:
    """scores [R,h,T,T] -> later [R,h,T,T]: later[..., n, j] = the attention queries after n pay key j in the
    full causal model, summed over those queries (what an oracle at step n reads)."""
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(torch.promote_types(scores.dtype, torch.float32))
    return p.flip(-2).cumsum(-2).flip(-2) - p


def evict(policy, t: int, scores: torch.Tensor | None, prompt: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [R,T,T] bool, dropped_at [R,T] long) of one layer, R rows (its KV groups under a per-group
    policy, else one): the positions are the slots, and models.pruning.eviction decides, as in decoding. An
    oracle reads the full model's later attention instead (hindsight)."""
    rows = 1 if scores is None else scores.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    dropped_at = torch.full((rows, t), -1, dtype=torch.long, device=device)
    if policy is None:
        return causal[None], dropped_at
    pos = torch.arange(t, device=device)[None].expand(rows, t)
    if policy.at_prompt_end:
        return _compressed(policy, min(prompt, t), scores, pos, causal[None].repeat(rows, 1, 1), dropped_at)
    return _stepped(policy, scores, pos, dropped_at)


def _compressed(policy, p: int, scores, pos, visible, dropped_at):
    """Prompt mode: every query sees its whole past within the prompt; the prompt's p tokens are compressed once
    (eviction.compress), and every later query sees what was kept and every token after the prompt."""
    if not eviction.compresses(policy, p):
        return visible, dropped_at
    later = None
    if policy.hindsight:  # what the queries after the prompt pay each prompt token in the full model (all keys held)
        full = torch.ones_like(pos, dtype=torch.bool)
        queries = eviction.prompt_queries(policy, p, pos.shape[1])
        later = eviction.received(full, pos, pos, queries, _block(scores))[..., :p]
    held = torch.ones_like(pos[:, :p], dtype=torch.bool)
    keep, by = eviction.compress(policy, held, pos[:, :p], pos[:, :p], _block(scores), later)
    visible[:, p:, :p] &= keep[:, None, :]
    dropped_at[:, :p] = eviction.drops(dropped_at[:, :p], held, keep, by)
    return visible, dropped_at


def _stepped(policy, scores, pos, dropped_at):
    """Step mode: position n joins the held slots, then eviction.step decides, its query attending over the row
    of scores n (or, for an oracle, reading the later attention)."""
    rows, t = pos.shape
    later = hindsight(scores) if policy.hindsight else None
    visible = torch.zeros(rows, t, t, dtype=torch.bool, device=pos.device)
    live = torch.zeros(rows, t, dtype=torch.bool, device=pos.device)
    state = policy.state(rows, t, pos.device)
    for n in range(t):
        live[:, n] = True
        held, here = live[:, :n + 1], pos[:, :n + 1]

        def attend(mask, weights, n=n):
            visible[:, n, :n + 1] = mask
            if weights:
                return later[:, :, n, :n + 1].float() if later is not None else _probs(scores[:, :, n, :n + 1], mask)
            return None

        keep = eviction.step(policy, held, here, pos[:, n], attend, state)
        dropped_at[:, :n + 1] = eviction.drops(dropped_at[:, :n + 1], held, keep, n)
        live[:, :n + 1] = keep
    return visible, dropped_at


@dataclass
class MethodRun:
    """What a method (nothing, or a policy) did to one text: per layer and row (KV group under a per-group policy,
    else the layer) the visible masks [L,R,T,T] (bool), the step that dropped each token [L,R,T] (-1: never; for
    a policy that evicts before attending the query at that step no longer sees it, for the others it still did),
    and the log-probabilities of ids[1:] [T-1]."""
    visible: torch.Tensor
    dropped_at: torch.Tensor
    logprobs: torch.Tensor


@torch.inference_mode()
def replay(model, ids: list[int], policy=None, prompt: int | None = None) -> MethodRun:
    """One forward over ids with `policy` in every attention layer (learned pruning off; None: nothing evicted)."""
    if not model.blocks[0].mixer.replays_policies:
        raise ValueError(f"eviction policies run on softmax attention, not {model.config.mixer}")
    if model.config.pattern != "dense":
        raise ValueError(f"this model attends by a fixed {model.config.pattern} pattern; an eviction policy needs a "
                         "dense softmax model")
    cfg, rows = model.config, rows_of(policy, model.blocks[0].mixer)
    copies = 3 if policy is not None and policy.hindsight else 1  # the oracle's softmax and suffix sums beside them
    most = memory.replay_tokens(cfg, rows, copies)
    if len(ids) > most:
        raise ValueError(f"{len(ids)} tokens: an eviction replay reads at most {most} (the model's context, the scores "
                         f"[{cfg.n_heads} heads, T, T] it holds per layer and the masks [{cfg.n_layers} layers, {rows} "
                         "rows, T, T] it keeps); take a window")

    x = torch.tensor([ids], device=model.wte.weight.device)
    cache = Replay(policy, model.config.n_layers, prompt)
    with evaluating(model):
        logits = model(x, cache=cache).logits
    lp = target_logprobs(logits[0, :-1], x[0, 1:])
    return MethodRun(torch.stack([c.visible for c in cache.layers]),
                     torch.stack([c.dropped_at for c in cache.layers]), lp)
