"""Memory the analyses plan for: their own byte estimates (attention maps and their table, attributions, a report's
policy runs, an export's figures, the Heads view's circuits), added to models.memory's estimates of the forward, and
checked by models.memory's one planner (check_window), so the app's pages and the commands (analysis.export,
analysis.reports.*) refuse, before they start, only what would not fit.

Bytes are float32 analysis (a bf16 model needs less), counted against memory_budget() for the whole process: the
loaded weights, the runtime beside them and what one window's work holds at its peak. The windows themselves are
analysis.views'.
"""
from __future__ import annotations

from pathlib import Path

from analysis.views import ATTENTION_VIEW, ATTRIBUTION_VIEW, COMPARE_VIEW, attribution_default, view
from models.memory import (RUNTIME_BYTES, check_window, forward_bytes, logits_bytes, planned_weights, record_bytes,
                           replay_tokens)


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
    second copy held, at 1,697 tokens: 4,055 MiB against 4,096 planned, with every layer's keep mask read in float at
    once (the reports' sparsity reads one layer at a time, so this is an upper bound)."""
    groups = most_groups(cfg)
    masks = cfg.n_layers * groups * t * t * (1 + 1) + groups * t * t * 8
    scores = 5 * 4 * cfg.n_heads * t * t + 4 * groups * t * t
    return forward_bytes(cfg, 1, t) + 2 * logits_bytes(t, cfg.vocab_size) + scores + masks


def most_groups(cfg) -> int:
    """KV groups of a layer, at most (GQA's own count; MQA has 1, counted as MHA's heads)."""
    from models.mixers.attention import GQA
    return GQA.kv_heads_of(cfg) if cfg.mixer == "gqa" else cfg.n_heads


def replay_most(cfg) -> int:
    """The longest text models.pruning.replay reads for the costliest policy (the hindsight oracle, per KV group):
    models.memory.replay_tokens, so a report can name it before it starts."""
    return replay_tokens(cfg, most_groups(cfg), 3)


def report_window_bytes(cfg, t: int) -> int:
    """What a report holds for one t-token window of one model: method_run_bytes when it replays policies (infinite
    past replay_most: refused there), and the pruning table's forward with its kept masks (bucket_eval)."""
    run = method_run_bytes(cfg, t) if t <= replay_most(cfg) else float("inf")
    return max(run, forward_bytes(cfg, 1, t) + record_bytes(cfg, t))


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
