"""Attention: per layer and head maps for a text (an Extractor's effective mixing matrix instead)."""
import streamlit as st

from analysis import lags, maps
from app import heavy
from app.common import export_buttons, load, model_text_tokens, setup, window_picker

from analysis.views import ATTENTION_VIEW as MAX_VIEW  # tokens per view; a window selector for the rest


@st.cache_data(max_entries=32, show_spinner="Running the model…")
def cached_view(path: str, ids: tuple[int, ...], summary: str | None):
    """(maps, kind, overview title) as maps.mixing_view draws them (an Extractor's magnitudes need no forward)."""
    with heavy.slot():
        return maps.mixing_view(load(path).model, list(ids), summary)


@st.cache_data(max_entries=8, show_spinner=False)
def cached_lags(path: str):
    return lags.lag_table(load(path).model)


setup("Attention")
loaded, text, toks = model_text_tokens(default="mha")
cfg = loaded.config
view, start = window_picker(toks, cfg.context, "attn_window", MAX_VIEW)
# Extractors: the lag weights summarised over channels. The signed mean of SHE's d x d lag matrices cancels, so
# SHE shows their Frobenius norm (the norm of d x_ext_i / d x_j); WE/HE offer the RMS beside the signed mean.
summary = None
if maps.is_extractor(loaded.model):
    summary = lags.default_summary(cfg.mixer)
    if cfg.mixer in ("we", "he"):
        summary = st.radio("Lag weights over channels", ["mean", "rms"], horizontal=True, key="attn_summary",
                           format_func=lags.SUMMARIES.get)
m, kind, overview_title = cached_view(str(loaded.path), tuple(view.ids), summary)
signed = summary == "mean"          # lag maps of both signs: a diverging colour scale about 0

if cfg.mixer == "mhe-add":
    st.info("MHE-ADD: the key head embedding e^K shifts every score in a softmax row by the same amount, so it "
            "has no effect on these maps (and gets no gradient). Heads differ only through e^Q and e^V.")
if cfg.mixer == "mhe-mul":
    st.info("MHE-MUL: every head shares one K and V; head i scales the query by g_i = (1+e_i^Q)(1+e_i^K) "
            "and the output by 1+e_i^V.")
if summary is not None:
    what = {"mean": "the effective mixing weight of past token j on token i (mean over channels)",
            "rms": "the RMS over channels of the lag weight that mixes past token j into token i",
            "fro": "how strongly past token j is mixed into token i: the norm of d x_ext_i / d x_j, the "
                   "Frobenius norm of the lag's d x d matrix W^ext (the mean of its entries, of both signs, cancels)",
            }[summary]
    st.info(f"Extractors have no attention: shown is {what}, the lags laid out as a causal Toeplitz matrix. It does "
            "not depend on the text except through its length; the adjustment term (X W^adj) scales it per token "
            "and channel.")

st.subheader("Overview")
# (overview_figure draws any kind but "extractor", the signed mean, on the one-sided scale)
fig = maps.overview_figure(m, kind, f"{cfg.mixer}: {overview_title}" if overview_title else "")
st.plotly_chart(fig, width="stretch")
export_buttons(fig, lambda: maps.maps_table(m, view.labels), "maps_overview", loaded.path, text,
               {"window_start": start, "tokens": len(view.ids), **({"summary": summary} if summary else {})})

if cfg.mixer == "she":
    st.subheader("Norm per lag")
    table = cached_lags(str(loaded.path))
    norms = lags.profile_figure(table, "fro", "she: Frobenius norm of W^ext per lag (= norm of d x_ext_i / d x_j), "
                                "per layer")
    st.plotly_chart(norms, width="stretch")
    export_buttons(norms, table[["layer", "lag", "fro"]], "she_lag_norms", loaded.path, None, {}, key="lag_norms")


@st.fragment
def zoom_view():
    """The zoomed map: its selectors redraw this part alone (the overview above is not sent again)."""
    st.subheader("Zoom")
    c1, c2 = st.columns(2)
    layer = c1.selectbox("Layer", range(cfg.n_layers), index=cfg.n_layers - 1, key="attn_layer")
    head = c2.selectbox("Head", range(m.shape[1]), key="attn_head") if m.shape[1] > 1 else 0
    title = f"{cfg.mixer}: layer {layer}" + (f", head {head}" if kind == "attention" else
                                             f" (mixing, {lags.SUMMARIES[summary]})")
    zoom = maps.map_figure(m[layer, head], view.labels, title, colorscale="RdBu" if signed else "Viridis",
                           zmid=0.0 if signed else None)
    st.plotly_chart(zoom, width="stretch")
    export_buttons(zoom, maps.maps_table(m[layer:layer + 1, head:head + 1], view.labels, layer, head),
                   f"map_l{layer}_h{head}", loaded.path, text, {"layer": layer, "head": head, "window_start": start},
                   key="zoom")


zoom_view()
