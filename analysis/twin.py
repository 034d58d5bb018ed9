"""What a generation's pruning (or eviction policy) cost against its twin, measured on the same text.

Two models generated from one prompt and seed; each sampled its own continuation, so the perplexity each gives
its own output is a sampling statistic (a model that samples bland text scores itself well), not pruning's price.
The price is teacher-forced: both models score both continuations, each as it generates (a pruned model through
its learned rule at the step, a policy through its replay, models.pruning.replay), and on each text the two
models' perplexities are compared.
"""
from __future__ import annotations

import math

import torch

from analysis.budgets import replay_most
from models.memory import forward_bytes, largest_window, weights_bytes
from models.pruning.replay import replay
from models.scoring import head_logprobs


def most_tokens(model, policy=None) -> int:
    """The longest prompt + continuation scored at once: a policy's replay reads at most what budgets.replay_most
    allows (its [T, vocab] logits and per-layer scores); the model's own rule (or none) is one forward, up to the
    model's context within the memory budget, with both models of the pair held (models.memory's planner)."""
    if policy is not None:
        return replay_most(model.config)
    return largest_window([model.config], lambda c, t: forward_bytes(c, 1, t), 2 * weights_bytes(model))


@torch.inference_mode()
def continuation_logprobs(model, prompt_ids: list[int], new_ids: list[int], policy=None) -> torch.Tensor:
    """log p(new_ids[i] | prompt, new_ids[:i]) for every generated token, in one teacher-forced forward: the
    model's own rule (or none) when policy is None, else the policy's replay (prompt mode compresses at the
    prompt's end, as generation did)."""
    ids = list(prompt_ids) + list(new_ids)
    most = most_tokens(model, policy)
    if len(ids) > most:
        raise ValueError(f"{len(ids)} tokens: the twin's price is scored on at most {most:,} at once "
                         f"({'a policy replay' if policy is not None else 'one forward'} on this model)")
    if policy is not None:
        lp = replay(model, ids, policy, prompt=len(prompt_ids)).logprobs
        return lp[len(prompt_ids) - 1:].double().cpu()
    x = torch.tensor([ids], device=model.wte.weight.device)
    first = len(prompt_ids) - 1   # the head runs only where a generated token is predicted, a chunk at a time
    hidden = model(x, hidden_only=True).hidden[0, first:-1]
    return head_logprobs(model, hidden, x[0, first + 1:]).double().cpu()


def perplexity(lp: torch.Tensor) -> float:
    return math.exp(-float(lp.mean())) if len(lp) else float("nan")


def price(scorers: list[tuple[str, object, object]], prompt_ids: list[int],
          texts: list[tuple[str, list[int]]]) -> list[dict]:
    """Each text (label, its generated ids) scored by each scorer (label, model, policy or None): one row per
    (text, scorer) with the teacher-forced perplexity of the continuation and its token count."""
    rows = []
    for text, new_ids in texts:
        for who, model, pol in scorers:
            lp = continuation_logprobs(model, prompt_ids, new_ids, pol)
            rows.append({"text": text, "scored by": who, "perplexity": perplexity(lp), "tokens": len(lp)})
    return rows


def price_change(rows: list[dict], first: str, second: str) -> dict[str, float]:
    """Per text: the first scorer's perplexity over the second's, minus 1 (pruning's price on that text)."""
    by = {(r["text"], r["scored by"]): r["perplexity"] for r in rows}
    return {t: by[(t, first)] / by[(t, second)] - 1 for t in dict.fromkeys(r["text"] for r in rows)}
