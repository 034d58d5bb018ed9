"""View and memory budgets, in one place, so the app's pages and the commands (analysis.export, models.evaluate,
analysis.reports.*) draw the same windows of a text and refuse, before they start, only what would not fit.

Views are tokens: a page analyses a window of at most this many tokens of a longer text, the first one unless its
slider picks another (app.common.window_picker), and analysis.export draws that first window. Memory is bytes,
for float32 analysis (a bf16 model needs less), counted against memory_budget() for the whole process: the
loaded weights, the runtime beside them (RUNTIME_BYTES) and what one window's work holds at its peak.

models/ cannot import analysis/, so the forward's own estimate and the budget live in models.scoring (re-exported
here); models.evaluate bounds itself with them.
"""
from __future__ import annotations

import math
from pathlib import Path

from analysis.text import MAX_CHARS, window
from kernels import settings
from models.scoring import RUNTIME_BYTES, forward_bytes, memory_budget, weights_bytes

# re-exported: the forward's estimates from models.scoring, the text limit from analysis.text (where text is checked)
__all__ = ["MAX_CHARS", "RUNTIME_BYTES", "forward_bytes", "memory_budget", "weights_bytes"]

# ---- text --------------------------------------------------------------------------------------------------------
# MAX_CHARS (analysis.text): characters a page or analysis.export reads; every view below is a window of it
# serve mode's caps, a shared server's defaults (declared in kernels.settings, which the operator's value overrides):
SERVE_MAX_CHARS = settings.default("MIXSCOPE_SERVE_MAX_CHARS")            # 8,000 characters of the above
SERVE_MAX_NEW_TOKENS = settings.default("MIXSCOPE_SERVE_MAX_NEW_TOKENS")  # 256 tokens one generation adds

# ---- views: tokens per window ------------------------------------------------------------------------------------
ATTENTION_VIEW = 128     # Attention: [layers, heads, T, T] maps (30 x 9 x 128^2 floats = 18 MB) and a zoomed map whose
                         # 128 token labels stay readable
ATTRIBUTION_VIEW = 256   # Attribution: each gradient is a forward and backward over the window (SmolLM2: ~0.5 GB)
COMPARE_VIEW = 128       # Compare: two models' surprisal and maps side by side, the Attention page's view each
PRUNING_VIEW = 1024      # Pruning: keep masks, one byte a cell (30 layers x 1,024^2 = 31 MB), and a policy replay
SCORES_VIEW = 256        # the Pruning page's interaction scores: 256 queries x 256 keys drawn at once (analysis.scores)
MAX_SNAPSHOTS = 32       # Pruning's timeline: the training snapshots replayed on a window, one forward each
LIVE_STRIP = 1024        # Generate's live strips: the last 1,024 positions x 30 layers stay light in a browser


def view(size: int, context: int) -> int:
    """A view's tokens on a model: never past its context (what window_picker shows)."""
    return min(size, context)


def first_window(tokens, size: int, context: int):
    """The window a page shows before its slider moves: the first view(size, context) tokens."""
    return window(tokens, 0, view(size, context))


def large_model() -> int:
    """Parameters past which a page starts on its cheaper setting (Attribution: gradient x input; Pruning: the
    second forward and the dense base wait to be asked for): MIXSCOPE_LARGE_MODEL, default 50 M."""
    return int(settings.get("MIXSCOPE_LARGE_MODEL"))   # (a float: "5e7" is accepted too)


# ---- memory -----------------------------------------------------------------------------------------------------
class OverBudget(ValueError):
    """Work that would not fit the memory budget, refused before it starts; the message names what fits."""


def planned_weights(cfg) -> int:
    """A model's float32 weights from its config alone (built on the meta device: nothing read or allocated)."""
    import torch

    from models.transformer import DecoderLM
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in DecoderLM(cfg).parameters())


def config_of(model_dir: str | Path):
    """A model directory's config (config.json; a delta's is its own), for planning before anything loads."""
    from models.files import CheckpointError
    from models.config import ConfigError, ModelConfig
    try:
        return ModelConfig.load(Path(model_dir) / "config.json")
    except (OSError, ConfigError, ValueError) as e:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def maps_bytes(cfg, t: int) -> int:
    """Attention maps of a t-token window held at once by maps.mixing_maps: every layer's [heads, t, t] record
    (float32), the stacked copy it returns, and the one layer's scores and softmax being formed."""
    return 4 * t * t * cfg.n_heads * (2 * cfg.n_layers + 2)


def maps_table_bytes(cfg, t: int) -> int:
    """maps.maps_table over [layers, heads, t, t] and its CSV: the four int64 index grids, the kept rows (five numeric
    columns and two label pointers) and the CSV text with its bytes (about 64 characters a row, twice)."""
    cells = cfg.n_layers * cfg.n_heads * t * t
    rows = cfg.n_layers * cfg.n_heads * t * (t + 1) // 2
    return 32 * cells + cells + 56 * rows + 128 * rows


def logits_bytes(t: int, vocab: int) -> int:
    """[t, vocab] float32 logits formed whole (tokens.token_logprobs, a replay): 8 k x 49,152 = 1.6 GB."""
    return 4 * t * vocab


def attribution_bytes(cfg, t: int, method: str, steps: int) -> int:
    """analysis.attribution at a t-token prefix: one gradient's activations times the samples it batches (integrated
    gradients: as many steps as its own budget allows; the other methods: one)."""
    from analysis import attribution
    per = attribution.bytes_per_sample(cfg, t)
    chunk = max(1, min(steps, attribution.BUDGET_BYTES // per)) if method == "integrated gradients" else 1
    return per * chunk


def method_run_bytes(cfg, t: int) -> int:
    """analysis.pruning.method_run over a t-token window, the costliest method (the hindsight oracle's replay, per KV
    group), as the reports hold it: one forward, its whole [t, vocab] logits, one layer's scores [heads, t, t] five
    times over (the oracle's masked copy, softmax, flipped suffix sums) with the additive mask per group, the visible
    masks [layers, groups, t, t] as bool and as uint8, and one layer's float copies the reports' sparsity reads; a
    pruned model's own rule keeps every layer's float32 keep mask instead, which is less. Measured on SmolLM2 with a
    second copy held, at 1,697 tokens (the largest two models then took): 4,055 MiB against 4,096 planned, with the
    reports' sparsity reading every layer in float at once (now one layer at a time)."""
    groups = most_groups(cfg)
    masks = cfg.n_layers * groups * t * t * (1 + 1) + groups * t * t * 8
    scores = 5 * 4 * cfg.n_heads * t * t + 4 * groups * t * t
    return forward_bytes(cfg, 1, t) + 2 * logits_bytes(t, cfg.vocab_size) + scores + masks


def most_groups(cfg) -> int:
    """KV groups of a layer, at most (GQA's own count; MQA has 1, counted as MHA's heads)."""
    from models.mixers.attention import GQA
    return GQA.kv_heads_of(cfg) if cfg.mixer == "gqa" else cfg.n_heads


def replay_most(cfg) -> int:
    """The longest text models.pruning.replay reads for the costliest policy (the hindsight oracle, per KV group): its
    own limit (replay.most_tokens), so a report can name it before it starts."""
    from models.pruning import replay
    return replay.most_tokens(cfg, most_groups(cfg), 3)


def report_window_bytes(cfg, t: int) -> int:
    """What a report holds for one t-token window of one model: method_run_bytes when it replays policies (infinite
    past replay_most: refused there), and the pruning table's forward with its kept masks (models.evaluate)."""
    from models.evaluate import record_bytes
    run = method_run_bytes(cfg, t) if t <= replay_most(cfg) else float("inf")
    return max(run, forward_bytes(cfg, 1, t) + record_bytes(cfg, t))


def largest(fits, most: int) -> int:
    """The largest t in 1..most with fits(t) (fits must not grow back once false), 0 when none."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def gb(n: int) -> str:
    return f"{n / 2**30:.1f} GB"


def check_window(cfgs: list, window: int, need, resident: int | None = None, what: str = "--window") -> None:
    """Refuse (OverBudget), before anything loads or runs, a window of `window` tokens that passes a model's context,
    or whose work need(cfg, t) (the costliest of cfgs) beside the weights held at once (resident: default all of
    cfgs', in float32) and the runtime would pass memory_budget(); the message names the largest window that fits."""
    context = min(c.context for c in cfgs)
    resident = sum(planned_weights(c) for c in cfgs) if resident is None else resident
    budget = memory_budget()
    room = budget - RUNTIME_BYTES - resident

    def fits(t: int) -> bool:
        return t <= context and max(need(c, t) for c in cfgs) <= room

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


def check_dirs(dirs: list, window: int, need, one_at_a_time: bool = False, what: str = "--window") -> None:
    """check_window for the models in these directories, planned from their configs before any loads (held at once,
    or one_at_a_time). A directory whose config cannot be read is left to the loader, whose error names the file."""
    from models.files import CheckpointError
    try:
        cfgs = [config_of(d) for d in dirs]
    except CheckpointError:
        return
    weights = [planned_weights(c) for c in cfgs]
    check_window(cfgs, window, need, max(weights) if one_at_a_time else sum(weights), what)


def export_bytes(cfg, weights: int) -> int:
    """Peak bytes analysis.export plans for on one model, at the app's first windows: the weights and runtime, the
    Attention view's maps and their long table (kept until written), and the costliest of the work beside them
    (the maps' own forward, the Compare view's surprisal with its whole logits, the Attribution view's gradients with
    the page's default method, the Heads view's circuit Gram)."""
    t_maps, t_attr = view(ATTENTION_VIEW, cfg.context), view(ATTRIBUTION_VIEW, cfg.context)
    t_cmp = view(COMPARE_VIEW, cfg.context)
    method, steps = attribution_default(planned_weights(cfg) // 4)   # (parameters, whatever dtype `weights` is in)
    kept = maps_bytes(cfg, t_maps) + maps_table_bytes(cfg, t_maps)
    work = max(forward_bytes(cfg, 1, t_cmp) + logits_bytes(t_cmp, cfg.vocab_size),
               attribution_bytes(cfg, t_attr, method, steps), circuit_bytes(cfg) if has_circuits(cfg) else 0)
    return weights + RUNTIME_BYTES + kept + work


HEADS_FLAT_BYTES = 2**30   # analysis.heads.circuit_gram holds every head's flattened circuit at once up to this
HEADS_BLOCK = 2**22        # ... and past it, blocks of at most this many numbers (each of two factors' products)


def flat_circuits(cfg) -> bool:
    """Whether circuit_gram takes the flattened form for this model (d_model < d_head^2, within HEADS_FLAT_BYTES)."""
    n, d_m = cfg.n_layers * cfg.n_heads, cfg.d_model
    return d_m < cfg.d_head ** 2 and n * d_m * d_m * 4 <= HEADS_FLAT_BYTES


def has_circuits(cfg) -> bool:
    """Per-head projections, so QK and OV circuits (analysis.heads.circuit_factors): attention, not MHE or an
    Extractor."""
    from models.mixers import MIXERS
    from models.mixers.attention import Attention
    from models.mixers.mhe import MHE
    cls = MIXERS[cfg.mixer]
    return issubclass(cls, Attention) and not issubclass(cls, MHE)


def circuit_bytes(cfg) -> int:
    """The Heads view's circuit Gram at its peak, float32: the flattened circuits [heads, d_model^2] (and their
    Gram), or two block products and their sum."""
    n, d_m = cfg.n_layers * cfg.n_heads, cfg.d_model
    return n * d_m * d_m * 4 + n * n * 8 if flat_circuits(cfg) else 3 * HEADS_BLOCK * 4 + n * n * 8


ATTRIBUTION_STEPS = 16   # the Attribution page's default integrated-gradients steps


def attribution_default(params: int) -> tuple[str, int]:
    """The Attribution page's opening method and steps for a model of this many parameters: gradient x input past
    large_model() (one gradient takes seconds on a CPU), integrated gradients otherwise."""
    return ("gradient x input" if params > large_model() else "integrated gradients"), ATTRIBUTION_STEPS
