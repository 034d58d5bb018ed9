"""Head geometry: where each head sits, measured in a basis that every head shares, so heads can be compared.

- MHE models (head_vectors): the head embeddings e^Q, e^K, e^V (and MHE-MUL's g_i). Every head of a layer reads
  the one shared W^Q, W^K, W^V, so its embeddings are coordinates in one common basis.
- Per-head-projection models (MHA, SHA, MQA, SKV, EL-ATT, GQA imports such as SmolLM2; circuit_grams): each head's
  QK circuit W_Q^i W_K^iT and OV circuit W_V^i W_O^i, both d_m x d_m maps of the residual stream. A head's own
  W_Q^i, W_K^i, W_V^i are not identifiable: W_Q^i M with W_K^i M^-T (and W_V^i M with M^-1 W_O^i), for any
  invertible d_h x d_h M, is the same head, so the cosine or PCA of flattened projections measures that arbitrary
  choice of basis. The circuits are invariant to it, and as maps of the shared residual stream they compare across
  layers too.

Rotary positions (SmolLM2): the score of query position n against key position m is
x_n W_Q^i R_(n-m) W_K^iT x_m^T, R_D the block rotation by D times each rotary frequency. The QK circuit shown is
the position-free product W_Q^i W_K^iT (the D = 0 slice, a token against itself). It is invariant under every
invertible M, while the model itself is invariant only under those M that commute with every R_D: a rotation
(and scaling) inside each of the d_h / 2 rotary planes (coordinates k and k + d_h / 2 in Llama's half split). Two
heads with equal circuits can therefore still differ at other offsets; no head's circuit depends on an arbitrary
basis. OV circuits carry no rotation. Biases (b_Q, b_K, b_V of attn_bias models) and the 1/sqrt(d_h) scale (the
same for every head) are left out.

The Gram matrix of circuits is built from d_h x d_h products only (circuit_gram), never from the d_m x d_m
circuits themselves: at SmolLM2's 270 heads those would be 270 x 576^2 floats per kind, and at a 4,096-wide model
they would not fit in memory. Cosine similarity and PCA are then read off the Gram matrix (kernel PCA of the
centred Gram matrix is PCA of the flattened circuits).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import torch

from analysis.budgets import HEADS_BLOCK, HEADS_FLAT_BYTES
from analysis.plain import plotly_text
from models.mixers.attention import Attention
from models.mixers.mhe import MHE, MHEMul

CIRCUITS = ("QK", "OV")
CIRCUIT_HELP = {"QK": "QK circuits W_Q^i W_K^iT (which tokens a head matches)",
                "OV": "OV circuits W_V^i W_O^i (what a head writes back)"}


def head_vectors(model) -> dict[str, np.ndarray]:
    """MHE models: kind -> [layers, heads, d_h] for e_Q, e_K, e_V, and g (MHE-MUL's (1+e^Q)(1+e^K)).
    Empty for every other model (per-head-projection models: circuit_grams)."""
    out: dict[str, list[np.ndarray]] = {}
    for block in model.blocks:
        m = block.mixer
        if not isinstance(m, MHE):
            return {}
        vecs = {"e_Q": m.e_Q, "e_K": m.e_K, "e_V": m.e_V}
        if isinstance(m, MHEMul):
            vecs["g"] = m.query_scale()
        for k, v in vecs.items():
            out.setdefault(k, []).append(v.detach().float().cpu().numpy())
    return {k: np.stack(v) for k, v in out.items()}


class Factors(NamedTuple):
    """Head i's circuit is left[left_of[i]] @ right[right_of[i]].T; a factor several heads share (a K/V group's
    W_K or W_V) is held once. left, right [distinct factors, d_m, d_h]; left_of, right_of [heads]."""
    left: torch.Tensor
    left_of: torch.Tensor
    right: torch.Tensor
    right_of: torch.Tensor

    def to(self, dtype) -> Factors:
        return self._replace(left=self.left.to(dtype), right=self.right.to(dtype))


def circuit_factors(mixer) -> dict[str, Factors] | None:
    """QK: (W_Q^i, W_K of head i's group); OV: (W_V of head i's group, (W_O^i)^T). None for a mixer without
    per-head projections (MHE, Extractors)."""
    if not isinstance(mixer, Attention) or isinstance(mixer, MHE):
        return None
    n, d_h = mixer.n_heads, mixer.d_head

    def per_head(w):  # stored [d_m, heads, d_h] -> [heads, d_m, d_h]
        return w.detach().permute(1, 0, 2)

    heads = torch.arange(n, device=mixer.W_Q.device)
    if getattr(mixer, "W_KV", None) is not None:      # SKV: K_i = V_i = X W_i^KV
        k = v = per_head(mixer.W_KV)
    elif getattr(mixer, "W_K", None) is not None:     # MHA, SHA, MQA, GQA: one per K/V group
        k, v = per_head(mixer.W_K), per_head(mixer.W_V)
    else:                                             # EL-ATT: K_i = V_i = X_i, slice i of the identity
        d_m = mixer.W_Q.shape[0]
        k = v = per_head(torch.eye(d_m, dtype=mixer.W_Q.dtype, device=mixer.W_Q.device).view(d_m, n, d_h))
    group = heads // (n // k.shape[0])                # head i reads group i // (n / groups) (kernels.reference)
    o = mixer.W_O.detach().reshape(n, d_h, -1).transpose(1, 2)   # W_O^i: rows i*d_h..(i+1)*d_h of W_O, transposed
    return {"QK": Factors(per_head(mixer.W_Q), heads, k, group), "OV": Factors(v, group, o, heads)}


def _cross(f: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[len(rows), d_h, len(cols), d_h]: f[rows[a]]^T f[cols[b]], each distinct pair of factors multiplied once."""
    ur, rows = torch.unique(rows, return_inverse=True)
    uc, cols = torch.unique(cols, return_inverse=True)
    x = torch.einsum("amd,bme->adbe", f[ur], f[uc])
    return x[rows][:, :, cols]


def circuit_gram(factors: list[Factors], budget: int = HEADS_BLOCK, method: str = "auto") -> np.ndarray:
    """Frobenius inner products of every head's circuit, heads of all layers in order ([n, n] float64):
    <L_a R_a^T, L_b R_b^T> = tr(R_a L_a^T L_b R_b^T) = sum((L_a^T L_b) * (R_a^T R_b)),
    d_h x d_h products only ("gram"). Blocks of heads keep each [rows, d_h, cols, d_h] product under `budget`
    numbers. That costs n^2 d_h^2 d_m multiply-adds; the flattened circuits' own Gram ("flat") costs
    n d_m^2 (d_h + n), less when d_m < d_h^2, and holds n d_m^2 numbers: "auto" takes it then, within
    analysis.budgets.HEADS_FLAT_BYTES (SmolLM2: 270 heads, d_m 576, d_h 64: 358 MB; both kinds in 3.2 s against
    14.7 s on 2 CPU threads)."""
    def stack(side: int) -> tuple[torch.Tensor, torch.Tensor]:
        mats, idx, at = [], [], 0
        for f in factors:
            m, i = (f.left, f.left_of) if side == 0 else (f.right, f.right_of)
            mats.append(m)
            idx.append(i + at)   # distinct factors of all layers in one stack: offset each layer's indices
            at += len(m)
        return torch.cat(mats), torch.cat(idx)

    (left, li), (right, ri) = stack(0), stack(1)
    n, d_m, d_h = len(li), left.shape[1], left.shape[-1]
    if method == "flat" or (method == "auto" and d_m < d_h * d_h
                            and n * d_m * d_m * left.element_size() <= HEADS_FLAT_BYTES):
        flat = torch.bmm(left[li], right[ri].transpose(1, 2)).reshape(n, -1)   # [n, d_m^2]
        return (flat @ flat.T).double().cpu().numpy()
    step = max(1, int(budget ** 0.5) // d_h)
    gram = torch.empty(n, n, dtype=torch.float64)
    for a in range(0, n, step):
        r = slice(a, a + step)
        for b in range(a, n, step):   # the Gram matrix is symmetric: upper blocks, mirrored
            c = slice(b, b + step)
            block = (_cross(left, li[r], li[c]) * _cross(right, ri[r], ri[c])).sum((1, 3)).double().cpu()
            gram[r, c] = block
            gram[c, r] = block.T
    return gram.numpy()


@torch.no_grad()
def circuit_grams(model, dtype=torch.float32) -> dict[str, np.ndarray]:
    """'QK' and 'OV' -> the Gram matrix [layers * heads, layers * heads] of the circuits (layer-major). Empty for
    models without per-head projections (MHE: head_vectors; Extractors)."""
    per_layer = [circuit_factors(b.mixer) for b in model.blocks]
    if not per_layer or any(f is None for f in per_layer):
        return {}
    return {kind: circuit_gram([f[kind].to(dtype) for f in per_layer]) for kind in CIRCUITS}


def _components(centred_gram: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k principal coordinates from a centred Gram matrix, and the share of variance each explains."""
    evals, evecs = np.linalg.eigh(centred_gram)
    order = np.argsort(evals)[::-1]
    evals, evecs = np.clip(evals[order], 0, None), evecs[:, order]
    k = min(k, len(evals))
    var = evals / max(evals.sum(), 1e-30)
    return evecs[:, :k] * np.sqrt(evals[:k]), var[:k]


def pca(x: np.ndarray, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x projected on their top-k principal axes, and the share of variance each explains."""
    centred = (x - x.mean(0, keepdims=True)).astype(np.float64)
    # through the n x n Gram matrix: n rows (layers x heads) are often far fewer than their width
    return _components(centred @ centred.T, k)


def gram_pca(gram: np.ndarray, k: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """pca() of the vectors whose Gram matrix this is, without them: centring the vectors is J G J (kernel PCA)."""
    g = np.asarray(gram, dtype=np.float64)
    centred = g - g.mean(0, keepdims=True) - g.mean(1, keepdims=True) + g.mean()
    return _components((centred + centred.T) / 2, k)


def cosine(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    y = x / np.maximum(n, 1e-12)
    return y @ y.T


def gram_cosine(gram: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np.clip(np.diag(gram), 1e-24, None))
    return gram / norm[:, None] / norm[None, :]


def _head_frame(coords: np.ndarray, layers: int, heads: int, norms: np.ndarray) -> pd.DataFrame:
    df = pd.DataFrame(coords, columns=[f"pc{i + 1}" for i in range(coords.shape[1])])
    df.insert(0, "layer", np.repeat(np.arange(layers), heads))
    df.insert(1, "head", np.tile(np.arange(heads), layers))
    df["norm"] = norms
    return df


def geometry_table(vectors: np.ndarray, dims: int = 2) -> tuple[pd.DataFrame, np.ndarray]:
    """PCA of all heads of all layers together; one row per (layer, head)."""
    L, H, _ = vectors.shape
    flat = vectors.reshape(L * H, -1)
    coords, var = pca(flat, dims)
    return _head_frame(coords, L, H, np.linalg.norm(flat, axis=1)), var


def circuit_table(gram: np.ndarray, n_heads: int, dims: int = 2, unit: bool = False) -> tuple[pd.DataFrame, np.ndarray]:
    """Kernel PCA of one kind of circuit over all heads of all layers; one row per (layer, head), with the
    circuit's Frobenius norm. unit: PCA of the circuits scaled to norm 1 (their Gram matrix is then the cosine
    similarity), so that a few large heads (SmolLM2's layer 0) do not take the whole picture."""
    coords, var = gram_pca(gram_cosine(gram) if unit else gram, dims)
    norms = np.sqrt(np.clip(np.diag(gram), 0, None))
    return _head_frame(coords, len(gram) // n_heads, n_heads, norms), var


def norms_table(vectors: dict[str, np.ndarray]) -> pd.DataFrame:
    rows = [{"kind": k, "layer": l, "head": h, "norm": float(np.linalg.norm(v[l, h]))}
            for k, v in vectors.items() for l in range(v.shape[0]) for h in range(v.shape[1])]
    return pd.DataFrame(rows)


def circuit_norms_table(grams: dict[str, np.ndarray], n_heads: int) -> pd.DataFrame:
    """Frobenius norm of every head's circuits, one row per (kind, layer, head)."""
    rows = [{"kind": k, "layer": i // n_heads, "head": i % n_heads, "norm": float(np.sqrt(max(g[i, i], 0.0)))}
            for k, g in grams.items() for i in range(len(g))]
    return pd.DataFrame(rows)


def head_labels(n: int, n_heads: int, layer: int | None = None) -> list[str]:
    """'H2' within one layer; 'L3 H2' over all layers (layer None, n = layers x heads)."""
    if layer is not None:
        return [f"H{i}" for i in range(n)]
    return [f"L{i // n_heads} H{i % n_heads}" for i in range(n)]


def similarity_table(sim: np.ndarray, n_heads: int, layer: int | None = None) -> pd.DataFrame:
    """Long form of a heads x heads similarity (one layer's block, or every head of every layer)."""
    n = len(sim)
    a, b = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    first = 0 if layer is None else layer * n_heads
    return pd.DataFrame({"layer_a": (first + a.ravel()) // n_heads, "head_a": a.ravel() % n_heads,
                         "layer_b": (first + b.ravel()) // n_heads, "head_b": b.ravel() % n_heads,
                         "cosine": sim.ravel()})


LEGEND_LAYERS = 12  # up to this many layers, one legend entry (colour) each; more: a colour bar over the layers
LABELLED_POINTS = 100  # up to this many heads, each point names its head; more (SmolLM2: 270) only on hovering


def pca_figure(df: pd.DataFrame, var: np.ndarray, title: str) -> go.Figure:
    # a legend of 30 layers does not fit the figure's height (it stopped at layer 16): deep models get a colour bar
    discrete = df["layer"].nunique() <= LEGEND_LAYERS
    df = df.assign(layer=df["layer"].astype(str) if discrete else df["layer"], label="H" + df["head"].astype(str))
    axes = {f"pc{i + 1}": f"PC{i + 1} ({var[i]:.0%})" for i in range(len(var))}
    style = {} if discrete else {"color_continuous_scale": "Viridis"}
    if len(df) <= LABELLED_POINTS:
        style["text"] = "label"
    hover = ["layer", "head", "norm"]
    if "pc3" in df:
        fig = px.scatter_3d(df, x="pc1", y="pc2", z="pc3", color="layer", labels=axes, title=plotly_text(title),
                            hover_data=hover, **style)
    else:
        fig = px.scatter(df, x="pc1", y="pc2", color="layer", labels=axes, title=plotly_text(title), hover_data=hover,
                         **style)
        fig.update_traces(textposition="top center", marker={"size": 10 if "text" in style else 8})
    fig.update_layout(legend_title_text="layer", height=520)
    return fig


def similarity_figure(sim: np.ndarray, n_heads: int, title: str, layer: int | None = None) -> go.Figure:
    """Cosine similarity heatmap: one layer's heads (layer given, sim its block), or every head of every layer
    (one tick per layer; hovering names layer and head)."""
    labels = head_labels(len(sim), n_heads, layer)
    # the colour scale spans the off-diagonal values (the diagonal, 1, saturates): 270 nearly orthogonal circuits
    # would otherwise all read as white
    off = np.abs(sim[~np.eye(len(sim), dtype=bool)])
    lim = float(min(1.0, max(off.max() if off.size else 1.0, 1e-3)))
    fig = go.Figure(go.Heatmap(z=sim.astype(np.float32), x=labels, y=labels, colorscale="RdBu", zmin=-lim, zmax=lim,
                               colorbar={"title": {"text": "cosine"}},
                               hovertemplate="%{y} · %{x}: %{z:.3f}<extra></extra>"))
    if layer is None and n_heads > 1:
        ticks = {"tickvals": labels[::n_heads], "ticktext": [f"L{i}" for i in range(len(sim) // n_heads)]}
        fig.update_xaxes(**ticks)
        fig.update_yaxes(**ticks)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=plotly_text(title), height=460 if layer is not None else 640)
    return fig


def cosine_figure(vectors: np.ndarray, layer: int, title: str) -> go.Figure:
    return similarity_figure(cosine(vectors[layer]), vectors.shape[1], title, layer)


def norms_figure(df: pd.DataFrame, title: str) -> go.Figure:
    fig = px.line(df, x="layer", y="norm", color="kind", line_group=df["kind"] + df["head"].astype(str),
                  markers=True, hover_data=["head"], title=plotly_text(title))
    fig.update_layout(height=420)
    return fig
