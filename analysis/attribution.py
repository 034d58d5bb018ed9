"""Token attributions with captum for one next-token prediction: which earlier tokens drove it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from captum.attr import InputXGradient, IntegratedGradients, Saliency

from models.transformer import evaluating

METHODS = ("integrated gradients", "gradient x input", "saliency")
MAX_STEPS = 64   # integrated-gradients steps, capped to keep the page responsive on a CPU


def attribute(model, ids: list[int], position: int, target: int | None = None, method: str = "integrated gradients",
              steps: int = 32, baseline_id: int = 0) -> tuple[np.ndarray, int, float]:
    """Scores [position + 1] for the prediction made at `position` (of the token after it).

    target: the token whose log-probability is explained (default: the model's top choice).
    Attributions are taken at the token embeddings (passed to the model as `embeds`, so no hook ever touches the
    model, which app sessions share) and summed over their width; saliency is the L2 norm of the gradient
    there. Integrated gradients run from the embeddings of baseline_id. Returns (scores, target, log-prob).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if not 0 <= position < len(ids):
        raise ValueError(f"position {position} is outside the text's {len(ids)} tokens")
    steps = max(2, min(int(steps), MAX_STEPS))
    x = torch.tensor([ids[:position + 1]], device=model.wte.weight.device)

    def logprob(emb):  # emb [n, T, d_m] -> log p(target) [n]
        return model(x.expand(emb.shape[0], -1), embeds=emb).logits[:, -1].float().log_softmax(-1)[:, target]

    with evaluating(model):
        with torch.no_grad():
            emb = model.wte(x)
            base = model.wte(torch.full_like(x, baseline_id))
            lp = model(x).logits[0, -1].float().log_softmax(-1)
        if target is None:
            target = int(lp.argmax())
        with torch.enable_grad():
            if method == "integrated gradients":
                attr = IntegratedGradients(logprob).attribute(emb, baselines=base, n_steps=steps, internal_batch_size=steps)
                scores = attr.sum(-1)
            elif method == "gradient x input":
                scores = InputXGradient(logprob).attribute(emb).sum(-1)
            else:
                scores = Saliency(logprob).attribute(emb, abs=False).norm(dim=-1)
    return scores[0].detach().float().cpu().numpy(), target, float(lp[target])


def attribution_table(scores: np.ndarray, labels: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"position": np.arange(len(scores)), "token": labels[:len(scores)], "attribution": scores})


def attribution_figure(df: pd.DataFrame, title: str) -> go.Figure:
    lim = float(np.abs(df["attribution"]).max()) or 1.0
    fig = go.Figure(go.Bar(x=df["position"], y=df["attribution"], marker={"color": df["attribution"], "colorscale": "RdBu",
                                                                        "cmin": -lim, "cmax": lim},
                           customdata=df["token"], hovertemplate="%{customdata} (pos %{x}): %{y:.4f}<extra></extra>"))
    step = max(1, len(df) // 60)
    fig.update_xaxes(tickvals=df["position"][::step], ticktext=df["token"][::step], tickangle=-60)
    fig.update_layout(title=title, yaxis_title="attribution", height=420)
    return fig
