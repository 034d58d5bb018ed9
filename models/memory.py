"""The memory planner: what a command or page may hold (the budget), what the work models/ does holds (its byte
estimates), and one check that refuses a window before anything loads or runs when it would not fit, naming the
largest window that does.

Bytes are float32 work unless a model's own weights say otherwise, counted against memory_budget() for the whole
process: the weights held at once, the runtime beside them (RUNTIME_BYTES) and one window's work at its peak.
analysis/ adds its own estimates (maps, attributions, reports' runs: analysis.budgets) and asks check_window here.
"""
from __future__ import annotations

import math

from kernels import settings
from models.scoring import CHUNK

# the interpreter, torch, numpy and pandas beside the weights (a bare `import torch, pandas, plotly` holds ~350 MB)
RUNTIME_BYTES = 512 * 2 ** 20
MARGIN = 1.25      # what forward_bytes does not count: allocator slack, rotary tables, small temporaries

# an eviction replay's own limits (replay_tokens; models.pruning.replay reads at most as much)
REPLAY_MAX_TOKENS = 4096         # the model's context or this, whichever is smaller
REPLAY_SCORES_BYTES = 2 ** 30    # one layer's scores [heads, T, T] in float32 at most (9 heads x 4,096^2 = 600 MB)
REPLAY_VISIBLE_BYTES = 2 ** 30   # the visible masks kept [layers, rows, T, T] (30 layers x 3 groups x 3,000^2 = 810 MB)


class OverBudget(ValueError):
    """Work that would not fit the memory budget, refused before it starts; the message names what fits."""


# ---- the budget -------------------------------------------------------------------------------------------------

def memory_budget() -> int:
    """Bytes a command or page plans for in all (weights, runtime and working memory): MIXSCOPE_MEMORY_MB, default
    4,096 (read at each call, so a test or an operator can change it)."""
    return int(settings.get("MIXSCOPE_MEMORY_MB") * 2 ** 20)


def gb(n: int) -> str:
    """Bytes as the refusals write them: gigabytes, one decimal."""
    return f"{n / 2**30:.1f} GB"


# ---- what models/ holds -----------------------------------------------------------------------------------------

def weights_bytes(model) -> int:
    """The loaded model's parameters and buffers, in their own dtypes."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def planned_weights(cfg) -> int:
    """A model's float32 weights from its config alone (ModelConfig.param_count: counted, not built, so a config
    of many layers costs no more to plan than a small one)."""
    return 4 * cfg.param_count()


def forward_bytes(cfg, rows: int, t: int, chunk: int = CHUNK) -> int:
    """Estimated working memory of one inference forward over rows x t tokens in float32 with the head applied
    `chunk` positions at a time (models.scoring.head_logprobs) and no attention maps recorded. Layers run one after
    another, so one layer's activations are live at once: per token the residual stream and its norm, q/k/v with
    their rotated copies, the attention output, the feed-forward's d_ff-wide tensors; per row the [t, t] masks a
    mask-using model builds (context pruning's log I, keep, scores and additive mask; a fixed pattern's bias), and
    one [t, t] boolean causal mask (SDPA's CPU kernel attends in blocks: no [heads, t, t] scores); an Extractor's FFT
    buffers; the head's [rows, chunk, vocab] logits with their log-softmax. Times MARGIN."""
    d, heads = cfg.d_model, cfg.n_heads * cfg.d_head
    per_token = 4 * d + 4 * cfg.d_ff + 5 * heads
    if cfg.mixer in ("me", "we", "he", "she"):
        per_token += 8 * d                                     # complex spectra of 2t positions per channel
    square = t * t                                             # the causal mask, one byte a cell
    if cfg.prune:
        square += rows * 4 * 4 * t * t
    elif cfg.pattern != "dense":
        square += 2 * 4 * t * t
    head = 3 * rows * min(chunk, t) * cfg.vocab_size
    return int(MARGIN * (4 * rows * t * per_token + square + 4 * head))


def logits_bytes(t: int, vocab: int) -> int:
    """[t, vocab] float32 logits formed whole (analysis.tokens.token_logprobs, a replay): 8 k x 49,152 = 1.6 GB."""
    return 4 * t * vocab


def record_bytes(cfg, t: int) -> int:
    """What a forward with diagnostics keeps of a t-token window until it returns, without attention maps: every
    layer's [t, t] keep mask in float32 when the model masks (context pruning, a fixed pattern); nothing when dense."""
    return cfg.n_layers * 4 * t * t if cfg.prune or cfg.pattern != "dense" else 0


def replay_tokens(cfg, rows: int, copies: int) -> int:
    """The longest text an eviction replay reads (models.pruning.replay): the model's context and REPLAY_MAX_TOKENS,
    one layer's scores [heads, T, T] `copies` times over within REPLAY_SCORES_BYTES, and the masks
    [layers, rows, T, T] within REPLAY_VISIBLE_BYTES."""
    return min(cfg.context, REPLAY_MAX_TOKENS, math.isqrt(REPLAY_SCORES_BYTES // (4 * cfg.n_heads * copies)),
               math.isqrt(REPLAY_VISIBLE_BYTES // (cfg.n_layers * rows)))


def batch_rows(model, length: int, batch_tokens: int, budget: int | None = None) -> int:
    """How many windows of `length` tokens one forward takes: batch_tokens' worth (at least one), fewer where the
    weights, the runtime and forward_bytes would pass the budget (default memory_budget()); 0 when not even one
    fits."""
    room = (memory_budget() if budget is None else budget) - weights_bytes(model) - RUNTIME_BYTES
    rows = max(1, batch_tokens // length)
    while rows and forward_bytes(model.config, rows, length) > room:
        rows -= 1 if rows < 4 else rows // 4   # (coarse steps first: a few checks, however many rows were asked)
    return rows


# ---- the one check ----------------------------------------------------------------------------------------------

def largest(fits, most: int) -> int:
    """The largest t in 1..most with fits(t) (fits must not grow back once false), 0 when none: a binary search,
    about log2(most) calls."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _plan(cfgs: list, need, resident: int | None, budget: int | None):
    """(context, resident, budget, fits) for check_window and largest_window: fits(t) says whether a t-token window
    is within every model's context and its work need(cfg, t), the costliest of cfgs, fits beside the resident
    weights (default: all of cfgs' in float32) and the runtime."""
    context = min(c.context for c in cfgs)
    resident = sum(planned_weights(c) for c in cfgs) if resident is None else resident
    budget = memory_budget() if budget is None else budget
    room = budget - RUNTIME_BYTES - resident

    def fits(t: int) -> bool:
        return t <= context and max(need(c, t) for c in cfgs) <= room

    return context, resident, budget, fits


def largest_window(cfgs: list, need, resident: int | None = None, budget: int | None = None) -> int:
    """The largest window (tokens) check_window accepts for these arguments; 0 when none."""
    context, _, _, fits = _plan(cfgs, need, resident, budget)
    return largest(fits, context)


def check_window(cfgs: list, window: int, need, resident: int | None = None, what: str = "--window",
                 budget: int | None = None) -> None:
    """Refuse (OverBudget), before anything loads or runs, a window of `window` tokens that passes a model's context,
    or whose work need(cfg, t) (bytes, the costliest of cfgs; infinite past a hard limit of its own, as an eviction
    replay's replay_tokens) beside the weights held at once (resident: default all of cfgs', in float32) and the
    runtime would pass the budget (default memory_budget()). The message names the largest window that fits, as
    `what` N (the option that sets it)."""
    context, resident, budget, fits = _plan(cfgs, need, resident, budget)
    if fits(window):
        return
    if window > context:
        most = largest(fits, context)
        raise OverBudget(f"{what} {window:,}: the model's context is {context:,} tokens"
                         + (f" (the largest window that fits: {what} {most})" if most else ""))
    most = largest(fits, window)
    need_now = max(need(c, window) for c in cfgs)
    why = (f"needs about {gb(need_now)} beside {gb(resident)} of weights, over the {gb(budget)} memory budget "
           "(MIXSCOPE_MEMORY_MB)" if math.isfinite(need_now) else "is past what an eviction replay reads at once")
    raise OverBudget(f"{what} {window:,} {why}: "
                     + (f"the largest window that fits is {what} {most}" if most > 1 else
                        "these weights leave no room for a window: load fewer or smaller models"))
