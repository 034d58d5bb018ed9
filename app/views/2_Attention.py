"""Attention: per layer and head maps for a text (an Extractor's effective mixing matrix instead)."""
import streamlit as st

from analysis import maps
from app import heavy
from app.common import export_buttons, load, model_text_tokens, setup, window_picker

MAX_VIEW = 128  # tokens per view: beyond this a window selector keeps the page responsive


@st.cache_data(max_entries=32, show_spinner="Running the model…")
def cached_maps(path: str, ids: tuple[int, ...]):
    with heavy.slot():
        return maps.mixing_maps(load(path).model, list(ids))


setup("Attention")
loaded, text, toks = model_text_tokens(default="mha")
cfg = loaded.config
view, start = window_picker(toks, cfg.context, "attn_window", MAX_VIEW)
m, kind = cached_maps(str(loaded.path), tuple(view.ids))

if cfg.mixer == "mhe-add":
    st.info("MHE-ADD: the key head embedding e^K shifts every score in a softmax row by the same amount, so it "
            "has no effect on these maps (and gets no gradient). Heads differ only through e^Q and e^V.")
if cfg.mixer == "mhe-mul":
    st.info("MHE-MUL: every head shares one K and V; head i scales the query by g_i = (1+e_i^Q)(1+e_i^K) "
            "and the output by 1+e_i^V.")
if kind == "extractor":
    st.info("Extractors have no attention: shown is the effective mixing weight of past token j on token i, "
            "the lag weights laid out as a causal Toeplitz matrix (mean over channels). It does not depend on "
            "the text except through its length; the adjustment term (X W^adj) scales it per token and channel.")

st.subheader("Overview")
fig = maps.overview_figure(m, kind)
st.plotly_chart(fig, width="stretch")
export_buttons(fig, lambda: maps.maps_table(m, view.labels), "maps_overview", loaded.path, text,
               {"window_start": start, "tokens": len(view.ids)})

@st.fragment
def zoom_view():
    """The zoomed map: its selectors redraw this part alone (the overview above is not sent again)."""
    st.subheader("Zoom")
    c1, c2 = st.columns(2)
    layer = c1.selectbox("Layer", range(cfg.n_layers), index=cfg.n_layers - 1, key="attn_layer")
    head = c2.selectbox("Head", range(m.shape[1]), key="attn_head") if m.shape[1] > 1 else 0
    title = f"{cfg.mixer}: layer {layer}" + (f", head {head}" if kind == "attention" else " (mixing)")
    zoom = maps.map_figure(m[layer, head], view.labels, title,
                           colorscale="RdBu" if kind == "extractor" else "Viridis",
                           zmid=0.0 if kind == "extractor" else None)
    st.plotly_chart(zoom, width="stretch")
    export_buttons(zoom, maps.maps_table(m[layer:layer + 1, head:head + 1], view.labels), f"map_l{layer}_h{head}",
                   loaded.path, text, {"layer": layer, "head": head, "window_start": start}, key="zoom")


zoom_view()
