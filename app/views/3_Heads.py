"""Heads: where the head embeddings (MHE) or per-head projections (MHA, MQA, SKV, EL-ATT) sit."""
import streamlit as st

from analysis import heads
from app import heavy
from app.common import export_buttons, load, pick_model, setup

KIND_HELP = {
    "e_Q": "query head embeddings e_i^Q", "e_K": "key head embeddings e_i^K", "e_V": "value head embeddings e_i^V",
    "g": "MHE-MUL's effective per-head query scaling g_i = (1+e_i^Q)(1+e_i^K)",
    "W_Q": "per-head query projections W_i^Q (flattened)",
    "W_K": "per-head (GQA: per-group) key projections W_i^K (flattened)",
    "W_V": "per-head (GQA: per-group) value projections W_i^V (flattened)",
    "W_KV": "SKV's per-head key=value projections W_i^KV",
}


@st.cache_resource(max_entries=4, show_spinner="Collecting per-head vectors…")
def cached_vectors(path: str):
    """Every layer's per-head vectors, flattened (30 layers x 9 heads x 36,864 for SmolLM2's W_Q): once per model."""
    with heavy.slot():
        return heads.head_vectors(load(path).model)


@st.cache_data(max_entries=16, show_spinner="PCA…")
def cached_geometry(path: str, kind: str, dims: int):
    vectors = cached_vectors(path)[kind]   # before the slot: never wait on another cache's lock while holding one
    with heavy.slot():
        return heads.geometry_table(vectors, dims)


def no_heads(loaded):
    if not cached_vectors(str(loaded.path)):
        return "no per-head parameters to compare (an Extractor, or a single head)."
    return None


def show(loaded, col, key: str):
    vec = cached_vectors(str(loaded.path))
    cfg = loaded.config
    kind = col.selectbox("Vectors", list(vec), key=f"{key}_kind", format_func=lambda k: f"{k}: {KIND_HELP[k]}")
    dims = col.radio("PCA", [2, 3], horizontal=True, key=f"{key}_dims", format_func=lambda d: f"{d}-D")
    geo, var = cached_geometry(str(loaded.path), kind, dims)
    fig = heads.pca_figure(geo, var, f"{cfg.mixer}: {kind}, all layers")
    col.plotly_chart(fig, width="stretch", key=f"{key}_pca")
    with col:
        export_buttons(fig, geo, f"heads_pca_{cfg.mixer}_{kind}", loaded.path, None, {"kind": kind, "dims": dims},
                       key=f"{key}_pca")
    layer = col.selectbox("Layer for cosine similarity", range(cfg.n_layers), key=f"{key}_layer")
    cos = heads.cosine_figure(vec[kind], layer, f"{cfg.mixer}: cosine similarity of {kind}, layer {layer}")
    col.plotly_chart(cos, width="stretch", key=f"{key}_cos")
    import pandas as pd
    with col:
        export_buttons(cos, pd.DataFrame(heads.cosine(vec[kind][layer])), f"heads_cosine_{cfg.mixer}_{kind}_l{layer}",
                       loaded.path, None, {"kind": kind, "layer": layer}, key=f"{key}_cos")
    norms = heads.norms_table(vec)
    nf = heads.norms_figure(norms, f"{cfg.mixer}: vector norms per layer and head")
    col.plotly_chart(nf, width="stretch", key=f"{key}_norms")
    with col:
        export_buttons(nf, norms, f"heads_norms_{cfg.mixer}", loaded.path, None, {}, key=f"{key}_norms")


setup("Heads")
st.caption("MHE models: the head embeddings themselves. MHA, MQA, SKV and EL-ATT: each head's own projection "
           "matrix, flattened, so the geometry of heads can be put side by side.")
side = st.sidebar.checkbox("Side by side with a second model", value=False, key="heads_side")
loaded = pick_model(accept=no_heads, default="mhe-mul")
if loaded is None:
    st.stop()
if loaded.config.mixer == "mhe-add":
    st.info("MHE-ADD: e^K has no effect on the output and gets no gradient, so it stays where it was initialised.")
if side:
    other = pick_model("Second model", key="model2", accept=no_heads, default="mha")
    left, right = st.columns(2)
    show(loaded, left, "a")
    if other is not None:
        show(other, right, "b")
else:
    show(loaded, st.container(), "a")
