"""Pruning: which tokens a context-pruned model drops, per layer and part of speech, and what it saves."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import streamlit as st  # noqa: E402

from analysis import pruning, tokens  # noqa: E402
from app.common import dense_base_path, export_buttons, load, model_paths, model_text_tokens, setup, window_picker  # noqa: E402
from models.checkpoint import CheckpointError, read_json  # noqa: E402
from models.delta import unfetched_base  # noqa: E402


def only_pruned(loaded):
    return None if loaded.config.prune else "not a pruned model (no context pruning): pick one trained with prune=true."


def first_pruned() -> str | None:
    """The page opens on the largest pruned model that opens without a download (configs only, nothing loaded):
    the real pruned SmolLM2 once its base is fetched (`make run` does it), else the small pruned model."""
    best = None
    for path in model_paths():
        try:
            cfg = read_json(path / "config.json")
            if not cfg.get("prune") or unfetched_base(path):
                continue
            card = read_json(path / "card.json") if (path / "card.json").is_file() else {}
            # the largest model; among equals, the one that drops most (its card's validation sparsity)
            size = (cfg.get("n_layers", 0) * cfg.get("d_model", 0), card.get("final_valid_sparsity") or 0.0)
            if best is None or size > best[0]:
                best = (size, path.name)
        except (OSError, CheckpointError):
            continue
    return best[1] if best else None


MAX_VIEW = 1024  # tokens per analysed window: keep masks grow with its square (30 layers x 1,024^2 bytes = 31 MB)


@st.cache_data(max_entries=8, show_spinner="Running the pruned model…")
def cached_keeps(path: str, ids: tuple[int, ...]):
    """(keep masks, log-probabilities): one forward gives both."""
    return pruning.keeps_and_logprobs(load(path).model, list(ids))


@st.cache_data(max_entries=32, show_spinner="Tagging parts of speech (spaCy)…")
def cached_tags(text: str, offsets: tuple[tuple[int, int], ...]):
    return pruning.pos_tags(text, list(offsets))


@st.cache_data(max_entries=64)
def cached_logprobs(path: str, ids: tuple[int, ...]):
    return tokens.token_logprobs(load(path).model, list(ids))


setup("Pruning")
st.caption("Adaptively sparse attention: every layer learns to drop earlier tokens for good. At inference a token "
           "j is dropped by the first later query n whose interaction score x_{n,j} is not positive.")
loaded, text, toks = model_text_tokens(default=first_pruned(), accept=only_pruned)
cfg = loaded.config
view, start = window_picker(toks, cfg.context, "prune_window", MAX_VIEW)
# spaCy tags the window's own text, so offsets are taken relative to it
a, b = view.offsets[0][0], view.offsets[-1][1]
local = tuple((x - a, y - a) for x, y in view.offsets)
keeps, lp = cached_keeps(str(loaded.path), tuple(view.ids))
tags = cached_tags(text[a:b], local)
table = pruning.token_table(keeps, view.labels, tags)
settings = {"window_start": start, "tokens": len(view.ids)}

sp = pruning.sparsity_per_layer(keeps)
live_end = keeps[:, -1].sum(1)  # tokens each layer still holds after the last one
per_token = loaded.model.cache_bytes_per_token() / cfg.n_layers
dense_bytes, pruned_bytes = len(view.ids) * per_token * cfg.n_layers, float(live_end.sum() * per_token)
m = st.columns(4)
m[0].metric("mean sparsity (all layers)", f"{sp['sparsity'].mean():.1%}")
m[1].metric("cache after the text", f"{pruned_bytes / 1024:.1f} KiB", f"{pruned_bytes / dense_bytes - 1:+.0%} vs dense",
            delta_color="inverse")
m[2].metric("perplexity (pruned)", f"{tokens.perplexity(lp):.2f}")
base_dir = dense_base_path(loaded)
n_params = sum(p.numel() for p in loaded.model.parameters())
# a large dense base is a second large model in memory: loaded only when asked for
ask = base_dir and n_params > 50_000_000 and not m[3].toggle(f"compare with the dense base ({Path(base_dir).name})",
                                                              key="prune_base")
if base_dir and not ask:
    try:
        base_lp = cached_logprobs(str(Path(base_dir)), tuple(view.ids))
        m[3].metric("perplexity (dense base)", f"{tokens.perplexity(base_lp):.2f}")
    except (CheckpointError, ValueError) as e:
        m[3].caption(f"dense base {base_dir}: {e}")
elif not base_dir:
    m[3].caption("no dense base recorded on this model's card")

layer = st.selectbox("Layer", range(cfg.n_layers), key="prune_layer")
st.markdown(pruning.struck_text_html(table, layer), unsafe_allow_html=True)
st.caption("Struck through: dropped by this layer before the end of the text (hover for when and by which token).")

fig = pruning.token_layer_figure(table, f"{cfg.mixer}: tokens dropped per layer")
st.plotly_chart(fig, width="stretch")
export_buttons(fig, table, "pruning_tokens_by_layer", loaded.path, text, settings, key="tokmap")

rates = pruning.pos_drop_rates(table)
heat = pruning.pos_heatmap(rates, "share of tokens dropped, by part of speech and layer")
st.plotly_chart(heat, width="stretch")
export_buttons(heat, rates, "pruning_pos_by_layer", loaded.path, text, settings, key="pos")

counts = pruning.trigger_counts(table)
if len(counts):
    trig = pruning.triggers_figure(counts, "which parts of speech trigger drops")
    st.plotly_chart(trig, width="stretch")
    export_buttons(trig, counts, "pruning_triggers", loaded.path, text, settings, key="trig")
else:
    st.info("No token is dropped in this text.")
st.dataframe(sp.style.format({"sparsity": "{:.1%}"}), hide_index=True)
