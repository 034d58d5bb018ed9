"""Head geometry: MHE head embeddings (e^Q, e^K, e^V, and g_i for MHE-MUL), or for per-head-projection
models (MHA, MQA, SKV, EL-ATT, SHA) each head's projection matrix flattened, so the two views compare."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from models.mixers.attention import Attention
from models.mixers.mhe import MHE, MHEMul


def head_vectors(model) -> dict[str, np.ndarray]:
    """kind -> [layers, heads, dim]. Kinds: e_Q, e_K, e_V, g (MHE-MUL's 1+.. product) for MHE models;
    W_Q, W_K, W_V, W_KV (those with more than one head: W_K and W_V of GQA per K/V group) for the others.
    Empty for Extractors."""
    out: dict[str, list[np.ndarray]] = {}
    for block in model.blocks:
        m = block.mixer
        if not isinstance(m, Attention):
            return {}
        if isinstance(m, MHE):
            vecs = {"e_Q": m.e_Q, "e_K": m.e_K, "e_V": m.e_V}
            if isinstance(m, MHEMul):
                vecs["g"] = m.query_scale()
        else:
            # per-head projections; with grouped K/V (GQA imports) W_K, W_V have one entry per K/V group
            vecs = {name: w.permute(1, 0, 2).flatten(1) for name in ("W_Q", "W_K", "W_V", "W_KV")
                    if (w := getattr(m, name, None)) is not None and w.shape[1] > 1}
        for k, v in vecs.items():
            out.setdefault(k, []).append(v.detach().float().cpu().numpy())
    return {k: np.stack(v) for k, v in out.items()}


def pca(x: np.ndarray, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x projected on their top-k principal axes, and the share of variance each explains."""
    centred = (x - x.mean(0, keepdims=True)).astype(np.float64)
    # through the n x n Gram matrix: n rows (layers x heads, a few hundred) are far fewer than their width
    # (a flattened W_Q head of SmolLM2 is 36,864 wide), so this is ~30x faster than an SVD of x itself
    evals, evecs = np.linalg.eigh(centred @ centred.T)
    order = np.argsort(evals)[::-1]
    evals, evecs = np.clip(evals[order], 0, None), evecs[:, order]
    k = min(k, len(evals))
    var = evals / max(evals.sum(), 1e-30)
    return evecs[:, :k] * np.sqrt(evals[:k]), var[:k]


def cosine(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    y = x / np.maximum(n, 1e-12)
    return y @ y.T


def geometry_table(vectors: np.ndarray, dims: int = 2) -> tuple[pd.DataFrame, np.ndarray]:
    """PCA of all heads of all layers together; one row per (layer, head)."""
    L, H, _ = vectors.shape
    coords, var = pca(vectors.reshape(L * H, -1), dims)
    df = pd.DataFrame(coords, columns=[f"pc{i + 1}" for i in range(coords.shape[1])])
    df.insert(0, "layer", np.repeat(np.arange(L), H))
    df.insert(1, "head", np.tile(np.arange(H), L))
    df["norm"] = np.linalg.norm(vectors.reshape(L * H, -1), axis=1)
    return df, var


def norms_table(vectors: dict[str, np.ndarray]) -> pd.DataFrame:
    rows = [{"kind": k, "layer": l, "head": h, "norm": float(np.linalg.norm(v[l, h]))}
            for k, v in vectors.items() for l in range(v.shape[0]) for h in range(v.shape[1])]
    return pd.DataFrame(rows)


LEGEND_LAYERS = 12  # up to this many layers, one legend entry (colour) each; more: a colour bar over the layers


def pca_figure(df: pd.DataFrame, var: np.ndarray, title: str) -> go.Figure:
    # a legend of 30 layers does not fit the figure's height (it stopped at layer 16): deep models get a colour bar
    discrete = df["layer"].nunique() <= LEGEND_LAYERS
    df = df.assign(layer=df["layer"].astype(str) if discrete else df["layer"], label="H" + df["head"].astype(str))
    axes = {f"pc{i + 1}": f"PC{i + 1} ({var[i]:.0%})" for i in range(len(var))}
    style = {} if discrete else {"color_continuous_scale": "Viridis"}
    if "pc3" in df:
        fig = px.scatter_3d(df, x="pc1", y="pc2", z="pc3", color="layer", text="label", labels=axes, title=title,
                            hover_data=["head", "norm"], **style)
    else:
        fig = px.scatter(df, x="pc1", y="pc2", color="layer", text="label", labels=axes, title=title,
                         hover_data=["head", "norm"], **style)
        fig.update_traces(textposition="top center", marker={"size": 10})
    fig.update_layout(legend_title_text="layer", height=520)
    return fig


def cosine_figure(vectors: np.ndarray, layer: int, title: str) -> go.Figure:
    c = cosine(vectors[layer])
    H = c.shape[0]
    fig = go.Figure(go.Heatmap(z=c, x=[f"H{i}" for i in range(H)], y=[f"H{i}" for i in range(H)], colorscale="RdBu",
                               zmin=-1, zmax=1, hovertemplate="%{y} · %{x}: %{z:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, height=460)
    return fig


def norms_figure(df: pd.DataFrame, title: str) -> go.Figure:
    fig = px.line(df, x="layer", y="norm", color="kind", line_group=df["kind"] + df["head"].astype(str),
                  markers=True, hover_data=["head"], title=title)
    fig.update_layout(height=420)
    return fig
