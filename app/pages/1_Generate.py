"""Generate: stream tokens with live latency, tokens/s, running perplexity and cache memory."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import streamlit as st  # noqa: E402

from analysis.tokens import colored_tokens_html, generation_table, latency_figure  # noqa: E402
from app.common import export_buttons, pick_model, setup  # noqa: E402
from models.generate import generate  # noqa: E402
from models.device import describe as device_name  # noqa: E402

setup("Generate")
loaded = pick_model(default="mha")
if loaded is None:
    st.stop()
cfg = loaded.config

prompt = st.text_area("Prompt", value="The president said that", height=90, key="gen_prompt")
c1, c2, c3, c4, c5 = st.columns(5)
max_new = c1.number_input("New tokens", 1, cfg.context, min(64, cfg.context - 1), key="gen_n")
greedy = c2.checkbox("Greedy", value=False, key="gen_greedy")
temperature = c3.slider("Temperature", 0.1, 2.0, 0.8, 0.05, key="gen_temp", disabled=greedy)
top_k = c4.number_input("Top-k (0 = off)", 0, cfg.vocab_size, 40, key="gen_topk", disabled=greedy)
top_p = c5.slider("Top-p", 0.05, 1.0, 0.95, 0.05, key="gen_topp", disabled=greedy)
seed = st.number_input("Seed", 0, 2**31 - 1, 0, key="gen_seed")

if st.button("Generate", type="primary", key="gen_go"):
    ids = loaded.tokenizer.encode(prompt).ids
    if not prompt.strip() or not ids:
        st.warning("The prompt is empty: type a few words first.")
        st.stop()
    if len(ids) >= cfg.context:
        st.error(f"The prompt has {len(ids)} tokens; this model's context is {cfg.context}. Shorten it.")
        st.stop()
    text_box, stats, bar = st.empty(), st.empty(), st.progress(0.0, text="generating…")
    shown, probs, logps, secs = [], [], [], []
    total = min(int(max_new), cfg.context - len(ids))

    def on_token(event):
        shown.append(loaded.tokenizer.decode([event.token_id]))
        logps.append(event.logprob)
        probs.append(math.exp(event.logprob))
        secs.append(event.latency_s)
        text_box.markdown(colored_tokens_html(shown, probs), unsafe_allow_html=True)
        rate = (len(secs) - 1) / sum(secs[1:]) if len(secs) > 1 else float("nan")
        cache_kib = (len(ids) + event.index + 1) * loaded.model.cache_bytes_per_token() / 1024
        stats.caption(f"token {event.index + 1}: {event.latency_s * 1000:.1f} ms · {rate:.1f} tokens/s · "
                      f"running perplexity {math.exp(-sum(logps) / len(logps)):.2f} · cache {cache_kib:.1f} KiB")
        bar.progress((event.index + 1) / total, text=f"{event.index + 1}/{total} tokens")

    res = generate(loaded.model, ids, int(max_new), temperature=float(temperature), top_k=int(top_k) or None,
                   top_p=float(top_p), greedy=greedy, seed=int(seed), callback=on_token)
    bar.empty()
    st.session_state["gen_result"] = (res, prompt)

if "gen_result" in st.session_state:
    res, used_prompt = st.session_state["gen_result"]
    for note in res.notes:
        st.info(note)
    table = generation_table(res.events, loaded.tokenizer)
    st.markdown(colored_tokens_html([used_prompt] + list(table["token"]), [1.0] + list(table["prob"])), unsafe_allow_html=True)
    st.caption("Background: probability of each generated token under the model (red low, green high).")
    m = st.columns(5)
    m[0].metric("tokens/s (decode)", f"{res.decode_tokens_per_s:.1f}")
    m[1].metric("first token (ms)", f"{res.events[0].latency_s * 1000:.1f}")
    m[2].metric("median ms/token", f"{table['latency_ms'].iloc[1:].median() if len(table) > 1 else table['latency_ms'].iloc[0]:.2f}")
    m[3].metric("perplexity of output", f"{res.perplexity:.2f}")
    m[4].metric("cache memory", f"{res.cache_bytes / 1024:.1f} KiB")
    paths = res.kernel_paths
    st.caption(f"Device: {device_name(loaded.model.wte.weight.device)} ({str(loaded.model.wte.weight.dtype)[6:]}) · kernel path: "
               + ", ".join(f"{op}={p}" for op, p in sorted(paths.items())) + f" · stop: {res.stop_reason}")
    fig = latency_figure(table, f"{cfg.mixer}: per-token latency")
    st.plotly_chart(fig, width="stretch")
    export_buttons(fig, table, "generation_latency", loaded.path, used_prompt, {"max_new_tokens": len(res.new_ids)})
    st.dataframe(table, hide_index=True, width="stretch")
