"""Attention maps (or an Extractor's effective mixing matrix) for a text: arrays -> tables -> figures."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from models.mixers import LayerRecord
from models.mixers.extractor import Extractor
from models.transformer import evaluating


@torch.inference_mode()
def layer_records(model, ids: list[int], attention_maps: bool = True) -> list[LayerRecord]:
    """One inference forward over the text with diagnostics: what each layer recorded (attention_maps=False:
    keep masks only)."""
    model.check_fits(len(ids))
    with evaluating(model):
        return model(torch.tensor([ids], device=model.wte.weight.device), diagnostics=True,
                     attention_maps=attention_maps).diagnostics


def mixing_maps(model, ids: list[int]) -> tuple[np.ndarray, str]:
    """[layers, heads, T, T] and the kind: 'attention' (probabilities per head) or 'extractor'
    (the lag weights as a causal Toeplitz matrix, channel mean, one 'head' per layer)."""
    records = layer_records(model, ids)
    if records[0].attn is not None:
        return np.stack([d.attn[0].float().cpu().numpy() for d in records]), "attention"
    return np.stack([d.mixing[None].float().cpu().numpy() for d in records]), "extractor"


def is_extractor(model) -> bool:
    return isinstance(model.blocks[0].mixer, Extractor)


def maps_table(maps: np.ndarray, labels: list[str]) -> pd.DataFrame:
    """Long form: one row per (layer, head, query, key) with key <= query."""
    L, H, T, _ = maps.shape
    layer, head, q, k = np.meshgrid(np.arange(L), np.arange(H), np.arange(T), np.arange(T), indexing="ij")
    keep = (k <= q).ravel()
    df = pd.DataFrame({"layer": layer.ravel()[keep], "head": head.ravel()[keep], "query_pos": q.ravel()[keep],
                       "key_pos": k.ravel()[keep], "weight": maps.ravel()[keep]})
    lab = np.asarray(labels, dtype=object)
    df["query_token"], df["key_token"] = lab[df["query_pos"]], lab[df["key_pos"]]
    return df


def _masked(m: np.ndarray) -> np.ndarray:
    out = m.astype(float).copy()
    out[np.triu_indices_from(out, k=1)] = np.nan   # the future: blank, not zero-coloured
    return out


def pooled(m: np.ndarray, cells: int) -> np.ndarray:
    """Average-pool a [T,T] map to at most cells x cells (the future, NaN, stays blank where a whole
    block is in the future)."""
    t = m.shape[0]
    f = -(-t // cells)
    if f == 1:
        return m
    pad = (-t) % f
    x = np.pad(m, ((0, pad), (0, pad)), constant_values=np.nan)
    blocks = x.reshape(x.shape[0] // f, f, x.shape[1] // f, f)
    count = np.isfinite(blocks).sum(axis=(1, 3))
    total = np.nansum(blocks, axis=(1, 3))
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def overview_figure(maps: np.ndarray, kind: str, title: str = "", cells: int = 64) -> go.Figure:
    """A layers x heads grid of small maps, each averaged down to at most cells x cells (the zoomed map
    shows every token; this keeps the grid light in the browser)."""
    L, H = maps.shape[:2]
    fig = make_subplots(rows=L, cols=H, horizontal_spacing=0.01, vertical_spacing=0.02,
                        row_titles=[f"L{i}" for i in range(L)], column_titles=[f"H{j}" for j in range(H)] if H > 1 else None)
    for i in range(L):
        for j in range(H):
            fig.add_trace(go.Heatmap(z=pooled(_masked(maps[i, j]), cells), coloraxis="coloraxis",
                                     hovertemplate=f"layer {i} head {j}<br>%{{z:.3f}}<extra></extra>"),
                          row=i + 1, col=j + 1)
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=False, autorange="reversed")
    cscale = "RdBu" if kind == "extractor" else "Viridis"
    fig.update_layout(coloraxis={"colorscale": cscale}, height=max(300, 110 * L + 80), title=title or
                      ("attention probabilities, layers x heads" if kind == "attention" else "Extractor mixing weights per layer"),
                      margin={"l": 40, "r": 20, "t": 70, "b": 20})
    return fig


def map_figure(m: np.ndarray, labels: list[str], title: str, colorscale: str = "Viridis", zmid: float | None = None) -> go.Figure:
    """One map with readable token labels on both axes (positions, so repeated tokens stay apart)."""
    T = len(labels)
    ticks = list(range(T))
    step = max(1, T // 60)  # keep labels legible on long windows
    fig = go.Figure(go.Heatmap(z=_masked(m), colorscale=colorscale, zmid=zmid,
                               customdata=np.array([[f"{labels[k]} → {labels[q]}" for k in range(T)] for q in range(T)]),
                               hovertemplate="%{customdata}<br>query %{y}, key %{x}: %{z:.4f}<extra></extra>"))
    fig.update_xaxes(tickvals=ticks[::step], ticktext=labels[::step], tickangle=-60, title="key (attended to)")
    fig.update_yaxes(tickvals=ticks[::step], ticktext=labels[::step], autorange="reversed", title="query")
    fig.update_layout(title=title, height=max(420, min(900, 14 * T + 200)), margin={"l": 80, "r": 20, "t": 60, "b": 80})
    return fig


def difference_figure(a: np.ndarray, b: np.ndarray, labels: list[str], title: str) -> go.Figure:
    return map_figure(a - b, labels, title, colorscale="RdBu", zmid=0.0)
