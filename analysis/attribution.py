"""Token attributions with captum for one next-token prediction: which earlier tokens drove it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from captum.attr import InputXGradient, IntegratedGradients, Saliency

from analysis.plain import plotly_text, plotly_texts
from kernels import settings
from models.memory import largest
from models.transformer import evaluating

METHODS = ("integrated gradients", "gradient x input", "saliency")
MAX_STEPS = 64   # integrated-gradients steps, capped to keep the page responsive on a CPU
# Activation memory one gradient may hold (the server's other work stays beside it); MIXSCOPE_ATTR_BUDGET_MB overrides.
BUDGET_BYTES = settings.get("MIXSCOPE_ATTR_BUDGET_MB") * 2 ** 20


class TooLarge(ValueError):
    """An attribution whose estimated memory exceeds the budget: refused before anything is allocated."""


def bytes_per_sample(cfg, t: int) -> int:
    """Estimated activation bytes one backward pass keeps for a t-token sequence, in float32: per layer about
    12 d_model + 4 d_ff values a token (SDPA's CPU backward is flash-style: no [H,t,t] maps) and one [t,t]
    mask or log I, times a margin of 1.15 (MARGIN). Measured on SmolLM2-135M (30 layers;
    bench/results/peak_memory_cpu.json): at 256 tokens one gradient peaked 430 MiB above the loaded model and four
    at once 1,649 MiB, against 390 and 1,560 MiB without the margin (448 and 1,794 MiB with it)."""
    return int(MARGIN * cfg.n_layers * 4 * (t * (12 * cfg.d_model + 4 * cfg.d_ff) + t * t))


MARGIN = 1.15   # what the count above misses: the embeddings' gradients, the last logits, allocator slack


def max_tokens(cfg, budget: int = BUDGET_BYTES) -> int:
    """The longest prefix (up to 2^20 tokens) whose one-sample gradient fits the budget, by models.memory's search;
    1 when none does (the refusal still names a position)."""
    return max(1, largest(lambda t: bytes_per_sample(cfg, t) <= budget, 1 << 20))


def attribute(model, ids: list[int], position: int, target: int | None = None, method: str = "integrated gradients",
              steps: int = 32, baseline_id: int = 0, budget: int | None = None,
              progress=None) -> tuple[np.ndarray, int, float]:
    """Scores [position + 1] for the prediction made at `position` (of the token after it).

    target: the token whose log-probability is explained (default: the model's top choice).
    Attributions are taken at the token embeddings (passed to the model as `embeds`, so no hook ever touches the
    model, which app sessions share) and summed over their width; saliency is the L2 norm of the gradient
    there. Integrated gradients run from the embeddings of baseline_id. Returns (scores, target, log-prob).
    Only the last position's logits are formed, and the integrated-gradients steps go through in chunks that
    fit `budget` bytes (default BUDGET_BYTES); a prefix whose single gradient would not fit is refused
    (TooLarge) before anything runs. progress(fraction) is called as the steps complete.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if not 0 <= position < len(ids):
        raise ValueError(f"position {position} is outside the text's {len(ids)} tokens")
    steps = max(2, min(int(steps), MAX_STEPS))
    budget = BUDGET_BYTES if budget is None else budget
    cfg = model.config
    per = bytes_per_sample(cfg, position + 1)
    if per > budget:
        raise TooLarge(f"attributing a prediction after {position + 1} tokens of this {cfg.n_layers}-layer model "
                       f"needs about {per / 2**30:.1f} GB for one gradient, "
                       f"over the budget of {budget / 2**30:.1f} GB: "
                       f"pick a position or window of at most {max_tokens(cfg, budget)} tokens "
                       "(MIXSCOPE_ATTR_BUDGET_MB raises the budget)")
    chunk = max(1, min(steps, budget // per))
    total = steps if method == "integrated gradients" else 1
    done = [0]
    x = torch.tensor([ids[:position + 1]], device=model.wte.weight.device)

    def logprob(emb):  # emb [n, T, d_m] -> log p(target) [n]
        out = model(x.expand(emb.shape[0], -1), embeds=emb, last_only=True).logits[:, -1].float().log_softmax(-1)
        if torch.is_grad_enabled() and progress is not None:
            done[0] += emb.shape[0]
            progress(min(1.0, done[0] / total))
        return out[:, target]

    with evaluating(model):
        with torch.no_grad():
            emb = model.wte(x)
            base = model.wte(torch.full_like(x, baseline_id))
            lp = model(x, last_only=True).logits[0, -1].float().log_softmax(-1)
        if target is None:
            target = int(lp.argmax())
        with torch.enable_grad():
            if method == "integrated gradients":
                attr = IntegratedGradients(logprob).attribute(emb, baselines=base, n_steps=steps,
                                                              internal_batch_size=chunk)
                scores = attr.sum(-1)
            elif method == "gradient x input":
                scores = InputXGradient(logprob).attribute(emb).sum(-1)
            else:
                scores = Saliency(logprob).attribute(emb, abs=False).norm(dim=-1)
    return scores[0].detach().float().cpu().numpy(), target, float(lp[target])


def attribution_table(scores: np.ndarray, labels: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"position": np.arange(len(scores)), "token": labels[:len(scores)], "attribution": scores})


def attribution_figure(df: pd.DataFrame, title: str) -> go.Figure:
    """Bars of each position's attribution. The tokens and the title (which names the target token) are plain
    text: drawn as their characters (analysis.plain.plotly_text), never as plotly's HTML."""
    lim = float(np.abs(df["attribution"]).max()) or 1.0
    shown = plotly_texts(df["token"])
    fig = go.Figure(go.Bar(x=df["position"], y=df["attribution"],
                           marker={"color": df["attribution"], "colorscale": "RdBu", "cmin": -lim, "cmax": lim},
                           customdata=shown, hovertemplate="%{customdata} (pos %{x}): %{y:.4f}<extra></extra>"))
    step = max(1, len(df) // 60)
    fig.update_xaxes(tickvals=df["position"][::step], ticktext=shown[::step], tickangle=-60)
    fig.update_layout(title=plotly_text(title), yaxis_title="attribution", height=420)
    return fig
