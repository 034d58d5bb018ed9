"""KV-cache eviction policies (docs/methods.md), the baselines context pruning is compared with, and the
interface a new one plugs into (a worked example: docs/policies.md).

A policy sees a cache as rows of slots. A row is one (batch row, KV group) for a policy that decides per KV group
(`per_group`: the papers' H2O and SnapKV, a KV group being the query heads that read one K/V head), or one batch
row for a policy that decides per layer, all groups alike (TOVA's recommended form, StreamingLLM, and the `-layer`
variants). Slots are not in position order: every call reads the slot positions `pos` [R,S] (-1: unused) and the
live mask `live` [R,S]. Attention comes per row and head: `probs` [R,h,S], the h heads of the row's group (all H
heads for a per-layer row), each summing to 1 over the live slots. Positions are kept as they were (no
re-numbering inside the cache, which StreamingLLM does for RoPE models).

Two modes, as users meet them:
  step    during decoding, one token arriving at a time (`q_pos` [R]): step() returns what the row keeps, at most
          `budget` slots, the newest always kept. A policy that reads no attention evicts before the newest query
          attends (it sees budget - 1 earlier tokens); one that reads it, after (it sees budget).
  prompt  once, after a prompt of n_prompt tokens was read with nothing evicted: compress() returns what the row
          keeps of it (at most `budget`); every later token is kept. `window` says how many of the last prompt
          queries' attention it reads, summed per head: `received` [R,h,S] (None: the whole prompt).
A policy with `hindsight` reads, instead of the current query's attention, the attention every later query
pays each token in the full (nothing evicted) model: an upper bound no causal rule can reach, replay only.

A method id names a policy and, when not its default, its mode: "h2o" (step), "h2o:prompt", "snapkv" (prompt),
"snapkv:step". A cache built with a policy (DecoderLM.new_compact_cache(policy=...), models.generate.stream) runs
it inside the decode step; models.pruning.replay runs it over a whole text in one forward (the same decisions).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

REGISTRY: dict[str, type["Policy"]] = {}
MODES = ("step", "prompt")


def register(cls):
    """Class decorator: make a policy available by its name (the pages, reports and make() read REGISTRY)."""
    if not cls.name or ":" in cls.name:
        raise ValueError(f"a policy needs a name without ':' (got {cls.name!r})")
    if cls.name in REGISTRY and REGISTRY[cls.name].__qualname__ != cls.__qualname__:
        raise ValueError(f"a policy named {cls.name!r} is registered already ({REGISTRY[cls.name].__qualname__})")
    REGISTRY[cls.name] = cls
    return cls


class Policy:
    name = ""
    title = ""                # how the pages and reports name it (default: the name)
    per_group = False         # rows are (batch row, KV group); else one row per batch row (the layer decides)
    uses_attention = False    # step() / compress() read attention
    hindsight = False         # ... the attention later queries pay in the full model (an oracle: replay only)
    min_budget = 1
    modes = MODES             # the modes it has
    default_mode = "step"
    window: int | None = 1    # prompt mode: the last prompt queries whose attention compress() reads (None: all)

    def __init__(self, budget: int, mode: str | None = None):
        mode = mode or self.default_mode
        if mode not in self.modes:
            raise ValueError(f"{self.name} has no {mode!r} mode (it has: {', '.join(self.modes)})")
        if budget < 1:
            raise ValueError(f"{self.name}: the budget must be at least 1 token, got {budget}")
        self.budget, self.mode = budget, mode

    @property
    def method(self) -> str:
        return method_id(self.name, self.mode)

    @property
    def at_prompt_end(self) -> bool:
        return self.mode == "prompt"

    def state(self, rows: int, capacity: int, device) -> dict[str, torch.Tensor]:
        """Per-slot state kept beside the cache ([rows, capacity, ...]; gathered with the slots on compaction)."""
        return {}

    def step(self, live, pos, q_pos, probs=None, state=None) -> torch.Tensor:
        """Step mode: the live mask after this step's evictions ([R,S] bool), the newest token's slot included."""
        raise NotImplementedError

    def compress(self, live, pos, n_prompt, received=None) -> torch.Tensor:
        """Prompt mode: the live mask after the prompt (n_prompt [R] tokens) is compressed to the budget."""
        raise NotImplementedError


def method_id(name: str, mode: str) -> str:
    return name if mode == REGISTRY[name].default_mode else f"{name}:{mode}"


def parse(method: str) -> tuple[type[Policy], str]:
    """A method id -> (policy class, mode)."""
    name, _, mode = method.partition(":")
    if name not in REGISTRY:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[name]
    mode = mode or cls.default_mode
    if mode not in cls.modes:
        raise ValueError(f"{name} has no {mode!r} mode (it has: {', '.join(cls.modes)})")
    return cls, mode


def not_decodable(cls: type[Policy], groups: int) -> str | None:
    """Why a decode cache cannot run this policy on a model with `groups` KV groups (None: it can)."""
    if cls.hindsight:
        return (f"{cls.name} reads what later queries attend to: it runs in a replay over a whole text (the Pruning "
                "page, the reports), not while decoding")
    return None


def methods(decoding: bool = False, groups: int = 1) -> list[str]:
    """Every registered policy in each of its modes. decoding: only what a decode cache runs on a model with
    `groups` KV groups (not_decodable)."""
    return [method_id(n, m) for n, c in REGISTRY.items() for m in c.modes
            if not (decoding and not_decodable(c, groups))]


def check_methods(names: list[str]) -> list[str]:
    """What is wrong with each of these method ids (an empty list: nothing)."""
    bad = []
    for name in names:
        try:
            parse(name)
        except ValueError as e:
            bad.append(str(e))
    return bad


def title(method: str) -> str:
    cls, mode = parse(method)
    what = {"step": "step by step", "prompt": "prompt compressed once"}[mode]
    return f"{cls.title or cls.name}, {what}"


def once(method: str) -> bool:
    """The method compresses a prompt once (it needs the prompt's length)."""
    return parse(method)[1] == "prompt"


def min_budget(method: str) -> int:
    return parse(method)[0].min_budget


def load_plugins(paths) -> list[str]:
    """Import each Python file in `paths` (a sequence, or one os.pathsep-separated string; the app and the reports
    pass settings.get("MIXSCOPE_POLICIES")) so the policies it registers join REGISTRY; a file is imported once per
    process. Returns the names it registered. The operator's setting, never a browser user's."""
    import importlib.util
    import os
    import sys
    added = []
    for path in map(str, filter(None, paths.split(os.pathsep) if isinstance(paths, str) else paths or ())):
        key = "mixscope_policy_" + str(abs(hash(os.path.abspath(path))))
        if key in sys.modules:
            continue
        before = set(REGISTRY)
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or not os.path.isfile(path):
            raise ValueError(f"MIXSCOPE_POLICIES: {path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception:
            del sys.modules[key]
            raise
        added += sorted(set(REGISTRY) - before)
    return added


def make(method: str, budget: int, **kwargs) -> Policy:
    cls, mode = parse(method)
    return cls(budget, mode=mode, **kwargs)


# ---- helpers the policies share (and a plug-in may use) --------------------------------------------------------

def _current(pos, q_pos):
    return pos == q_pos[:, None]


def evict_lowest(keep, score, candidates, over):
    """Per row with over > 0 (at most one here: one token arrives per step), drop the candidate slot of lowest
    score. score ties go to the lower slot index (torch.argmin's first)."""
    masked = score.masked_fill(~candidates, float("inf"))
    worst = masked.argmin(1)
    drop = (over > 0) & candidates.any(1)
    rows = torch.arange(keep.shape[0], device=keep.device)[drop]
    keep = keep.clone()
    keep[rows, worst[drop]] = False
    return keep


def _by_position(pos):
    """Slot indices per row in position order (unused slots last)."""
    return pos.masked_fill(pos < 0, torch.iinfo(pos.dtype).max).argsort(dim=1, stable=True)


def keep_top(score, candidates, k, pos, tiebreak=None):
    """The k [R] highest-scoring candidate slots per row (a mask); ties go to the higher `tiebreak`, then to the
    earlier position."""
    order = _by_position(pos)
    if tiebreak is not None:
        t = tiebreak.masked_fill(~candidates, float("-inf")).gather(1, order)
        order = order.gather(1, t.sort(dim=1, descending=True, stable=True).indices)
    s = score.masked_fill(~candidates, float("-inf")).gather(1, order)
    ranked = order.gather(1, s.sort(dim=1, descending=True, stable=True).indices)
    take = torch.arange(pos.shape[1], device=pos.device)[None] < torch.as_tensor(k, device=pos.device).reshape(-1, 1)
    return torch.zeros_like(candidates).scatter(1, ranked, take.expand_as(ranked)) & candidates


def _prompt(live, pos, n_prompt):
    return live & (pos >= 0) & (pos < n_prompt[:, None])


# ---- the policies ----------------------------------------------------------------------------------------------

@register
class StreamingLLM(Policy):
    """Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453): keep the first
    `sinks` tokens (the attention sinks, 4) and the most recent budget - sinks tokens. Positional: every group
    alike. Step mode decides before the query attends."""
    name = "streamingllm"
    title = "StreamingLLM (4 sinks + recent window)"
    min_budget = 5  # the 4 sinks and one recent token

    def __init__(self, budget: int, mode: str | None = None, sinks: int = 4):
        super().__init__(budget, mode)
        if not 0 <= sinks < budget:
            raise ValueError(f"streamingllm: sinks must be in [0, budget), got {sinks} with budget {budget}")
        self.sinks = sinks

    def step(self, live, pos, q_pos, probs=None, state=None):
        recent = pos > (q_pos[:, None] - (self.budget - self.sinks))
        return live & ((pos < self.sinks) | recent)

    def compress(self, live, pos, n_prompt, received=None):
        recent = pos >= (n_prompt[:, None] - (self.budget - self.sinks))
        return live & ((pos < self.sinks) | recent | (pos >= n_prompt[:, None]))


@register
class TOVA(Policy):
    """Oren et al., "Transformers are Multi-State RNNs" (arXiv 2401.06104): when the cache holds more than the
    budget, evict the token the current query attends to least, its weights averaged over all heads of the layer
    (the paper's recommended form). Prompt mode: the last prompt query's weights choose the budget."""
    name = "tova"
    title = "TOVA per layer (least attended now)"
    uses_attention = True

    def step(self, live, pos, q_pos, probs=None, state=None):
        over = live.sum(1) - self.budget
        return evict_lowest(live, probs.mean(1), live & ~_current(pos, q_pos), over)

    def compress(self, live, pos, n_prompt, received=None):
        prompt = _prompt(live, pos, n_prompt)
        newest = pos == (n_prompt[:, None] - 1)
        keep = keep_top(received.mean(1), prompt & ~newest, self.budget - 1, pos) | newest
        return live & (keep | ~prompt)


@register
class TOVAGroup(TOVA):
    """TOVA per KV group: the weights averaged over the group's heads only."""
    name = "tova-group"
    title = "TOVA per KV group"
    per_group = True


@register
class H2O(Policy):
    """Zhang et al., "H2O: Heavy-Hitter Oracle" (arXiv 2306.14048), per KV group as in the paper: a cached token's
    score is the attention it has received, summed over every query so far and the group's heads; keep the
    budget/2 most recent tokens and the highest-scoring others, evicting the lowest-scoring token outside the
    recent window. Prompt mode: the scores the whole prompt gave, then the same split."""
    name = "h2o"
    title = "H2O per KV group (heavy hitters + recent)"
    per_group = True
    uses_attention = True
    window = None

    def state(self, rows, capacity, device):
        return {"score": torch.zeros(rows, capacity, device=device)}

    def step(self, live, pos, q_pos, probs=None, state=None):
        s = live.shape[1]
        score = state["score"][:, :s]
        score += probs.sum(1).masked_fill(~live, 0.0).to(score.dtype)   # accumulated, in place
        recent = (pos > (q_pos[:, None] - self.budget // 2)) | _current(pos, q_pos)  # (budget 1: the newest stays)
        over = live.sum(1) - self.budget
        return evict_lowest(live, score, live & ~recent, over)

    def compress(self, live, pos, n_prompt, received=None):
        prompt = _prompt(live, pos, n_prompt)
        recent = prompt & (pos >= n_prompt[:, None] - self.budget // 2)
        heavy = keep_top(received.sum(1), prompt & ~recent, self.budget - recent.sum(1), pos)
        return live & (recent | heavy | ~prompt)


@register
class H2OLayer(H2O):
    """H2O with one score per layer (summed over all heads), every group evicting alike: a weaker reading."""
    name = "h2o-layer"
    title = "H2O per layer (one score for all heads)"
    per_group = False


@register
class SnapKV(Policy):
    """Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469), per KV group:
    once, at the end of the prompt, the last `window` prompt queries (32, the paper's default) score every earlier
    prompt token by the attention they give it, summed over those queries and the group's heads, smoothed by a
    max-pool of width `pool` (7) along positions; keep the top budget - window of them and the window itself;
    tokens generated later are all kept. Step mode (not in the paper): the same vote from the last `window`
    queries, re-taken at every step, evicts the lowest-voted token before the window."""
    name = "snapkv"
    title = "SnapKV per KV group"
    per_group = True
    uses_attention = True
    default_mode = "prompt"
    min_budget = 33  # the observation window (32) and one selected token

    def __init__(self, budget: int, mode: str | None = None, window: int = 32, pool: int = 7):
        super().__init__(budget, mode)
        if window < 1 or window >= budget:
            raise ValueError(f"snapkv: the window must be in [1, budget), got {window} with budget {budget}")
        self.window, self.pool = window, pool

    def _pooled(self, vote, pos, candidates):
        """vote [R,S] max-pooled over the candidates along absolute positions (a token's neighbours within pool // 2
        positions, whether or not a slot still holds them: the same however the slots were compacted)."""
        width = int(pos.max()) + 1 if pos.numel() else 0
        by_pos = torch.zeros(pos.shape[0], width + 1, dtype=vote.dtype, device=vote.device)  # + a sink for empties
        by_pos.scatter_(1, torch.where(pos >= 0, pos, width), vote.masked_fill(~candidates, 0.0))
        smooth = F.max_pool1d(by_pos[:, None, :width], self.pool, stride=1, padding=self.pool // 2)[:, 0]
        return smooth.gather(1, pos.clamp(0, max(0, width - 1))) if width else vote

    def compress(self, live, pos, n_prompt, received=None):
        earlier = _prompt(live, pos, n_prompt - self.window)
        vote = received.sum(1).masked_fill(~earlier, 0.0)                      # [R,S]
        # the top budget - window by smoothed score; pooling makes ties, broken by the raw vote, then position
        chosen = keep_top(self._pooled(vote, pos, earlier), earlier, max(0, self.budget - self.window), pos, vote)
        return live & (chosen | ~earlier)                 # the window and anything later stay

    def state(self, rows, capacity, device):  # step mode: each slot's votes from the last `window` queries
        if self.mode != "step":
            return {}
        return {"votes": torch.zeros(rows, capacity, self.window, device=device)}

    def step(self, live, pos, q_pos, probs=None, state=None):
        s = live.shape[1]
        votes = state["votes"][:, :s]
        rows = torch.arange(live.shape[0], device=live.device)  # this vote replaces the one `window` steps back
        votes[rows, :, q_pos % self.window] = probs.sum(1).masked_fill(~live, 0.0).to(votes.dtype)
        earlier = live & (pos <= q_pos[:, None] - self.window)
        over = live.sum(1) - self.budget
        vote = votes.sum(-1)
        return evict_lowest(live, self._pooled(vote, pos, earlier), earlier, over)


@register
class SnapKVLayer(SnapKV):
    """SnapKV with one vote per layer (summed over all heads), every group keeping alike: a weaker reading."""
    name = "snapkv-layer"
    title = "SnapKV per layer (one vote for all heads)"
    per_group = False


@register
class Oracle(Policy):
    """Hindsight, per KV group: evict the token that every later query, in the full model, attends to least
    (summed over those queries and the group's heads). It reads the future, so no decoder can run it. Meant as a
    bound on what a rule at this budget can reach, it is not one everywhere: on SmolLM2 it beats every rule
    measured, on the small mha-1024 it loses to all of them (docs/eviction.md). Step mode after the query
    attends; prompt mode keeps the prompt tokens the generated ones attend to most."""
    name = "oracle"
    title = "Oracle per KV group (hindsight: a reference, not a rule)"
    per_group = True
    uses_attention = True
    hindsight = True
    window = None

    def step(self, live, pos, q_pos, probs=None, state=None):
        over = live.sum(1) - self.budget
        return evict_lowest(live, probs.sum(1), live & ~_current(pos, q_pos), over)

    def compress(self, live, pos, n_prompt, received=None):
        prompt = _prompt(live, pos, n_prompt)
        return live & (keep_top(received.sum(1), prompt, self.budget, pos) | ~prompt)


# ---- sparsity a policy gives -----------------------------------------------------------------------------------

def expected_sparsity(method: str, budget: int, n: int, prompt: int | None = None, first: int = 0,
                      count_first: bool = True) -> float:
    """Mean over the queries first..n-1 of an n-token text of the share of earlier tokens a policy at this budget
    hides (per row; under per-group eviction every group holds the same count, so the mean over groups is this),
    averaged as models.pruning.mean_sparsity(count_first) averages (query 0, with nothing earlier, counts
    as 0 or is left out; only matters when first is 0). It follows from the text length alone: in step mode a
    policy holds `budget` tokens (one that evicts before attending shows its query budget - 1 earlier ones); in
    prompt mode the prompt's queries see everything and the query at i >= prompt sees the min(budget, prompt)
    prompt tokens kept plus the i - prompt generated before it."""
    cls, mode = parse(method)
    i = torch.arange(max(first, 1), n, dtype=torch.float64)
    if mode == "prompt":
        if prompt is None:
            raise ValueError(f"{method} compresses a prompt once: give its length")
        sees = torch.where(i < prompt, i, min(budget, prompt) + i - prompt)
    else:
        sees = torch.full_like(i, budget if cls.uses_attention else budget - 1)  # no attention read: evicts first
    queries = n - first - (1 if first == 0 and not count_first else 0)
    return float((1 - torch.minimum(i, sees) / i).sum()) / max(1, queries)


def budget_for(method: str, target: float, n: int, prompt: int | None = None, first: int = 0,
               count_first: bool = True) -> int:
    """The budget whose expected sparsity (over queries first..n-1, averaged as count_first says) is nearest
    `target` (ties: the larger budget)."""
    low = min(min_budget(method), n)
    return min(range(n, low - 1, -1),
               key=lambda b: abs(expected_sparsity(method, b, n, prompt, first, count_first) - target))
