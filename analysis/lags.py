"""Extractor lag weights: how much each lag (distance to the past token) contributes, per layer.

Summaries of a lag's weights over channels: 'mean' (signed), 'rms', and 'fro', the Frobenius norm of the lag's
weights, which is the norm of the Jacobian d x_ext_i / d x_j at lag i - j (SHE: that Jacobian is W^ext transposed;
WE/HE: diag(w^ext), for HE with respect to X'; ME: |w|, its Jacobian w I having norm |w| sqrt(d)).
SHE's mean over a d x d matrix sums signed entries that cancel, so it says little about how much a lag mixes in:
its norm does. WE/HE show mean and RMS side by side (the mean tells the common sign, the RMS the size)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from analysis.plain import plotly_text
from models.mixers.extractor import Extractor


def extractor_layers(model) -> list[Extractor]:
    return [b.mixer for b in model.blocks if isinstance(b.mixer, Extractor)]


SUMMARIES = {"mean": "signed mean over channels", "rms": "RMS over channels", "fro": "Frobenius norm"}
# the Overview's title for the magnitudes (the signed mean keeps maps.overview_figure's own)
OVERVIEW_TITLES = {"fro": "norm of d x_ext_i / d x_j (the Frobenius norm of W^ext at lag i - j), per layer",
                   "rms": "RMS over channels of the lag weights, per layer"}


def default_summary(mixer: str) -> str:
    """What a page or an export shows of an Extractor's lags unless asked: SHE's Frobenius norm (the signed mean of
    its d x d matrices cancels), the signed mean for the others."""
    return "fro" if mixer == "she" else "mean"


def lag_table(model) -> pd.DataFrame:
    """One row per (layer, lag): RMS, signed mean and Frobenius norm ('fro') of the lag's weights over channels
    (ME: the scalar itself; SHE: over the d x d matrix)."""
    rows = []
    for layer, m in enumerate(extractor_layers(model)):
        prof = {k: v.float().tolist() for k, v in m.lag_profile().items()}
        for lag, (rms, mean, f) in enumerate(zip(prof["rms"], prof["mean"], prof["fro"])):
            rows.append({"layer": layer, "lag": lag, "rms": rms, "mean": mean, "fro": f})
    return pd.DataFrame(rows)


def profile_view(table: pd.DataFrame, mixer: str, log_x: bool = True) -> tuple[go.Figure, str]:
    """(figure, value) the Extractors page opens on: WE/HE the signed mean beside the RMS; ME its lag weight itself;
    SHE the Frobenius norm of each lag's d x d matrix (the mean of its signed entries cancels)."""
    if mixer in ("we", "he"):   # a signed mean near 0 can hide large weights of both signs: the RMS gives their size
        return mean_rms_figure(table, f"{mixer}: the lag's weights over channels, signed mean and RMS, per layer",
                               log_x=log_x), "mean and rms"
    value = "mean" if mixer == "me" else "fro"
    label = "the lag weight w_k" if value == "mean" else "Frobenius norm of the lag's d x d matrix W^ext"
    return profile_figure(table, value, f"{mixer}: {label}, per layer", log_x=log_x), value


def lag_maps(model, t: int, value: str = "fro") -> np.ndarray:
    """[layers, 1, t, t]: one summary of each Extractor layer's lag weights laid out as a causal Toeplitz matrix
    (Extractor.mixing_matrix), entry (i, j) the lag i - j's value (0 above the diagonal). With 'mean' it is the
    mixing matrix the forward records; with 'fro' entry (i, j) is the norm of d x_ext_i / d x_j."""
    return np.stack([m.mixing_matrix(t, summary=value).double().cpu().numpy()[None]
                     for m in extractor_layers(model)])


def lag_channel(model, layer: int) -> np.ndarray:
    """[lags, channels] for WE/HE; for SHE the per-lag matrix norms [lags, 1]; for ME the scalars [lags, 1]."""
    w = extractor_layers(model)[layer].w_ext.detach().float().cpu().numpy()
    if w.ndim == 1:
        return w[:, None]
    if w.ndim == 3:
        return np.linalg.norm(w, axis=(1, 2))[:, None]
    return w


def mass_in_first(table: pd.DataFrame, k: int) -> pd.DataFrame:
    """Share of each layer's squared lag weight that sits in lags 0..k-1."""
    t = table.assign(sq=table["rms"] ** 2)
    total = t.groupby("layer")["sq"].sum()
    first = t[t["lag"] < k].groupby("layer")["sq"].sum()
    return pd.DataFrame({"layer": total.index, f"share_first_{k}": (first / total).values})


def profile_figure(table: pd.DataFrame, value: str, title: str, log_x: bool = True) -> go.Figure:
    df = table.assign(lag1=table["lag"] + 1, layer=table["layer"].astype(str))
    fig = px.line(df, x="lag1", y=value, color="layer", log_x=log_x, title=plotly_text(title),
                  labels={"lag1": "lag + 1 (the paper's index k of w_k)", value: SUMMARIES.get(value, value)})
    if value == "mean":
        fig.add_hline(y=0, line_dash="dot", line_color="grey")
    fig.update_layout(height=420)
    return fig


def mean_rms_figure(table: pd.DataFrame, title: str, log_x: bool = True) -> go.Figure:
    """The signed mean and the RMS over channels side by side, per layer: a mean near zero can hide large
    weights of both signs."""
    df = table.melt(id_vars=["layer", "lag"], value_vars=["mean", "rms"], var_name="summary", value_name="weight")
    df = df.assign(lag1=df["lag"] + 1, layer=df["layer"].astype(str),
                   summary=df["summary"].map({"mean": "signed mean", "rms": "RMS"}))
    fig = px.line(df, x="lag1", y="weight", color="layer", facet_col="summary", facet_col_spacing=0.07, log_x=log_x,
                  title=plotly_text(title), labels={"lag1": "lag + 1 (the paper's index k of w_k)",
                                                    "weight": "over channels"})
    fig.update_yaxes(matches=None, showticklabels=True)   # the two summaries have their own scales
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.add_hline(y=0, line_dash="dot", line_color="grey", col=1)
    fig.update_layout(height=420)
    return fig


def lag_channel_figure(m: np.ndarray, title: str, max_lags: int | None = None) -> go.Figure:
    z = m[:max_lags] if max_lags else m
    lim = float(np.abs(z).max()) or 1.0
    fig = go.Figure(go.Heatmap(z=z.T, colorscale="RdBu", zmid=0, zmin=-lim, zmax=lim,
                               hovertemplate="lag %{x}, channel %{y}: %{z:.4f}<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="lag", yaxis_title="channel", height=460)
    return fig


def cumulative_figure(table: pd.DataFrame, title: str) -> go.Figure:
    t = table.assign(sq=table["rms"] ** 2).sort_values(["layer", "lag"])
    t["share"] = t.groupby("layer")["sq"].cumsum() / t.groupby("layer")["sq"].transform("sum")
    t = t.assign(lag1=t["lag"] + 1, layer=t["layer"].astype(str))
    fig = px.line(t, x="lag1", y="share", color="layer", log_x=True, title=plotly_text(title),
                  labels={"lag1": "first k lags", "share": "share of squared weight"})
    fig.update_layout(height=380, yaxis_range=[0, 1.02])
    return fig
