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
from models.backends import additive
from models.scoring import target_logprobs

MAX_TOKENS = 4096         # visible masks [layers, T, T] are kept: 30 layers x 4,096^2 bytes = 500 MB
SCORES_BYTES = 2 ** 30    # one layer's scores [heads, T, T] in float32 at most (9 heads x 4,096^2 = 600 MB)


class LayerReplay:
    """Stands in for one layer's decode cache in DecoderLM.forward; the attention mixer calls run()."""

    def __init__(self, policy, prompt: int | None):
        self.policy, self.prompt = policy, prompt
        self.visible: torch.Tensor | None = None     # [T,T] bool: query n attended over key j
        self.dropped_at: torch.Tensor | None = None  # [T] long: the step that evicted j (-1: held to the end)

    def attend(self, mixer, x, q, k, v, record):
        """The attention backend of a replay: the policy steps through the positions over this layer's raw
        scores, then every query attends once over what it left. Learned pruning is off here."""
        if q.shape[0] != 1:
            raise ValueError("an eviction replay reads one text at a time (batch 1)")
        scores = None
        if self.policy is not None and self.policy.uses_attention:
            scores = kernels.reference.attention_scores(q, k, scale=mixer.scale, **mixer.head_maps())[0]
        self.visible, self.dropped_at = evict(self.policy, q.shape[2], scores, self.prompt, q.device)
        return mixer.attend(q, k, v, additive(self.visible, q.dtype)[None, None], record,
                            self.visible.to(q.dtype)[None], causal=False)


class Replay:
    """The `cache` argument of DecoderLM.forward that runs `policy` in every layer over the whole text."""

    def __init__(self, policy, n_layers: int, prompt: int | None = None):
        if policy is not None and policy.at_prompt_end and prompt is None:
            raise ValueError(f"{policy.name} decides at the end of a prompt: give its length")
        self.layers = [LayerReplay(policy, prompt) for _ in range(n_layers)]
        self.length = 0  # the forward starts at position 0


def _probs(row: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """row [H,S] raw scores, held [S] bool -> softmax over the held keys [1,H,S] (0 elsewhere), taken in the
    model's dtype and handed to the policy in float32, as the decode step does."""
    return row.masked_fill(~held, float("-inf")).softmax(-1)[None].float()


def evict(policy, t: int, scores: torch.Tensor | None, prompt: int | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible [T,T] bool, dropped_at [T] long) of one layer. A step policy decides at each position as the
    decode step does (StreamingLLM before the query attends, TOVA and H2O after, from the query's attention over
    what is held); SnapKV keeps everything within the prompt, selects once from the last prompt queries'
    causal attention, and keeps every later token."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    dropped_at = torch.full((t,), -1, dtype=torch.long, device=device)
    if policy is None:
        return causal, dropped_at
    pos = torch.arange(t, device=device)
    if policy.at_prompt_end:
        p = min(prompt, t)
        w = min(policy.window, p)
        if p < 2:  # a one-token prompt is decoded, not selected from (as the model does)
            return causal, dropped_at
        window = scores[:, p - w:p, :p].masked_fill(~causal[p - w:p, :p], float("-inf")).softmax(-1)[None].float()
        live = torch.ones(1, p, dtype=torch.bool, device=device)
        keep = policy.select(live, pos[None, :p], torch.tensor([p], device=device), window)[0]
        visible = causal.clone()
        visible[p:, :p] &= keep
        dropped_at[:p][~keep] = p - 1  # the last prompt query attended to everything, then the cache shrank
        return visible, dropped_at
    visible = torch.zeros(t, t, dtype=torch.bool, device=device)
    live = torch.zeros(1, t, dtype=torch.bool, device=device)
    state = policy.state(1, t, device)
    for n in range(t):
        live[0, n] = True
        held, here, q = live[:, :n + 1], pos[None, :n + 1], pos[n:n + 1]
        if policy.uses_attention:
            visible[n, :n + 1] = held[0]
            keep = policy.step(held, here, q, _probs(scores[:, n, :n + 1], held[0]), state)
        else:
            keep = policy.step(held, here, q)
            visible[n, :n + 1] = keep[0]
        gone = held[0] & ~keep[0]
        dropped_at[:n + 1] = torch.where(gone, n, dropped_at[:n + 1])
        live[:, :n + 1] = keep
    return visible, dropped_at


@dataclass
class MethodRun:
    """What a method (the learned rule, nothing, or a policy) did to one text: per layer the visible masks [L,T,T] (bool), the step that dropped each
    token [L,T] (-1: never; for the learned rule and StreamingLLM the query at that step no longer sees it, for
    TOVA, H2O and SnapKV it still did), and the log-probabilities of ids[1:] [T-1]."""
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
    most = min(model.config.context, MAX_TOKENS, math.isqrt(SCORES_BYTES // (4 * model.config.n_heads)))
    if len(ids) > most:
        raise ValueError(f"{len(ids)} tokens: an eviction replay reads at most {most} (the model's context, and the "
                         f"masks and scores [{model.config.n_heads} heads, T, T] it holds per layer); take a window")
    from models.transformer import evaluating  # (models.transformer imports the mixers, which import this module)

    x = torch.tensor([ids], device=model.wte.weight.device)
    cache = Replay(policy, model.config.n_layers, prompt)
    with evaluating(model):
        logits = model(x, cache=cache).logits
    lp = target_logprobs(logits[0, :-1], x[0, 1:])
    return MethodRun(torch.stack([c.visible for c in cache.layers]), torch.stack([c.dropped_at for c in cache.layers]), lp)
