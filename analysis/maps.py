"""Attention maps (or an Extractor's effective mixing matrix) for a text: arrays -> tables -> figures."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from analysis.axes import position_axis, position_names
from analysis.plain import plotly_text
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


def mixing_view(model, ids: list[int], summary: str | None = None) -> tuple[np.ndarray, str, str]:
    """(maps, kind for overview_figure, overview title: '' for its own) as the Attention page opens on them:
    attention probabilities; an Extractor's lags by `summary` (lags.default_summary unless given). The magnitudes
    ('fro', 'rms') need no forward: they are the weights laid out by lag."""
    from analysis import lags
    if is_extractor(model):
        summary = summary or lags.default_summary(model.config.mixer)
        if summary != "mean":
            model.check_fits(len(ids))
            return lags.lag_maps(model, len(ids), summary), "lag-size", lags.OVERVIEW_TITLES[summary]
    m, kind = mixing_maps(model, ids)
    return m, kind, ""


def is_extractor(model) -> bool:
    return isinstance(model.blocks[0].mixer, Extractor)


def maps_table(maps: np.ndarray, labels: list[str], first_layer: int = 0, first_head: int = 0) -> pd.DataFrame:
    """Long form: one row per (layer, head, query, key) with key <= query. For a slice of the maps, first_layer
    and first_head name its first layer and head, so the rows keep the model's numbering."""
    L, H, T, _ = maps.shape
    layer, head, q, k = np.meshgrid(first_layer + np.arange(L), first_head + np.arange(H), np.arange(T),
                                    np.arange(T), indexing="ij")
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


OVERVIEW_CELLS = 160_000  # the whole grid's cells: one image in the browser, however many layers and heads


def overview_grid(maps: np.ndarray, cells: int = 64, budget: int = OVERVIEW_CELLS) -> tuple[np.ndarray, int, int]:
    """The [L,H,T,T] maps as one image: each map averaged down (pooled) to a tile of at most cells x cells, and
    smaller when L x H tiles would pass `budget` cells, tiles one blank (NaN) row/column apart
    -> (grid, tile side, positions per tile cell)."""
    L, H, T = maps.shape[:3]
    side = int(max(8, min(cells, (budget / (L * H)) ** 0.5)))
    f = -(-T // side)             # pooled's block: positions per tile cell
    s = -(-T // f)                # the tile's side
    grid = np.full((L * (s + 1) - 1, H * (s + 1) - 1), np.nan)
    for i in range(L):
        for j in range(H):
            grid[i * (s + 1):i * (s + 1) + s, j * (s + 1):j * (s + 1) + s] = pooled(_masked(maps[i, j]), side)
    return grid, s, f


def overview_figure(maps: np.ndarray, kind: str, title: str = "", cells: int = 64) -> go.Figure:
    """A layers x heads grid of small maps drawn as one heatmap (a few hundred panels would take the browser tens of
    seconds at 30 layers), each map averaged down to a tile; the zoomed map shows every token. Hovering names the
    layer, head and the positions a cell averages."""
    L, H, T = maps.shape[:3]
    grid, s, f = overview_grid(maps, cells)

    def names(count: int, what: str, first: str) -> list[str]:
        # one category per grid row/column (unique, so plotly keeps them apart); the blank separators too
        out = []
        for i in range(count):
            out += [f"{first} {i}, {what} {r * f}-{min((r + 1) * f, T) - 1}" for r in range(s)]
            out += [f"{first} {i} |"] if i < count - 1 else []
        return out

    rows = names(L, "queries", "layer")
    cols = names(H, "keys", "head") if H > 1 else [f"keys {r * f}-{min((r + 1) * f, T) - 1}" for r in range(s)]
    extractor = kind == "extractor"
    fig = go.Figure(go.Heatmap(z=grid.astype(np.float32), x=cols, y=rows, hoverongaps=False,
                               colorscale="RdBu" if extractor else "Viridis", zmid=0.0 if extractor else None,
                               hovertemplate="%{y}<br>%{x}<br>%{z:.3f}<extra></extra>"))
    centre = s // 2
    fig.update_yaxes(autorange="reversed", tickvals=[rows[i * (s + 1) + centre] for i in range(L)],
                     ticktext=[f"L{i}" for i in range(L)], tickfont={"size": 10})
    fig.update_xaxes(tickvals=[cols[j * (s + 1) + centre] for j in range(H)] if H > 1 else [],
                     ticktext=[f"H{j}" for j in range(H)] if H > 1 else [], side="top")
    fig.update_layout(height=max(320, min(1600, 48 * L + 120)), title=plotly_text(title) or
                      ("attention probabilities, layers x heads" if kind == "attention"
                       else "Extractor mixing weights per layer"),
                      margin={"l": 50, "r": 20, "t": 90, "b": 20})
    return fig


def map_figure(m: np.ndarray, labels: list[str], title: str, colorscale: str = "Viridis",
               zmid: float | None = None) -> go.Figure:
    """One map with readable token labels on both axes (one category per position, so repeated tokens stay
    apart; hovering a cell names its query and key). The tokens and the title are raw text, drawn as their
    characters (the axis names escape the tokens, analysis.axes)."""
    T = len(labels)
    names = position_names(labels)
    fig = go.Figure(go.Heatmap(z=_masked(m).astype(np.float32), x=names, y=names, colorscale=colorscale, zmid=zmid,
                               hoverongaps=False,
                               hovertemplate="query %{y}<br>key %{x}<br>%{z:.4f}<extra></extra>"))
    fig.update_xaxes(**position_axis(labels, names), tickangle=-60, title="key (attended to)")
    fig.update_yaxes(**position_axis(labels, names), autorange="reversed", title="query")
    fig.update_layout(title=plotly_text(title), height=max(420, min(900, 14 * T + 200)),
                      margin={"l": 80, "r": 20, "t": 60, "b": 80})
    return fig


def difference_figure(a: np.ndarray, b: np.ndarray, labels: list[str], title: str) -> go.Figure:
    return map_figure(a - b, labels, title, colorscale="RdBu", zmid=0.0)
