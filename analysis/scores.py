"""Why the learned rule dropped what it dropped, one layer at a time: the interaction scores x_{n,j}, how close
each token's fate came to the threshold, one score split over the r interaction dimensions, and the soft keep
structure the alpha-sigmoid gave while training (docs/methods.md). Inputs are a layer's recorded q_int, k_int
(models.mixers.LayerRecord, in the precision the rule decided in); figures are pure functions of them."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from analysis.plain import plotly_text
from analysis.views import SCORES_VIEW as VIEW  # queries x keys drawn at once, whatever the text's length
from analysis.maps import layer_records
from kernels.keep_rule import distance_term, gates, keep_from_gates
from models.pruning.interaction import mean_sparsity


def recorded(model, ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer, (q_int, k_int) [T, r] of one text from one diagnostic forward without attention maps (on SmolLM2
    at 1,024 tokens: 30 x 2 x 256 KB)."""
    return [(r.q_int[0].cpu().numpy(), r.k_int[0].cpu().numpy()) for r in layer_records(model, ids, False)]


@torch.no_grad()
def layer_scores(rule, q_int, k_int) -> torch.Tensor:
    """x_{n,j} [T,T] of one layer (rule: its ContextPruning) from its record's q_int, k_int ([1,T,r] tensors or
    [T,r] arrays), computed where the rule lives."""
    dev = rule.beta.device
    q, k = (torch.as_tensor(a, device=dev) for a in (q_int, k_int))
    q, k = (a[None] if a.dim() == 2 else a for a in (q, k))
    pos = torch.arange(q.shape[1], device=dev)
    return rule.scores_of(q, k, pos, pos)[0]


def fates(x: torch.Tensor, sinks: int) -> pd.DataFrame:
    """Per key position j: the query that dropped it (its trigger: the first n > j with x_{n,j} <= 0; -1 if it
    outlived the text), and its closest call, the query n in (j, trigger] (or (j, T-1]) whose score was nearest the
    threshold: |x| small means a small change to either token's vector flips the decision. The first `sinks`
    positions are never scored; the last has no later query."""
    t = x.shape[0]
    x = x.detach().double().cpu()
    n = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    later = n > j
    below = later & ~(x > 0) & (j >= sinks)   # the step keeps x > 0 only (a NaN score drops, as in the forward)
    trigger = torch.where(below.any(0), below.int().argmax(0), torch.full((t,), -1))  # first True along n
    end = torch.where(trigger >= 0, trigger, torch.full((t,), t - 1))
    scored = later & (n <= end[None, :]) & (j >= sinks)
    dist = torch.where(scored, x.abs(), torch.full_like(x, math.inf))
    closest = dist.argmin(0)
    has = scored.any(0)
    rows = [{"position": p, "fate": "dropped" if trigger[p] >= 0 else "kept",
             "dropped_at": int(trigger[p]), "closest_query": int(closest[p]), "score": float(x[closest[p], p])}
            for p in range(t) if has[p]]
    return pd.DataFrame(rows, columns=["position", "fate", "dropped_at", "closest_query", "score"])


def fragile(table: pd.DataFrame, labels: list[str], top: int = 20) -> pd.DataFrame:
    """The `top` tokens whose fate was closest to going the other way (smallest |score| at their closest call)."""
    out = table.assign(margin=table["score"].abs()).nsmallest(top, "margin").drop(columns="margin")
    out.insert(1, "token", [labels[p] for p in out["position"]])
    out.insert(4, "query token", [labels[q] for q in out["closest_query"]])
    return out.reset_index(drop=True)


def score_figure(x: torch.Tensor, table: pd.DataFrame, start: int, labels: list[str], title: str,
                 sinks: int = 0) -> go.Figure:
    """Heatmap of x_{n,j} over queries and keys start..start+VIEW, diverging at the threshold 0 (red: would
    drop, blue: keeps); blank above the diagonal, after a token was dropped and on the sinks: nothing is scored
    there."""
    t = x.shape[0]
    stop = min(t, start + VIEW)
    z = x.detach().double().cpu().numpy()[start:stop, start:stop].copy()
    n, j = np.arange(start, stop)[:, None], np.arange(start, stop)[None, :]
    trig = np.full(t, t, dtype=np.int64)
    trig[table["position"].to_numpy()] = np.where(table["dropped_at"] >= 0, table["dropped_at"], t)
    z[(j >= n) | (n > trig[start:stop][None, :]) | (j < sinks)] = np.nan
    lim = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
    tick = [f"{p} {plotly_text(labels[p])}" for p in range(start, stop)]   # (tokens: drawn as their characters)
    fig = go.Figure(go.Heatmap(z=z.astype(np.float32), x=tick, y=tick, zmid=0, zmin=-lim, zmax=lim,
                               colorscale="RdBu", colorbar={"title": "x<sub>n,j</sub>"},
                               hovertemplate="query %{y}<br>key %{x}<br>x = %{z:.3f}<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="key j", yaxis_title="query n",
                      yaxis_autorange="reversed", height=640, xaxis_showticklabels=stop - start <= 64,
                      yaxis_showticklabels=stop - start <= 64)
    return fig


@torch.no_grad()
def split(rule, q_int: torch.Tensor, k_int: torch.Tensor, n: int, j: int) -> pd.DataFrame:
    """x_{n,j} term by term: each interaction dimension's q_d k_d / sqrt(r), beta, and the distance term (when the
    rule has one); the terms sum to x_{n,j}."""
    q_int, k_int = (torch.as_tensor(a) for a in (q_int, k_int))
    q_int, k_int = (a[None] if a.dim() == 2 else a for a in (q_int, k_int))
    q, k = q_int[0, n].double().cpu(), k_int[0, j].double().cpu()
    parts = (q * k / math.sqrt(rule.r)).tolist()
    rows = [{"term": f"dim {d}", "value": v} for d, v in enumerate(parts)]
    rows.append({"term": "beta", "value": float(rule.beta)})
    if rule.lam is not None:
        d = distance_term(rule.lam.detach().double().cpu(), torch.tensor(j), torch.tensor(n))
        rows.append({"term": "distance", "value": float(d)})
    return pd.DataFrame(rows)


def split_figure(terms: pd.DataFrame, top: int, title: str) -> go.Figure:
    """Bars of the `top` dimensions by |contribution|, the other dimensions summed, beta and the distance term."""
    dims = terms[terms["term"].str.startswith("dim ")]
    big = dims.reindex(dims["value"].abs().sort_values(ascending=False).index[:top])
    rest = dims.drop(big.index)
    shown = pd.concat([big, pd.DataFrame([{"term": f"other {len(rest)} dims", "value": rest["value"].sum()}])
                       if len(rest) else None, terms[~terms["term"].str.startswith("dim ")]])
    fig = go.Figure(go.Bar(x=shown["term"], y=shown["value"],
                           marker_color=["#d62728" if v < 0 else "#1f77b4" for v in shown["value"]]))
    fig.update_layout(title=plotly_text(title), yaxis_title="contribution to x<sub>n,j</sub>", height=380)
    return fig


@torch.no_grad()
def soft_keep(x: torch.Tensor, alpha: float, sinks: int) -> torch.Tensor:
    """I_{k,j} under sigma_alpha (training's soft rule; alpha = inf is the step inference uses) [T,T]."""
    return keep_from_gates(gates(x.detach(), alpha, sinks))


def soft_sparsity(keep: torch.Tensor) -> float:
    """The share of earlier tokens a query no longer sees, averaged over the queries that have any (I soft or 0/1)."""
    return float(mean_sparsity(keep, count_first=False))


def soft_table(keep: torch.Tensor, start: int, labels: list[str]) -> pd.DataFrame:
    """What soft_figure draws, long form: one row per (query k, key j <= k) in the drawn block."""
    stop = min(keep.shape[0], start + VIEW)
    z = keep.detach().double().cpu().numpy()[start:stop, start:stop]
    k, j = np.tril_indices(stop - start)
    lab = np.asarray(labels, dtype=object)
    return pd.DataFrame({"query": start + k, "key": start + j, "query_token": lab[start + k],
                         "key_token": lab[start + j], "keep": z[k, j]})


def soft_figure(keep: torch.Tensor, start: int, labels: list[str], title: str) -> go.Figure:
    """Heatmap of I_{k,j} (0 dropped, 1 kept) over queries and keys start..start+VIEW; blank above the diagonal."""
    stop = min(keep.shape[0], start + VIEW)
    z = keep.detach().double().cpu().numpy()[start:stop, start:stop].copy()
    z[np.arange(start, stop)[None, :] > np.arange(start, stop)[:, None]] = np.nan
    tick = [f"{p} {plotly_text(labels[p])}" for p in range(start, stop)]
    fig = go.Figure(go.Heatmap(z=z.astype(np.float32), x=tick, y=tick, zmin=0, zmax=1, colorscale="Viridis",
                               colorbar={"title": "I<sub>k,j</sub>"},
                               hovertemplate="query %{y}<br>key %{x}<br>I = %{z:.3f}<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="key j", yaxis_title="query k",
                      yaxis_autorange="reversed", height=640, xaxis_showticklabels=stop - start <= 64,
                      yaxis_showticklabels=stop - start <= 64)
    return fig
