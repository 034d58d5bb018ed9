"""What a forced decision or a patch did: per-position effects on the next-token distributions and log-probabilities,
the drops that changed in every layer, and their figures (pure functions of models.pruning.intervene's runs)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis.plain import plotly_text
from models.pruning.intervene import Force, Run


def effects(kl: np.ndarray, before: Run, after: Run, labels: list[str]) -> pd.DataFrame:
    """One row per position n < T-1: the token there, the next token it predicts, the log-probability of that token
    before and after, their difference, and KL(before || after) of the whole next-token distribution at n."""
    lp0, lp1 = before.logprobs.double().cpu().numpy(), after.logprobs.double().cpu().numpy()
    n = len(lp0)
    return pd.DataFrame({"position": np.arange(n), "token": labels[:n], "next_token": labels[1:n + 1],
                         "logp_before": lp0, "logp_after": lp1, "delta_logp": lp1 - lp0, "kl": kl[:n]})


def first_affected(forces: list[Force] | None = None, positions: list[int] | None = None) -> int:
    """The first position whose prediction a change can reach: a forced token's first query (a kept token's, the
    query after it), or the first patched position."""
    if forces:
        return min(f.first_query() for f in forces)
    return min(positions)


def summary(table: pd.DataFrame, start: int) -> dict:
    """Perplexity of the whole text and of the positions from `start` on, before and after; the largest KL."""
    after = table[table["position"] >= start]

    def ppl(lp) -> float:
        return float(math.exp(-lp.mean())) if len(lp) else float("nan")

    return {"from": int(start), "scored_from": int(len(after)), "scored": int(len(table)),
            "ppl_before": ppl(table["logp_before"]), "ppl_after": ppl(table["logp_after"]),
            "ppl_from_before": ppl(after["logp_before"]), "ppl_from_after": ppl(after["logp_after"]),
            "max_kl": float(table["kl"].max()) if len(table) else 0.0,
            "max_kl_position": int(table["kl"].idxmax()) if len(table) else -1}


def changed_drops(before: Run, after: Run, labels: list[str], forces: list[Force] = ()) -> pd.DataFrame:
    """Every (layer, token) whose drop changed: the query that dropped it before and after (-1: held to the end),
    and whether the change was forced or followed from it."""
    b, a = before.dropped_at.cpu().numpy(), after.dropped_at.cpu().numpy()
    layer, pos = np.nonzero(a != b)
    forced = {(i, f.token) for f in forces for i in range(b.shape[0]) if f.applies(i)}
    return pd.DataFrame({"layer": layer, "position": pos, "token": pd.Series([labels[p] for p in pos], dtype=object),
                         "dropped_at_before": b[layer, pos], "dropped_at_after": a[layer, pos],
                         "forced": np.array([(int(i), int(p)) in forced for i, p in zip(layer, pos)], dtype=bool)})


def changes_by_layer(changed: pd.DataFrame, n_layers: int) -> pd.DataFrame:
    """Per layer: how many decisions changed as a consequence (forced ones apart), newly dropped, newly kept."""
    free = changed[~changed["forced"]]
    rows = []
    for layer in range(n_layers):
        part = free[free["layer"] == layer]
        rows.append({"layer": layer, "changed": len(part),
                     "now_dropped": int(((part["dropped_at_before"] < 0) & (part["dropped_at_after"] >= 0)).sum()),
                     "now_kept": int(((part["dropped_at_before"] >= 0) & (part["dropped_at_after"] < 0)).sum()),
                     "forced": int((changed["forced"] & (changed["layer"] == layer)).sum())})
    return pd.DataFrame(rows)


def effect_figure(table: pd.DataFrame, start: int, title: str) -> go.Figure:
    """Per position: the change in log p of the next token (bars) and the KL of the next-token distribution (line,
    right axis), with a rule where the change starts to reach. The tokens and the title (a model's name, a token)
    are raw text, drawn as their characters."""
    fig = go.Figure()
    hover = [plotly_text(f"{t!r} -> {n!r}") for t, n in zip(table["token"], table["next_token"])]
    fig.add_trace(go.Bar(x=table["position"], y=table["delta_logp"], name="change in log p(next token)",
                         hovertext=hover, marker_color="#0072B2"))
    fig.add_trace(go.Scatter(x=table["position"], y=table["kl"], name="KL(before || after), nats", yaxis="y2",
                             mode="lines", hovertext=hover, line={"color": "#D55E00"}))
    fig.add_vline(x=start - 0.5, line_dash="dot", line_color="grey")
    fig.update_layout(title=plotly_text(title), xaxis_title="position (predicting the next token)",
                      yaxis_title="change in log p", yaxis2={"title": "KL (nats)", "overlaying": "y", "side": "right",
                                                            "rangemode": "tozero"},
                      legend={"orientation": "h", "y": -0.2}, height=420, bargap=0)
    return fig


def outcome(model, before: Run, after: Run, labels: list[str], start: int, forces: list[Force] = ()) -> dict:
    """Everything the page and the command show of one change: the per-position effects, the changed drops and
    their count per layer, and the summary from the first position the change reaches."""
    import torch

    from models.scoring import head_kl
    with torch.no_grad():
        kl = head_kl(model, before.hidden[:-1], after.hidden[:-1]).double().cpu().numpy()
    table = effects(kl, before, after, labels)
    changed = changed_drops(before, after, labels, forces)
    return {"effects": table, "changed": changed, "by_layer": changes_by_layer(changed, len(before.dropped_at)),
            "summary": summary(table, start)}


def describe(force: Force, labels: list[str]) -> str:
    """One forced decision in words, as the page's and the command's figure titles read."""
    fate = "kept" if force.keep else f"dropped from query {force.first_query()}"
    return (f"{labels[force.token]!r} (position {force.token}) {fate} at layer {force.layer}"
            f"{' and after' if force.onward else ''}")


def describe_patch(layer: int, positions: list[int], into: str = "pruned", donor: str = "the dense twin",
                   site: str = "residual") -> str:
    """One patch in words, as the page's and the command's figure titles read."""
    p = sorted(set(positions))
    span = (f"{p[0]}-{p[-1]}" if p == list(range(p[0], p[-1] + 1)) else ", ".join(map(str, p))) if len(p) > 1 \
        else str(p[0])
    states = "input" if site == "residual" else "attention output"
    if into == "dense":
        return f"the dense twin's layer {layer} {states} at {span} from the pruned model"
    return f"layer {layer}'s {states} at {span} from {donor}"


def force_outcome(model, ids: list[int], labels: list[str], forces: list[Force]) -> dict:
    """outcome of the model's own forward against the one with `forces` (two forwards)."""
    from models.pruning import intervene
    before, after = intervene.forced(model, ids), intervene.forced(model, ids, forces)
    return outcome(model, before, after, labels, first_affected(forces), forces)


def patch_outcome(model, ids: list[int], labels: list[str], layer: int, positions: list[int], donor,
                  into: str = "pruned", site: str = "residual") -> dict:
    """outcome of a forward against the same forward with layer `layer`'s states at `site` patched at `positions`
    (site "residual": the stream entering the block; "mixer": the block's token mixer output); three forwards.
    into "pruned": the model's own forward, patched with the donor model's states with its rule off (the model
    itself: its dense twin). into "dense": the dense twin's forward (the rule off), patched with the pruned model's
    own states (donor must be the model itself)."""
    from models.pruning import intervene
    if into == "dense":
        if donor is not model:
            raise ValueError("the pruned model's states go into its own dense twin: the donor is the model itself")
        before = intervene.twin_run(model, ids)
        after = intervene.patched(model, ids, layer, positions, intervene.residuals(model, ids, layer, site=site),
                                  rule=False, site=site)
    else:
        before = intervene.forced(model, ids)
        after = intervene.patched(model, ids, layer, positions,
                                  intervene.residuals(donor, ids, layer, rule=False, site=site), site=site)
    return outcome(model, before, after, labels, first_affected(positions=positions))
