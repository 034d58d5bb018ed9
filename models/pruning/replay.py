"""An eviction policy over a whole text in one forward: the decisions decoding token by token would make.

Token by token (models.evaluate.score_token_by_token) a 30-layer model reads 1,000 tokens in 1,000 forwards. But
layer l's inputs at every position depend only on layers < l, so each layer can take all its queries and keys at
once: the policy then steps through the positions over that layer's raw scores (its softmax over what is held,
renormalised per step), which gives every query's visible set, and the layer attends once under that mask. The
slots are the positions, in order, as the compacted cache keeps them (appends at the end, stable compaction), so
ties break alike; tests/test_replay.py checks the two against each other.

A model with learned context pruning runs here with its rule off: its own weights, nothing dropped unless the
policy evicts it (policy None: nothing at all), which puts the learned rule and the heuristics on one model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import kernels
from models.backends import CHUNK, LayerState, State, attend_by_group
from models.scoring import target_logprobs
from models.transformer import evaluating

MAX_TOKENS = 4096         # the model's context or this, whichever is smaller
SCORES_BYTES = 2 ** 30    # one layer's scores [heads, T, T] in float32 at most (9 heads x 4,096^2 = 600 MB)
VISIBLE_BYTES = 2 ** 30   # the visible masks kept [layers, rows, T, T] (30 layers x 3 groups x 3,000^2 = 810 MB)


def rows_of(policy, mixer) -> int:
    """How many masks a layer holds under this policy: one per KV group for a per-group policy, else one."""
    return mixer.n_groups if policy is not None and policy.per_group else 1


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


def received(scores: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """scores [R,h,T,T] -> the causal attention queries first..last-1 pay keys 0..last-1, summed over those
    queries [R,h,last] (float32; zeros when there are none), in blocks of CHUNK queries as
    models.backends.compacted sums them."""
    out = torch.zeros(*scores.shape[:2], last, dtype=torch.float32, device=scores.device)
    causal = torch.ones(last, last, dtype=torch.bool, device=scores.device).tril()
    for a in range(first, last, CHUNK):
        b = min(a + CHUNK, last)
        out += scores[:, :, a:b, :last].masked_fill(~causal[a:b], float("-inf")).softmax(-1).float().sum(2)
    return out


def hindsight(scores: torch.Tensor) -> torch.Tensor:
    """scores [R,h,T,T] -> later [R,h,T,T]: later[..., n, j] = the attention queries after n pay key j in the
    full causal model, summed over those queries (what an oracle at step n reads)."""
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1).to(torch.promote_types(scores.dtype, torch.float32))
    return p.flip(-2).cumsum(-2).flip(-2) - p


def evict(policy, t: int, scores: torch.Tensor | None, prompt: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [R,T,T] bool, dropped_at [R,T] long) of one layer, R rows (its KV groups under a per-group
    policy, else one). Step mode decides at each position as the decode step does (before the query attends or
    after, from the query's attention over what its row holds); prompt mode keeps everything within the prompt,
    compresses it once from the prompt queries' causal attention, and keeps every later token. An oracle reads
    the full model's later attention instead (hindsight)."""
    rows = 1 if scores is None else scores.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    dropped_at = torch.full((rows, t), -1, dtype=torch.long, device=device)
    if policy is None:
        return causal[None], dropped_at
    pos = torch.arange(t, device=device)[None].expand(rows, t)
    if policy.at_prompt_end:
        p = min(prompt, t)
        visible = causal[None].repeat(rows, 1, 1)
        if p < 2:  # a one-token prompt is decoded, not compressed (as the model does)
            return visible, dropped_at
        got = None
        if policy.hindsight:
            got = received(scores, p, t)[..., :p]         # every query from p on, in the full model
        elif policy.uses_attention:
            w = p if policy.window is None else min(policy.window, p)
            got = received(scores, p - w, p)
        live = torch.ones(rows, p, dtype=torch.bool, device=device)
        keep = policy.compress(live, pos[:, :p], torch.full((rows,), p, device=device), got)
        visible[:, p:, :p] &= keep[:, None, :]
        dropped_at[:, :p][~keep] = p - 1  # the last prompt query attended to everything, then the cache shrank
        return visible, dropped_at
    later = hindsight(scores) if policy.hindsight else None
    visible = torch.zeros(rows, t, t, dtype=torch.bool, device=device)
    live = torch.zeros(rows, t, dtype=torch.bool, device=device)
    state = policy.state(rows, t, device)
    for n in range(t):
        live[:, n] = True
        held, here, q = live[:, :n + 1], pos[:, :n + 1], pos[:, n]
        if policy.uses_attention:
            visible[:, n, :n + 1] = held
            probs = later[:, :, n, :n + 1].float() if later is not None else _probs(scores[:, :, n, :n + 1], held)
            keep = policy.step(held, here, q, probs, state)
        else:
            keep = policy.step(held, here, q)
            visible[:, n, :n + 1] = keep
        gone = held & ~keep
        dropped_at[:, :n + 1] = torch.where(gone, n, dropped_at[:, :n + 1])
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


def most_tokens(cfg, rows: int, copies: int) -> int:
    """The longest text a replay reads: the model's context and MAX_TOKENS, one layer's scores [heads, T, T] `copies`
    times over within SCORES_BYTES, and the masks [layers, rows, T, T] within VISIBLE_BYTES (analysis.budgets plans
    with it too)."""
    return min(cfg.context, MAX_TOKENS, math.isqrt(SCORES_BYTES // (4 * cfg.n_heads * copies)),
               math.isqrt(VISIBLE_BYTES // (cfg.n_layers * rows)))


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
    most = most_tokens(cfg, rows, copies)
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
