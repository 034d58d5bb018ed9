"""Compare: two models on the same text, side by side."""
import time

import numpy as np
import pandas as pd
import streamlit as st

from analysis import maps, tokens, views
from analysis.text import tokenize, window
from app import heavy
from app.common import export_buttons, load, pick_model, setup, text_input
from app.plain import md


@st.cache_data(max_entries=32, show_spinner="Recording the mixing maps…")
def maps_of(path: str, ids: tuple[int, ...]):
    """(maps [layers, heads, T, T], kind): one forward, kept for the layer and head pickers (an Extractor: what the
    Attention page opens on, SHE's lag norms among them)."""
    with heavy.slot():
        return maps.mixing_view(load(path).model, list(ids))[:2]


def timed_logprobs(path: str, ids: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """(log-probabilities, seconds): the faster of two forwards over the text, timed on this run of the page (never
    a cached time, which would be the first visitor's) and alone (the slot keeps other sessions' work off the cores
    meanwhile). Two, because a model's first call on a new text is cold: mha's took 40-140 ms in a fresh server
    beside mhe-mul's 10 ms, and about 10 ms once warm."""
    model = load(path).model
    with heavy.slot(), st.spinner("Scoring the text (two timed forwards)…"):
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            lp = tokens.token_logprobs(model, list(ids))
            times.append(time.perf_counter() - t0)
        return lp, min(times)


setup("Compare")
a = pick_model("Model A", key="model", default="mha")
b = pick_model("Model B", key="model2", default="mhe-mul")
if a is None or b is None:
    st.stop()
text = text_input()
if text is None:
    st.stop()
size = views.view(views.COMPARE_VIEW, min(a.config.context, b.config.context))
ta = window(tokenize(a.tokenizer, text), 0, size)
tb = window(tokenize(b.tokenizer, text), 0, size)
lpa, sa = timed_logprobs(str(a.path), tuple(ta.ids))
lpb, sb = timed_logprobs(str(b.path), tuple(tb.ids))
st.caption(f"Both models read the first {size} tokens at most. Tokenizers may differ; per-token views line up "
           "by position only when they match.")
cols = st.columns(2)
for col, name, loaded, lp, secs in ((cols[0], "A", a, lpa, sa), (cols[1], "B", b, lpb, sb)):
    col.metric(f"{name}: {md(loaded.path.name)} perplexity on this text", f"{tokens.perplexity(lp):.2f}")
    col.metric(f"{name}: forward latency ({len(lp) + 1} tokens)", f"{secs * 1000:.1f} ms",
               help="The faster of two forwards over the text with its log-probabilities, timed on this run "
                    "of the page.")

df = pd.concat([tokens.surprisal_table(ta.labels, lpa, f"A: {a.path.name}"),
                tokens.surprisal_table(tb.labels, lpb, f"B: {b.path.name}")])
fig = tokens.surprisal_figure(df, "per-token surprisal")
st.plotly_chart(fig, width="stretch")
export_buttons(fig, df, "compare_surprisal", {"A": a.path, "B": b.path}, text, {"A": a.path.name, "B": b.path.name})



@heavy.fragment
def maps_view(a, b, ta, tb) -> None:
    """The maps of one layer and head side by side: a fragment, so picking another redraws this part alone."""
    ma, ka = maps_of(str(a.path), tuple(ta.ids))
    mb, kb = maps_of(str(b.path), tuple(tb.ids))
    layers = min(ma.shape[0], mb.shape[0])
    c1, c2 = st.columns(2)
    layer = c1.selectbox("Layer", range(layers), index=layers - 1, key="cmp_layer")
    head = c2.selectbox("Head (A and B)", range(min(ma.shape[1], mb.shape[1])), key="cmp_head")
    left, right = st.columns(2)
    for col, name, loaded, m, toks in ((left, "A", a, ma, ta), (right, "B", b, mb, tb)):
        h = min(head, m.shape[1] - 1)
        fig = maps.map_figure(m[layer, h], toks.labels, f"{name} {loaded.path.name}: layer {layer}")
        with col:
            st.plotly_chart(fig, width="stretch", key=f"cmp_{name.lower()}")
            export_buttons(fig, lambda m=m, labels=toks.labels, h=h: maps.maps_table(m[layer:layer + 1, h:h + 1],
                                                                                     labels, layer, h),
                           f"compare_map_{name}", loaded.path, text, {"layer": layer, "head": h}, key=f"cmp_map_{name}")
    if ta.ids == tb.ids and ka == kb == "attention":
        diff = maps.difference_figure(ma[layer, head], mb[layer, head], ta.labels,
                                      f"A - B: layer {layer}, head {head}")
        st.plotly_chart(diff, width="stretch", key="cmp_diff")
        export_buttons(diff, maps.maps_table((ma - mb)[layer:layer + 1, head:head + 1], ta.labels, layer, head),
                       "compare_difference", {"A": a.path, "B": b.path}, text,
                       {"A": a.path.name, "B": b.path.name, "layer": layer, "head": head})
    else:
        st.info("The difference map needs two attention models with the same tokenizer.")


maps_view(a, b, ta, tb)
