"""Live generation views, from a trace (models.trace.build): the token x layer strip of what each layer holds,
the text with dropped tokens faded, cache bytes and latency over steps, and the pruned-vs-dense summary.
Pure: trace in, DataFrame / Figure / HTML out."""
from __future__ import annotations

import statistics
from itertools import cycle

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from analysis.views import LIVE_STRIP as MAX_STRIP  # tokens drawn in a strip (the last ones)
from analysis.plain import plotly_text
from analysis.tokens import html_text
from models.trace import held_at

HELD, DROPPED, UNSEEN = 1.0, 0.0, np.nan


def labels_of(trace: dict, tokenizer) -> list[str]:
    """One readable label per position (prompt and generated)."""
    return [tokenizer.decode([t]).replace("\n", "⏎") for t in trace["prompt_ids"] + trace["new_ids"]]


def steps_frame(trace: dict) -> pd.DataFrame:
    return pd.DataFrame([{k: v for k, v in s.items() if k != "live_per_layer"} for s in trace["steps"]])


def runs_frame(traces: dict[str, dict]) -> pd.DataFrame:
    """Every run's steps, one table: what the figures drawing several runs export (a "model" column names each)."""
    return pd.concat([steps_frame(tr).assign(model=name) for name, tr in traces.items()], ignore_index=True)


def drops_frame(trace: dict, labels: list[str]) -> pd.DataFrame:
    rows = [{"layer": d["layer"], "position": d["position"], "token": labels[d["position"]], "step": d["step"],
             "trigger": d["trigger"], "trigger_token": labels[d["trigger"]]} for d in trace["drops"]]
    return pd.DataFrame(rows, columns=["layer", "position", "token", "step", "trigger", "trigger_token"])


def held_fraction(trace: dict, step: int) -> np.ndarray:
    """Per token seen by `step`: the share of layers still holding it."""
    held = np.array(held_at(trace, step), dtype=float)
    return held.mean(0) if held.size else np.zeros(0)


def strip_figure(trace: dict, step: int, labels: list[str], title: str) -> go.Figure:
    """Layers x tokens at `step`: held, dropped (hover: by which token, at which step) or not yet generated."""
    seen = len(trace["prompt_ids"]) + step
    total = len(trace["prompt_ids"]) + len(trace["new_ids"])
    start = max(0, total - MAX_STRIP)
    z = np.full((trace["n_layers"], total - start), UNSEEN)
    held = np.array(held_at(trace, step), dtype=float)
    z[:, :max(0, seen - start)] = held[:, start:]
    note = np.full(z.shape, "", dtype=object)
    for d in trace["drops"]:
        if d["trigger"] <= seen - 1 and d["position"] >= start:
            by = plotly_text(repr(labels[d["trigger"]]))   # (a token: text, never plotly's HTML)
            note[d["layer"], d["position"] - start] = f"dropped at step {d['step']} by {by} (pos {d['trigger']})"
    words = np.array([[plotly_text(w) for w in labels[start:]]] * trace["n_layers"], dtype=object)
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(start, total)), colorscale=[[0, "#c0392b"], [1, "#d6e9f8"]], zmin=0, zmax=1, showscale=False,
        customdata=np.dstack([words, note]), hoverongaps=False,
        hovertemplate="%{customdata[0]} (pos %{x}), layer %{y}: %{customdata[1]}<extra>blue held, red dropped</extra>"))
    fig.add_vline(x=len(trace["prompt_ids"]) - 0.5, line_dash="dot", line_color="#555")
    fig.update_xaxes(title=f"position (prompt | generated){' — the last %d' % MAX_STRIP if start else ''}")
    fig.update_yaxes(title="layer", autorange="reversed")
    fig.update_layout(title=plotly_text(title), height=120 + max(160, 14 * trace["n_layers"]), plot_bgcolor="#f4f4f4")
    return fig


def cache_curve_figure(traces: dict[str, dict], title: str) -> go.Figure:
    """Held and allocated cache bytes per step, and what a dense cache would hold."""
    fig = go.Figure()
    for (name, tr), colour in zip(traces.items(), cycle(px.colors.qualitative.Plotly)):
        df = steps_frame(tr)   # a run's held and allocated share its colour (and legend group)
        name = plotly_text(name)   # (a run's name holds a model's: text, never plotly's HTML)
        fig.add_trace(go.Scatter(x=df["step"], y=df["held_bytes"] / 2**20, mode="lines", name=f"{name}: held",
                                 line_color=colour, legendgroup=name))
        fig.add_trace(go.Scatter(x=df["step"], y=df["alloc_bytes"] / 2**20, mode="lines", line_dash="dot",
                                 line_color=colour, legendgroup=name, name=f"{name}: allocated"))
    first = next(iter(traces.values()))
    df = steps_frame(first)
    fig.add_trace(go.Scatter(x=df["step"], y=df["dense_bytes"] / 2**20, mode="lines",
                             line=dict(color="#777", dash="dash"), name="dense cache (K, V of every token)"))
    fig.update_layout(title=plotly_text(title), xaxis_title="step (generated tokens)", yaxis_title="cache (MiB)",
                      height=340)
    return fig


def latency_curve_figure(traces: dict[str, dict], title: str) -> go.Figure:
    fig = go.Figure()
    for name, tr in traces.items():
        df = steps_frame(tr)
        fig.add_trace(go.Scatter(x=df["step"][1:], y=df["model_ms"][1:], mode="lines", name=plotly_text(name),
                                 customdata=df["token"][1:].map(plotly_text),
                                 hovertemplate="%{customdata}: %{y:.2f} ms<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="step (the first, with the prefill, left out)",
                      yaxis_title="model ms per token", height=320)
    return fig


def faded_text_html(labels: list[str], n_prompt: int, held: np.ndarray) -> str:
    """Tokens seen so far, each as opaque as the share of layers (or the one layer) still holding it; the
    generated part is underlined. Labels beyond `held` (the token sampled at this step, which enters the cache
    at the next) are drawn whole with a dashed underline."""
    out = []
    for i, tok in enumerate(labels):
        text = html_text(tok.replace("⏎", "\n"))   # (one line: a line break is a reference, see html_text)
        if i >= len(held):
            out.append(f'<span title="pos {i}: sampled at this step, not yet in the cache" '
                       f'style="border-bottom:2px dashed #2e86c1">{text}</span>')
            continue
        h = float(held[i])
        style = f"opacity:{0.18 + 0.82 * h:.2f}" + (";border-bottom:2px solid #2e86c1" if i >= n_prompt else "")
        out.append(f'<span title="pos {i}: held by {h:.0%}" style="{style}">{text}</span>')
    return '<div style="white-space:pre-wrap;line-height:1.7">' + "".join(out) + "</div>"


def decode_ms(trace: dict) -> float:
    """Median model time of the steps after the first (which carries the prefill)."""
    ms = [s["model_ms"] for s in trace["steps"][1:]]
    return statistics.median(ms) if ms else float("nan")


def saved(own: float, twin: float) -> float:
    """The one definition of "saved": the share of the twin's bytes this model does without (negative when it
    uses more)."""
    return 1 - own / twin if twin else float("nan")


def twin_summary(pruned: dict, dense: dict) -> dict:
    """The pruned model against its twin on the same prompt and seed, after the last step: cache held and
    allocated, each saved against the twin's; the median decode-step latency ratio; each model's perplexity of
    its own sampled output (a sampling statistic: analysis.twin prices pruning on the same text)."""
    p, d = pruned["steps"][-1], dense["steps"][-1]
    return {
        "held_saved": saved(p["held_bytes"], d["held_bytes"]),
        "allocated_saved": saved(p["alloc_bytes"], d["alloc_bytes"]),
        "held_bytes": (p["held_bytes"], d["held_bytes"]), "allocated_bytes": (p["alloc_bytes"], d["alloc_bytes"]),
        "latency_ratio": decode_ms(pruned) / decode_ms(dense),
        "own_perplexity": (pruned["perplexity"], dense["perplexity"]),
        "same_prefix": next((i for i, (a, b) in enumerate(zip(pruned["new_ids"], dense["new_ids"])) if a != b),
                            min(len(pruned["new_ids"]), len(dense["new_ids"]))),  # tokens before the texts part
        "tokens": min(len(pruned["new_ids"]), len(dense["new_ids"])),
    }
