"""Per-token views: surprisal of a text under a model, generated tokens with probability and latency."""
from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from analysis.plain import plotly_text
from models.transformer import evaluating
from models.scoring import target_logprobs


@torch.inference_mode()
def token_logprobs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i+1] | ids[:i+1]) for i < len - 1 (the text must fit the context)."""
    model.check_fits(len(ids))
    if len(ids) < 2:
        return np.zeros(0)
    x = torch.tensor([ids], device=model.wte.weight.device)
    with evaluating(model):  # a pruned model scores with its inference step function
        return target_logprobs(model(x[:, :-1]).logits[0], x[0, 1:]).cpu().numpy()


def surprisal_table(labels: list[str], logprobs: np.ndarray, name: str = "model") -> pd.DataFrame:
    """One row per predicted token (positions 1..T-1)."""
    return pd.DataFrame({"model": name, "position": np.arange(1, len(logprobs) + 1),
                         "token": labels[1:len(logprobs) + 1], "logprob": logprobs,
                         "surprisal_bits": -logprobs / math.log(2)})


def perplexity(logprobs: np.ndarray) -> float:
    return float(math.exp(-logprobs.mean())) if len(logprobs) else float("nan")


def surprisal_figure(df: pd.DataFrame, title: str) -> go.Figure:
    fig = go.Figure()
    for name, part in df.groupby("model", sort=False):
        fig.add_trace(go.Scatter(x=part["position"], y=part["surprisal_bits"], mode="lines+markers",
                                 name=plotly_text(name), customdata=part["token"].map(plotly_text),
                                 hovertemplate="%{customdata}: %{y:.2f} bits<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="position", yaxis_title="surprisal (bits)", height=400)
    return fig


def generation_table(events, tokenizer) -> pd.DataFrame:
    lp = np.array([e.logprob for e in events])
    return pd.DataFrame({
        "index": [e.index for e in events], "token_id": [e.token_id for e in events],
        "token": [tokenizer.decode([e.token_id]) for e in events], "prob": np.exp(lp),
        "latency_ms": [e.latency_s * 1000 for e in events],
        "running_perplexity": np.exp(-np.cumsum(lp) / np.arange(1, len(lp) + 1)) if len(lp) else [],
    })


def latency_figure(df: pd.DataFrame, title: str) -> go.Figure:
    fig = go.Figure(go.Scatter(x=df["index"], y=df["latency_ms"], mode="lines+markers",
                               customdata=df["token"].map(plotly_text),
                               hovertemplate="%{customdata}: %{y:.2f} ms<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="generated token", yaxis_title="latency (ms)", height=320)
    return fig


# HTML for st.markdown(..., unsafe_allow_html=True): Streamlit's Markdown reads it first, so what the tokens say
# must not be Markdown either. The HTML is one <div> on one line (an HTML block, which Markdown hands whole to the
# HTML parser: no link, emoji or autolink made of the text), and a token's text is entity-escaped with its line
# breaks and tabs as references (a blank line would end the block) and ':' as one (Streamlit rewrites
# ':material/' in the whole source before parsing).
_REFS = {"\n": "&#10;", "\r": "&#13;", "\t": "&#9;", ":": "&#58;"}


def html_text(s) -> str:
    """A string the code did not write as text (or an attribute's value) in such HTML."""
    return "".join(_REFS.get(c, c) for c in html.escape(str(s), quote=True))


def colored_tokens_html(tokens: list[str], probs: list[float]) -> str:
    """Tokens on a background from red (improbable) to green (probable); hover shows p."""
    spans = []
    for tok, p in zip(tokens, probs):
        hue = int(120 * max(0.0, min(1.0, p)))
        text = "⏎<br>".join(html_text(line) for line in tok.split("\n"))
        spans.append(f'<span title="p={p:.3f}" style="background:hsl({hue},70%,80%);'
                     f'border-radius:3px;padding:0 1px;white-space:pre-wrap">{text}</span>')
    return "<div>" + "".join(spans) + "</div>"
