"""Heads: where each head sits. MHE: its head embeddings. MHA, SHA, MQA, SKV, EL-ATT, GQA: its QK and OV circuits
(analysis/heads.py says why not the flattened projections)."""
import streamlit as st

from analysis import heads
from app import heavy
from app.common import export_buttons, load, pick_model, setup

KIND_HELP = {
    "e_Q": "query head embeddings e_i^Q", "e_K": "key head embeddings e_i^K", "e_V": "value head embeddings e_i^V",
    "g": "MHE-MUL's effective per-head query scaling g_i = (1+e_i^Q)(1+e_i^K)",
    **heads.CIRCUIT_HELP,
}


@st.cache_resource(max_entries=4, show_spinner="Collecting the head embeddings…")
def cached_vectors(path: str):
    """MHE models' head embeddings [layers, heads, d_h] per kind: once per model."""
    with heavy.slot():
        return heads.head_vectors(load(path).model)


@st.cache_resource(max_entries=4, show_spinner="Inner products of every head's QK and OV circuits…")
def cached_grams(path: str):
    """The circuits' Gram matrices [layers x heads]^2 (270 x 270 for SmolLM2): once per model."""
    with heavy.slot():
        return heads.circuit_grams(load(path).model)


@st.cache_data(max_entries=16, show_spinner="PCA…")
def cached_geometry(path: str, kind: str, dims: int, unit: bool = False):
    # inputs before the slot: never wait on another cache's lock while holding one
    grams, vectors = cached_grams(path), cached_vectors(path)
    n_heads = load(path).config.n_heads
    with heavy.slot():
        if kind in grams:
            return heads.circuit_table(grams[kind], n_heads, dims, unit)
        return heads.geometry_table(vectors[kind], dims)


def no_heads(loaded):
    if not cached_grams(str(loaded.path)) and not cached_vectors(str(loaded.path)):
        return "no attention heads to compare (an Extractor)."
    return None


def show(loaded, col, key: str):
    path, cfg = str(loaded.path), loaded.config
    grams, vec = cached_grams(path), cached_vectors(path)
    circuits = bool(grams)
    kind = col.selectbox("Circuit" if circuits else "Vectors", list(grams or vec), key=f"{key}_kind",
                         format_func=lambda k: f"{k}: {KIND_HELP[k]}")
    what = f"{kind} circuits" if circuits else kind
    dims = col.radio("PCA", [2, 3], horizontal=True, key=f"{key}_dims", format_func=lambda d: f"{d}-D")
    unit = circuits and col.checkbox("Directions only (each circuit scaled to norm 1, as the cosine below)",
                                     value=True, key=f"{key}_unit")
    geo, var = cached_geometry(path, kind, dims, unit)
    fig = heads.pca_figure(geo, var, f"{cfg.mixer}: {what}{', unit norm' if unit else ''}, all layers")
    col.plotly_chart(fig, width="stretch", key=f"{key}_pca")
    with col:
        export_buttons(fig, geo, f"heads_pca_{cfg.mixer}_{kind}", loaded.path, None,
                       {"kind": kind, "dims": dims, **({"unit_norm": unit} if circuits else {})}, key=f"{key}_pca")
    H = cfg.n_heads
    # circuits are maps of the one residual stream, so heads compare across layers too; MHE's embeddings of
    # different layers sit in different layers' W^Q, W^K, W^V
    layers = ([None] if circuits else []) + list(range(cfg.n_layers))
    layer = col.selectbox("Cosine similarity of", layers, key=f"{key}_layer",
                          format_func=lambda i: "all layers' heads" if i is None else f"layer {i}")
    if circuits:
        sim = heads.gram_cosine(grams[kind])
        sim = sim if layer is None else sim[layer * H:(layer + 1) * H, layer * H:(layer + 1) * H]
    else:
        sim = heads.cosine(vec[kind][layer])
    where = "all layers" if layer is None else f"layer {layer}"
    cos = heads.similarity_figure(sim, H, f"{cfg.mixer}: cosine similarity of {what}, {where}", layer)
    col.plotly_chart(cos, width="stretch", key=f"{key}_cos")
    with col:
        export_buttons(cos, lambda: heads.similarity_table(sim, H, layer),   # (built when CSV is clicked)
                       f"heads_cosine_{cfg.mixer}_{kind}_{'all' if layer is None else f'l{layer}'}",
                       loaded.path, None, {"kind": kind, "layer": layer}, key=f"{key}_cos")
    norms = heads.circuit_norms_table(grams, H) if circuits else heads.norms_table(vec)
    nf = heads.norms_figure(norms, f"{cfg.mixer}: {'Frobenius norms of the circuits' if circuits else 'vector norms'}"
                                   " per layer and head")
    col.plotly_chart(nf, width="stretch", key=f"{key}_norms")
    with col:
        export_buttons(nf, norms, f"heads_norms_{cfg.mixer}", loaded.path, None, {}, key=f"{key}_norms")


setup("Heads")
st.caption("MHE models: the head embeddings themselves, coordinates in the layer's one shared W^Q, W^K, W^V. "
           "MHA, SHA, MQA, SKV, EL-ATT and GQA: each head's QK circuit W_Q^i W_K^iT and OV circuit W_V^i W_O^i. "
           "A head's own W_Q^i, W_K^i can be turned by any change of basis inside the head (W_Q^i M with W_K^i "
           "M^-T is the same head), so their flattened weights are not compared; the circuits do not change. "
           "With rotary positions the QK circuit is the position-free product (offset 0).")
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
