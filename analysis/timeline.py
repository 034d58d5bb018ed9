"""How a pruning rule came to be: a run's snapshots (models.snapshots) replayed on one fixed text. Per snapshot: the
sparsity of each layer, the drop rate of each part of speech per layer, and how the first tokens are held (the sinks).
Model in, tables and figures out; the model itself is never changed (the snapshots go into a copy).
"""
from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis import pruning
from analysis.plain import plotly_text
from models import snapshots

SINK_TOKENS = 4   # "the sinks": how much of the text's first tokens the later queries still see


def sink_share(keeps: np.ndarray, first: int = SINK_TOKENS) -> np.ndarray:
    """[layers]: the share of (query, token) pairs, token among the first `first` and query after it, the query
    still sees (keeps [L,T,T])."""
    t = keeps.shape[-1]
    first = min(first, t - 1)
    q, j = np.tril_indices(t, -1)
    mask = j < first
    return keeps[:, q[mask], j[mask]].mean(1) if mask.any() else np.ones(len(keeps))


def at_snapshot(model, snap: dict, ids: list[int], tags: list[str], labels: list[str]) -> dict:
    """One snapshot on one text (its tensors put into a copy of `model`, which may be shared and is left as it is;
    snapshots.SnapshotError when the snapshot is not one of this model's):
    {"step": (step, alpha, mean sparsity, sink share), "layers": per layer sparsity and sink share, "pos": per layer
    and part of speech, tokens and drop rate}."""
    trained = snapshots.snapshot_names(snap["path"])
    # the copy shares every parameter the snapshot leaves alone (SmolLM2: 8.8 MB of its 540 copied, not all of it)
    work = copy.deepcopy(model, memo={id(p): p for n, p in model.named_parameters() if n not in trained})
    snapshots.load_into(work, snap["path"])
    keeps, _ = pruning.keeps_and_logprobs(work, ids)
    del work
    sp = pruning.sparsity_per_layer(keeps)["sparsity"].to_numpy()
    sink = sink_share(keeps)
    return {"step": {"step": snap["step"], "alpha": snap["alpha"], "sparsity": float(sp.mean()),
                     "sink_share": float(sink.mean())},
            "layers": pd.DataFrame({"step": snap["step"], "layer": np.arange(len(sp)), "sparsity": sp,
                                    "sink_share": sink}),
            "pos": pruning.pos_drop_rates(pruning.token_table(keeps, labels, tags)).assign(step=snap["step"])}


def join(parts: list[dict]) -> dict:
    """at_snapshot's answers, in step order, as three tables: "steps", "layers", "pos"."""
    parts = sorted(parts, key=lambda p: p["step"]["step"])
    return {"steps": pd.DataFrame([p["step"] for p in parts]),
            "layers": pd.concat([p["layers"] for p in parts], ignore_index=True),
            "pos": pd.concat([p["pos"] for p in parts], ignore_index=True)}


def steps_figure(steps: pd.DataFrame, at: int, title: str) -> go.Figure:
    """Mean sparsity and the sinks' share held over the snapshots, the chosen one marked."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps["step"], y=steps["sparsity"], mode="lines+markers", name="sparsity",
                             customdata=steps["alpha"], hovertemplate="step %{x} (alpha %{customdata:.2f}): "
                                                                      "%{y:.1%}<extra>sparsity</extra>"))
    fig.add_trace(go.Scatter(x=steps["step"], y=steps["sink_share"], mode="lines+markers", line_dash="dot",
                             name=f"first {SINK_TOKENS} tokens still seen"))
    fig.add_vline(x=at, line_dash="dash", line_color="#777")
    fig.update_layout(title=plotly_text(title), xaxis_title="training step", yaxis_title="share", yaxis_range=[0, 1],
                      yaxis_tickformat=".0%", height=340)
    return fig


def layers_figure(layers: pd.DataFrame, step: int, title: str) -> go.Figure:
    """Each layer's sparsity at one snapshot, beside the last one's."""
    last = layers["step"].max()
    fig = go.Figure()
    for s, name in ((last, f"step {last} (the last snapshot)"), (step, f"step {step}"))[:1 if step == last else 2]:
        d = layers[layers["step"] == s]
        fig.add_trace(go.Bar(x=d["layer"], y=d["sparsity"], name=name))
    fig.update_layout(title=plotly_text(title), xaxis_title="layer", yaxis_title="sparsity", yaxis_range=[0, 1],
                      yaxis_tickformat=".0%", barmode="group", height=320)
    return fig
