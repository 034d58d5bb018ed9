"""Heuristic KV-cache eviction policies (papers.md section 5), the baselines context pruning is compared with.

Each policy keeps at most `budget` cached tokens per layer (the current token always kept) and decides, per
layer and decode step, which slots of the compacted cache to let go. The cache's slots are not in position
order, so every policy reads the slot positions `pos` [B,S] (-1: unused) and the live mask `live` [B,S]; one new
token per row sits at position `q_pos` [B]. Policies that look at attention take the current query's attention
over the slots, `probs` [B,H,S] (per head; each policy reduces over heads as its paper does). Positions are kept
as they were (no re-numbering inside the cache, which StreamingLLM does for RoPE models).

A cache built with a policy (DecoderLM.new_compact_cache(policy=...), models.generate.stream(policy=...)) runs
it inside the decode step; models.pruning.replay runs it over a whole text in one forward (the same decisions;
what the Pruning page and analysis.reports.eviction use); models.evaluate.score_token_by_token scores a text
under it token by token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REGISTRY: dict[str, type["Policy"]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


class Policy:
    name = ""
    uses_attention = False   # step() needs the current query's attention
    at_prompt_end = False    # decides once, after the prompt (SnapKV); otherwise at every step
    before_attending = False  # evicts before the current query attends (it sees budget - 1 earlier tokens)
    min_budget = 1

    def __init__(self, budget: int):
        if budget < 1:
            raise ValueError(f"{self.name}: the budget must be at least 1 token, got {budget}")
        self.budget = budget

    def state(self, batch: int, capacity: int, device) -> dict[str, torch.Tensor]:
        """Per-slot state the policy keeps beside the cache (gathered with it when it compacts)."""
        return {}

    def step(self, live, pos, q_pos, probs=None, state=None) -> torch.Tensor:
        """The live mask after this step's evictions ([B,S] bool), the current token's slot included."""
        return live


def _current(pos, q_pos):
    return pos == q_pos[:, None]


def _evict_lowest(keep, score, candidates, over):
    """Per row with over > 0 (at most one here: one token arrives per step), drop the candidate slot of lowest
    score. score ties go to the lower slot index (torch.argmin's first)."""
    masked = score.masked_fill(~candidates, float("inf"))
    worst = masked.argmin(1)
    drop = (over > 0) & candidates.any(1)
    rows = torch.arange(keep.shape[0], device=keep.device)[drop]
    keep = keep.clone()
    keep[rows, worst[drop]] = False
    return keep


@register
class StreamingLLM(Policy):
    """Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453): keep the first
    `sinks` tokens (the attention sinks, 4) and the most recent budget - sinks tokens. Decided by positions alone,
    before the query attends."""
    name = "streamingllm"
    before_attending = True
    min_budget = 5  # the 4 sinks and one recent token

    def __init__(self, budget: int, sinks: int = 4):
        super().__init__(budget)
        if not 0 <= sinks < budget:
            raise ValueError(f"streamingllm: sinks must be in [0, budget), got {sinks} with budget {budget}")
        self.sinks = sinks

    def step(self, live, pos, q_pos, probs=None, state=None):
        recent = pos > (q_pos[:, None] - (self.budget - self.sinks))
        return live & ((pos < self.sinks) | recent)


@register
class TOVA(Policy):
    """Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104): when the cache holds more than the
    budget, evict the token the current query attends to least (weights averaged over heads)."""
    name = "tova"
    uses_attention = True

    def step(self, live, pos, q_pos, probs=None, state=None):
        over = live.sum(1) - self.budget
        return _evict_lowest(live, probs.mean(1), live & ~_current(pos, q_pos), over)


@register
class H2O(Policy):
    """Zhang et al., "H2O: Heavy-Hitter Oracle" (arXiv 2306.14048): a cached token's score is the attention it has
    received, summed over every query so far and over the heads that share the cache; keep the budget/2 most
    recent tokens and the highest-scoring others, evicting the lowest-scoring token outside the recent window."""
    name = "h2o"
    uses_attention = True

    def state(self, batch, capacity, device):
        return {"score": torch.zeros(batch, capacity, device=device)}

    def step(self, live, pos, q_pos, probs=None, state=None):
        s = live.shape[1]
        score = state["score"][:, :s]
        score += probs.sum(1).masked_fill(~live, 0.0).to(score.dtype)   # accumulated, in place
        recent = pos > (q_pos[:, None] - self.budget // 2)
        over = live.sum(1) - self.budget
        return _evict_lowest(live, score, live & ~recent, over)


@register
class SnapKV(Policy):
    """Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469): once, at the
    end of the prompt, the last `window` prompt queries score every earlier prompt token by the attention they
    give it (summed over those queries and the heads), smoothed by a max-pool of width `pool` along positions;
    keep the top budget - window of them and the window itself. Tokens generated later are all kept."""
    name = "snapkv"
    uses_attention = True
    at_prompt_end = True
    min_budget = 33  # the observation window (32) and one selected token

    def __init__(self, budget: int, window: int = 32, pool: int = 7):
        super().__init__(budget)
        if window < 1 or window >= budget:
            raise ValueError(f"snapkv: the window must be in [1, budget), got {window} with budget {budget}")
        self.window, self.pool = window, pool

    def select(self, live, pos, n_prompt: torch.Tensor, window_probs: torch.Tensor) -> torch.Tensor:
        """window_probs [B,H,W,S]: attention of the last W prompt queries over the slots. -> live mask."""
        b, s = live.shape
        earlier = live & (pos >= 0) & (pos < (n_prompt - self.window)[:, None])
        vote = window_probs.sum((1, 2)).masked_fill(~earlier, 0.0)                     # [B,S]
        order = pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(1)      # slots by position
        by_pos = vote.gather(1, order)
        smooth = F.max_pool1d(by_pos[:, None], self.pool, stride=1, padding=self.pool // 2)[:, 0]
        score = torch.empty_like(smooth).scatter_(1, order, smooth).masked_fill(~earlier, float("-inf"))
        # the top budget - window by smoothed score; pooling makes ties, broken by the raw vote, then position
        rank = order                                                                   # position ascending
        rank = rank.gather(1, vote.gather(1, rank).sort(dim=1, descending=True, stable=True).indices)
        rank = rank.gather(1, score.gather(1, rank).sort(dim=1, descending=True, stable=True).indices)
        k = min(max(0, self.budget - self.window), s)
        chosen = torch.zeros_like(live).scatter_(1, rank[:, :k], True) & earlier
        return live & (chosen | ~earlier)                 # the window and anything later stay


def expected_sparsity(name: str, budget: int, n: int, prompt: int | None = None, first: int = 0,
                      count_first: bool = True) -> float:
    """Mean over the queries first..n-1 of an n-token text of the share of earlier tokens a policy at this budget
    hides, averaged as models.pruning.mean_sparsity(count_first) averages (query 0, with nothing earlier, counts
    as 0 or is left out; only matters when first is 0). It
    follows from the text length alone: step policies hold `budget` tokens (StreamingLLM's query sees budget - 1
    earlier ones, the others' see budget); SnapKV's prompt queries see everything and the query at i >= prompt
    sees the min(budget, prompt) prompt tokens it kept plus the i - prompt generated before it."""
    cls = REGISTRY[name]
    i = torch.arange(max(first, 1), n, dtype=torch.float64)
    if cls.at_prompt_end:
        if prompt is None:
            raise ValueError(f"{name} decides at the end of a prompt: give its length")
        sees = torch.where(i < prompt, i, min(budget, prompt) + i - prompt)
    else:
        sees = torch.full_like(i, budget - 1 if cls.before_attending else budget)
    queries = n - first - (1 if first == 0 and not count_first else 0)
    return float((1 - torch.minimum(i, sees) / i).sum()) / max(1, queries)


def budget_for(name: str, target: float, n: int, prompt: int | None = None, first: int = 0,
               count_first: bool = True) -> int:
    """The budget whose expected sparsity (over queries first..n-1, averaged as count_first says) is nearest
    `target` (ties: the larger budget)."""
    low = min(REGISTRY[name].min_budget, n)
    return min(range(n, low - 1, -1),
               key=lambda b: abs(expected_sparsity(name, b, n, prompt, first, count_first) - target))


def make(name: str, budget: int, **kwargs) -> Policy:
    try:
        return REGISTRY[name](budget, **kwargs)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(sorted(REGISTRY))}") from None
