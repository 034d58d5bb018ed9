"""Extractors: the learned lag weights of SHE, HE, WE and ME."""
import pandas as pd
import streamlit as st

from analysis import lags
from app.common import export_buttons, pick_model, setup


def only_extractors(loaded):
    return None if lags.extractor_layers(loaded.model) else "not an Extractor model; pick she, he, we or me."


setup("Extractors")
st.caption("Weights are indexed by lag i - j (0 = the token itself). ME: one scalar per lag. WE/HE: one vector per "
           "lag (a depthwise causal convolution), shown by its signed mean and its RMS over channels. SHE: one d x d "
           "matrix per lag, shown by its Frobenius norm (the mean of its signed entries cancels).")
loaded = pick_model(accept=only_extractors, default="me")
if loaded is None:
    st.stop()
cfg = loaded.config
table = lags.lag_table(loaded.model)   # (the page keeps the table, never the model: app.common.PageModel)

log_x = st.checkbox("Log lag axis", value=True, key="ext_logx")
fig, value = lags.profile_view(table, cfg.mixer, log_x)
st.plotly_chart(fig, width="stretch")
export_buttons(fig, table, f"lags_profile_{cfg.mixer}", loaded.path, None, {"value": value})

k = st.slider("How much weight sits in the first k lags?", 1, cfg.context, 8, key="ext_k")
share = lags.mass_in_first(table, k)
st.dataframe(share.style.format({f"share_first_{k}": "{:.1%}"}), hide_index=True)
cum = lags.cumulative_figure(table, f"{cfg.mixer}: cumulative share of squared lag weight")
st.plotly_chart(cum, width="stretch")
export_buttons(cum, share, f"lags_cumulative_{cfg.mixer}", loaded.path, None, {"k": k}, key="cum")

if cfg.mixer in ("we", "he", "she"):
    layer = st.selectbox("Layer", range(cfg.n_layers), key="ext_layer")
    max_lags = st.slider("Lags shown", 8, cfg.context, min(64, cfg.context), key="ext_maxlags")
    mat = lags.lag_channel(loaded.model, layer)
    title = (f"{cfg.mixer}: lag x channel weights, layer {layer}" if cfg.mixer != "she"
             else f"she: Frobenius norm of W_k per lag, layer {layer}")
    heat = lags.lag_channel_figure(mat, title, max_lags)
    st.plotly_chart(heat, width="stretch")
    export_buttons(heat, pd.DataFrame(mat[:max_lags]), f"lags_channels_{cfg.mixer}_l{layer}", loaded.path, None,
                   {"layer": layer, "lags": max_lags}, key="heat")
