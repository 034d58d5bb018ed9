"""Attribution: which earlier tokens drove one next-token prediction (captum)."""
import streamlit as st

from analysis import attribution, views
from app import heavy
from app.common import export_buttons, load, model_text_tokens, setup, window_picker
from app.plain import md


MAX_VIEW = views.ATTRIBUTION_VIEW  # tokens per attributed window (analysis.views says why)


def cached_attr(path: str, ids: tuple[int, ...], position: int, target: int | None, method: str, steps: int, progress):
    """Kept per session (the last 8): st.cache_data would replay the progress bar's calls into a page that is gone."""
    memo = st.session_state.setdefault("attr_memo", {})
    key = (path, ids, position, target, method, steps)
    if key not in memo:
        with heavy.slot():
            memo[key] = attribution.attribute(load(path).model, list(ids), position, target, method, steps,
                                              progress=progress)
        while len(memo) > 8:
            memo.pop(next(iter(memo)))
    return memo[key]


setup("Attribution")
loaded, text, toks = model_text_tokens(default="mha")
cfg, tok = loaded.config, loaded.tokenizer
view, start = window_picker(toks, cfg.context, "attr_window", MAX_VIEW)
n = len(view.ids)
c1, c2, c3 = st.columns(3)
position = c1.slider("Prediction made after token #", 0, n - 1, n - 1, key="attr_pos") if n > 1 else 0
c1.caption(f"after {md(repr(view.labels[position]))}")
n_params = sum(p.numel() for p in loaded.model.parameters())
# a large model starts on the one-pass method (one gradient takes seconds on a CPU); analysis.export opens the same way
opening, default_steps = views.attribution_default(n_params)
big = opening != "integrated gradients"
method = c2.selectbox("Method", attribution.METHODS, key="attr_method", index=attribution.METHODS.index(opening))
steps = c3.slider("Integrated-gradients steps", 4, attribution.MAX_STEPS, default_steps, key="attr_steps",
                  disabled=method != "integrated gradients")
if big and method == "integrated gradients":
    c3.caption(f"{int(steps)} gradients over the window of this {n_params / 1e6:.0f} M-parameter model: "
               "progress is shown below")
choices = ["the model's top choice"] + (["the actual next token"] if position < n - 1 else [])
which = st.radio("Explain", choices, horizontal=True, key="attr_target")
target = view.ids[position + 1] if which == "the actual next token" else None

bar = st.progress(0.0, text=f"{method}: computing gradients…")
try:
    scores, target, logprob = cached_attr(str(loaded.path), tuple(view.ids), position, target, method, int(steps),
                                          lambda f: bar.progress(f, text=f"{method}: {f:.0%} of the steps"))
except attribution.TooLarge as e:
    bar.empty()
    st.error(str(e))
    st.stop()
bar.empty()
df = attribution.attribution_table(scores, view.labels)
name = tok.decode([target])
st.markdown(f"Explaining **{md(repr(name))}** after position {position} (log p = {logprob:.3f}).")
fig = attribution.attribution_figure(df, f"{cfg.mixer}: {method} for next token {name!r}")
st.plotly_chart(fig, width="stretch")
export_buttons(fig, df, "attribution", loaded.path, text, {"method": method, "steps": int(steps), "position": position,
                                                          "target": target, "window_start": start})
