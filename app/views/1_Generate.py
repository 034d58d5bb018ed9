"""Generate: stream tokens with the model's own latency, tokens/s, running perplexity and the real cache size.
A context-pruned model, or any softmax model under a KV-cache eviction policy (StreamingLLM, TOVA, H2O, SnapKV),
generates through the compacted cache: the page shows, live, which earlier tokens each layer has dropped, beside
a twin (the dense base, the same model with nothing evicted, or a pruned model's own rule); afterwards a step
slider replays the cache."""
import math
import time
from itertools import zip_longest
from pathlib import Path

import streamlit as st

from analysis import generation_figures as figures, live, twin as twins
from analysis.tokens import colored_tokens_html, generation_table
from app import access, heavy
from app.common import (METHOD_TITLES, dense_base_path, export_buttons, load, method_title, pick_model, public, setup,
                        shown_path)
from app.plain import md
from models import trace as traces
from models.checkpoint import CheckpointError
from models.delta import unfetched_base
from models.device import describe as device_name
from models.generate import GenerationResult, stream
from models.pruning import policies

TEXT_EVERY_S, FIGURES_EVERY_S = 0.25, 1.5  # live redraws are throttled so that drawing never dominates


def twin_for(loaded):
    """The dense base of a pruned model, loaded; (None, why) when there is none or it is not here (why: Markdown,
    its path by label and as text)."""
    path = dense_base_path(loaded)
    if not path:
        return None, "no dense base is recorded on this model's card"
    if access.model_dir_problem(path):  # serve mode: a card's init_from may point anywhere; say nothing of it
        return None, "its dense base is not one this server opens"
    if not Path(path).is_dir() or unfetched_base(loaded.path):
        return None, f"its dense base {md(shown_path(path))} is not on this machine (`make run` fetches registry bases)"
    try:
        return load(str(Path(path))), None
    except CheckpointError as e:
        return None, f"its dense base {md(shown_path(path))} does not load: {md(public(str(e)))}"


setup("Generate")
loaded = pick_model(default="mha")
if loaded is None:
    st.stop()
cfg = loaded.config
compactable = loaded.model.blocks[0].mixer.decodes_compacted

prompt = st.text_area("Prompt", value=figures.PROMPT, height=90, key="gen_prompt",
                      max_chars=access.max_chars())
c1, c2, c3, c4, c5 = st.columns(5)
most_new = access.max_new_tokens(cfg.context)   # serve mode caps it
max_new = c1.number_input("New tokens", 1, most_new, min(64, most_new, cfg.context - 1), key="gen_n")
greedy = c2.checkbox("Greedy", value=False, key="gen_greedy")
temperature = c3.slider("Temperature", 0.1, 2.0, 0.8, 0.05, key="gen_temp", disabled=greedy)
top_k = c4.number_input("Top-k (0 = off)", 0, cfg.vocab_size, 40, key="gen_topk", disabled=greedy)
top_p = c5.slider("Top-p", 0.05, 1.0, 0.95, 0.05, key="gen_topp", disabled=greedy)
s1, s2 = st.columns([1, 3])
seed = s1.number_input("Seed", 0, 2**31 - 1, 0, key="gen_seed")
policy = None
if compactable and cfg.pattern == "dense":
    e1, e2 = s2.columns(2)
    groups = loaded.model.blocks[0].mixer.n_groups
    method = e1.selectbox("Eviction",
                          ["learned" if cfg.prune else "none", *policies.methods(decoding=True, groups=groups)],
                          format_func=method_title, key="gen_evict",
                          help="Per-KV-group policies keep a budget in each group of a layer" +
                               (f" (this model has {groups} KV groups)" if groups > 1 else "") +
                               "; the hindsight oracle runs on the Pruning page (a replay over a text).")
    if method not in METHOD_TITLES:
        low = policies.min_budget(method)
        held = "per KV group" if policies.parse(method)[0].per_group and groups > 1 else "per layer"
        budget = int(e2.number_input(f"Budget (tokens held {held}, at least {low})", low, cfg.context, max(low, 32),
                                     key="gen_budget", help="Per KV group for a per-group policy. Prompt mode keeps "
                                                            "this many prompt tokens and every generated one"))
        policy = policies.make(method, budget)
elif not compactable:
    s2.caption("KV-cache eviction policies need a per-token cache to evict from; an Extractor mixes its past inputs "
               "by lag and keeps none.")
pruned = compactable and (bool(cfg.prune) or policy is not None)  # generates over the compacted cache, with drops
# the twin: a pruned model's dense base; under a policy, the same model without it (a pruned model: its own rule)
first_label, twin_label = figures.run_labels(cfg, policy, pruned)
beside = {"dense twin": "its dense twin", "learned rule": "the same model under its own learned rule",
          "nothing evicted": "the same model with nothing evicted"}[twin_label]
with_twin = pruned and st.checkbox(f"Beside {beside} (same prompt and seed, generated in turn)", value=True,
                                   key="gen_twin")
if policy is not None:
    per = "per KV group" if policy.per_group and loaded.model.blocks[0].mixer.n_groups > 1 else "per layer"
    st.caption(f"{method_title(policy.method)} at {policy.budget} tokens {per}: it generates through the compacted "
               "cache and evicts as the policy says" + (" (this model's learned rule is off)." if cfg.prune else ".")
               + " The strip shows, per layer, which earlier tokens are still held"
               + (" by at least one group; the memory held is the mean over groups." if per == "per KV group" else "."))
elif pruned:
    st.caption("Context-pruned model: it generates through the compacted cache, so what a layer drops is freed; "
               "the strip shows, per layer, which earlier tokens are still held.")


def draw_live(boxes, names, runs):
    for box, name, run in zip(boxes, names, runs):
        events = run["events"]
        if not events:
            continue
        e = events[-1]
        lp = [x.logprob for x in events]
        rate = (len(events) - 1) / sum(x.latency_s for x in events[1:]) if len(events) > 1 else float("nan")
        box["text"].markdown(colored_tokens_html(run["texts"], [math.exp(v) for v in lp]), unsafe_allow_html=True)
        box["stats"].caption(f"**{md(name)}** · token {e.index + 1}: model {e.latency_s * 1000:.1f} ms · "
                             f"{rate:.1f} tokens/s · perplexity {math.exp(-sum(lp) / len(lp)):.2f} · "
                             f"cache held {e.held_bytes / 1024:.0f} KiB "
                             f"(dense {e.dense_bytes / 1024:.0f} KiB, allocated {e.alloc_bytes / 1024:.0f} KiB)")


def finish(pending: dict, stop_reason: str | None = None) -> None:
    """Keep a run's results (all its tokens, or those before it was stopped) for the view below. The result is
    built once into the plain dict first (a session_state write can be where a click interrupts): collecting the
    same pending run again only stores it again."""
    if "result" not in pending:
        runs = [r for r in pending["runs"] if r["events"]]     # a twin stopped before its first token is left out
        n = min((len(r["events"]) for r in runs), default=0) if stop_reason == "stopped" else None
        out = []
        for r in runs:   # stopped: the models took turns, so both are cut to the same length to compare
            out.append(figures.collect(r["path"], r["tokenizer"], r["n_layers"], pending["ids"], r["events"][:n],
                                       r["info"], pending["prompt"], pending["settings"], stop_reason))
        pending["result"] = out and {"runs": out, "prompt": pending["prompt"], "draw_s": pending["draw_s"],
                                     "labels": [r["label"] for r in runs], "model": pending["model"],
                                     "wall_s": pending["wall_s"], "policy": pending["policy"]}
    if pending["result"]:
        st.session_state["gen_result"] = pending["result"]


def price_view(loaded, saved, labels, res, twin_res) -> None:
    """Pruning's price on the same text: both models score both continuations, teacher-forced (analysis.twin)."""
    ids, new = res.prompt_ids, [res.new_ids, twin_res.new_ids]
    pol = policies.make(*saved["policy"]) if saved.get("policy") else None
    most = twins.most_tokens(loaded.model, pol)
    if len(ids) + max(map(len, new)) > most:
        st.caption(f"Pruning's price on the same text is scored up to {most:,} tokens here; this is longer.")
        return
    if pol is None:
        other, why = twin_for(loaded)
        if other is None:
            st.caption(f"Pruning's price on the same text needs the twin: {why}.")
            return
        scorers = [(labels[0], loaded.model, None), (labels[1], other.model, None)]
    else:  # the same model: under the policy, and with its own rule or nothing evicted
        scorers = [(labels[0], loaded.model, pol), (labels[1], loaded.model, None)]
    if "price" not in saved:
        with heavy.slot(), st.spinner("Scoring both continuations with both models…"):
            saved["price"] = twins.price(scorers, ids, [(f"{labels[0]}'s output", new[0]),
                                                        (f"{labels[1]}'s output", new[1])])
    rows = saved["price"]
    change = twins.price_change(rows, labels[0], labels[1])
    st.markdown(f"**Price on the same text** (teacher-forced perplexity of each continuation, given the prompt, "
                f"under each model as it generates): {labels[0]} against {labels[1]}, "
                + "; ".join(f"{c:+.1%} on {t}" for t, c in change.items()) + ".")
    st.dataframe(rows, hide_index=True)
    st.caption("Each model's perplexity of its own output (beside each text below) is a sampling statistic; this "
               "table is the price.")


# A click on any widget (Stop included) ends a running script; what it had generated is kept, marked "stopped"
# (one that had finished but for the last writes is kept as it was).
if "gen_pending" in st.session_state:
    interrupted = st.session_state["gen_pending"]
    finish(interrupted, None if "result" in interrupted else "stopped")
    del st.session_state["gen_pending"]

if st.button("Generate", type="primary", key="gen_go"):
    ids = loaded.tokenizer.encode(prompt).ids
    if not prompt.strip() or not ids:
        st.warning("The prompt is empty: type a few words first.")
        st.stop()
    if len(ids) >= cfg.context:
        st.error(f"The prompt has {len(ids)} tokens; this model's context is {cfg.context}. Shorten it.")
        st.stop()
    if policy is None:
        twin, why = twin_for(loaded) if with_twin else (None, None)
    else:
        twin, why = (loaded, None) if with_twin else (None, None)
    if why:
        st.info(f"No dense twin: {why}.")
    models = [(first_label, loaded)] + ([(twin_label, twin)] if twin is not None else [])
    names = [f"{n} · {m.path.name}" for n, m in models]
    cols = st.columns(len(models))
    boxes = [{"text": c.empty(), "stats": c.empty()} for c in cols]
    strip_box, curve_box = (st.empty(), st.empty()) if pruned else (None, None)
    bar, drawing = st.progress(0.0, text="generating…"), st.empty()
    total = min(int(max_new), cfg.context - len(ids))
    settings = figures.sampling(temperature, top_k, top_p, greedy, seed)
    # what finish() needs of each model, and no more: a run left pending must not pin a loaded model in memory
    runs = [{"events": [], "texts": [], "info": {}, "label": label, "path": m.path, "tokenizer": m.tokenizer,
             "n_layers": m.config.n_layers} for label, m in models]
    pending = {"runs": runs, "ids": ids, "prompt": prompt, "settings": settings, "draw_s": 0.0, "wall_s": 0.0,
               "model": str(loaded.path), "policy": None if policy is None else (policy.method, policy.budget)}
    st.session_state["gen_pending"] = pending  # read by the next run if this one is stopped
    st.button("Stop generating", key="gen_stop", help="Keeps the tokens generated so far")
    gens = [stream(m.model, ids, int(max_new), info=run["info"], policy=policy if i == 0 else None, **settings)
            for i, ((_, m), run) in enumerate(zip(models, runs))]
    draw_s, last_text, last_fig, t_start = 0.0, 0.0, 0.0, time.perf_counter()
    steps = zip_longest(*gens)  # the models take turns: each event's latency is its model's own
    try:
        while True:
            # one step at a time: other sessions' computations take their turns in between; the first step may
            # be refused as "busy", a later one (the run under way) waits its turn
            with heavy.slot(refuse=not runs[0]["events"]):
                step_events = next(steps, None)
            if step_events is None:
                break
            for run, (_, m), e in zip(runs, models, step_events):
                if e is not None:
                    run["events"].append(e)
                    run["texts"].append(m.tokenizer.decode([e.token_id]))
            now = time.perf_counter()
            done = len(runs[0]["events"])
            if now - last_text >= TEXT_EVERY_S:
                t0 = time.perf_counter()
                draw_live(boxes, names, runs)
                bar.progress(done / total, text=f"{done}/{total} tokens")
                if pruned and now - last_fig >= FIGURES_EVERY_S:
                    partial = GenerationResult.collect(ids, runs[0]["events"], runs[0]["info"], cfg.n_layers, "running")
                    tr = traces.build(partial, loaded.tokenizer)
                    labels = live.labels_of(tr, loaded.tokenizer)
                    strip_box.plotly_chart(live.strip_figure(tr, done - 1, labels,
                                                             "held (blue) and dropped (red), per layer"),
                                           width="stretch", key=f"gen_strip_live_{done}")
                    last_fig = time.perf_counter()
                last_text = time.perf_counter()
                draw_s += last_text - t0
                wall = last_text - t_start
                pending["draw_s"], pending["wall_s"] = draw_s, wall
                drawing.caption(f"page drawing so far: {draw_s:.2f} s of {wall:.2f} s wall time "
                                f"({draw_s / wall:.0%}); model latencies above exclude it")
    except Exception:  # a failure is not a stop: nothing of it is kept
        del st.session_state["gen_pending"]
        raise
    finally:  # stopped or not, each generator ends now (its cache and graph pool freed), not at garbage collection
        for g in gens:
            g.close()
    draw_live(boxes, names, runs)
    bar.empty()
    pending["wall_s"] = time.perf_counter() - t_start
    finish(pending)
    del st.session_state["gen_pending"]
    st.rerun()  # the results below replace the live view

saved = st.session_state.get("gen_result")
if saved and saved["model"] == str(loaded.path):
    (path, res, tr), *rest = saved["runs"]
    used_prompt = saved["prompt"]

    def show(bundle, key: str | None = None) -> None:
        """A figure of this generation (a generation_figures Bundle) and its export buttons."""
        st.plotly_chart(bundle.fig, width="stretch")
        export_buttons(bundle.fig, bundle.table, bundle.name, bundle.models or path, used_prompt, bundle.settings,
                       key=key)
    for note in res.notes:
        st.info(note)
    table = generation_table(res.events, loaded.tokenizer)
    m = st.columns(5)
    timed = "measured in this generation: the model's forward and sampling, page drawing excluded"
    m[0].metric("tokens/s (decode)", f"{res.decode_tokens_per_s:.1f}", help=f"Steps after the first; {timed}")
    m[1].metric("first token (ms)", f"{res.events[0].latency_s * 1000:.1f}", help=f"The prompt's prefill; {timed}")
    m[2].metric("median ms/token",
                f"{table['latency_ms'].iloc[1:].median() if len(table) > 1 else table['latency_ms'].iloc[0]:.2f}",
                help=f"Steps after the first; {timed}")
    m[3].metric("perplexity of own output", f"{res.perplexity:.2f}",
                help="How likely the model found the tokens it sampled itself: a sampling statistic, not a "
                     "quality measure (the twin comparison below scores both models on the same text)")
    last = res.events[-1]
    m[4].metric("cache held", f"{last.held_bytes / 1024:.1f} KiB",
                help="Decode state of the tokens still held after the last step (allocated: in the line below)")
    paths = res.kernel_paths
    st.caption(f"Device: {device_name(loaded.model.wte.weight.device)} ({str(loaded.model.wte.weight.dtype)[6:]}) · "
               f"{res.cache_kind} cache ({last.alloc_bytes / 1024:.1f} KiB allocated) · kernel path: "
               + ", ".join(f"{op}={p}" for op, p in sorted(paths.items())) + f" · stop: {res.stop_reason} · "
               f"page drawing {saved['draw_s']:.2f} s of {saved['wall_s']:.2f} s wall time (not in the latencies)")
    if rest:
        _, twin_res, twin_tr = rest[0]
        s = live.twin_summary(tr, twin_tr)
        labels = saved.get("labels", ["pruned", "dense twin"])
        st.subheader(f"{labels[0]} vs {labels[1]}")
        t = st.columns(4)
        kib = lambda pair: f"{pair[0] / 1024:,.1f} KiB vs {pair[1] / 1024:,.1f} KiB"  # noqa: E731
        t[0].metric("cache held: saved", f"{s['held_saved']:.0%}", kib(s["held_bytes"]), delta_color="off",
                    help=f"1 - held / the twin's held, after the last step ({labels[0]} vs {labels[1]})")
        t[1].metric("cache allocated: saved", f"{s['allocated_saved']:.0%}", kib(s["allocated_bytes"]),
                    delta_color="off", help="1 - allocated / the twin's allocated (buffers at their capacity)")
        t[2].metric(f"latency {labels[0]} / {labels[1]}", f"{s['latency_ratio']:.2f}x",
                    help="Median model time per decode step (the first, which holds the prefill, left out), the "
                         "two models taking turns in this generation")
        t[3].metric("tokens before the texts part", f"{s['same_prefix']}/{s['tokens']}")
        price_view(loaded, saved, labels, res, twin_res)
        cols = st.columns(2)
        for col, (p, r, _), label in zip(cols, saved["runs"], labels):
            col.markdown(f"**{md(label)} · {md(p.name)}** · perplexity of its own output {r.perplexity:.2f} (a "
                         "sampling statistic)")
            col.markdown(colored_tokens_html([loaded.tokenizer.decode([e.token_id]) for e in r.events],
                                             [math.exp(e.logprob) for e in r.events]), unsafe_allow_html=True)
    if res.cache_kind == "compacted":
        st.subheader("Replay: the cache at step s")
        labels = live.labels_of(tr, loaded.tokenizer)
        r1, r2 = st.columns([3, 1])
        step = (r1.slider("Step", 0, len(res.events) - 1, len(res.events) - 1, key="gen_step")
                if len(res.events) > 1 else 0)
        which = r2.selectbox("Fade for", ["all layers", *range(cfg.n_layers)], key="gen_fade_layer")
        held = traces.held_at(tr, step)
        shade = live.held_fraction(tr, step) if which == "all layers" else held[int(which)]
        st.markdown(live.faded_text_html(labels[:len(shade) + 1], len(res.prompt_ids), shade), unsafe_allow_html=True)
        st.caption(("The more layers have dropped a token by this step, the fainter it is" if which == "all layers"
                    else f"Faded: dropped by layer {which} by this step") + "; generated tokens are underlined, the "
                   "one sampled at this step dashed (it enters the cache at the next).")
        strip, curve, lat = figures.figures(saved, loaded.tokenizer, cfg.mixer, step)
        show(strip, "gen_strip")
        drops = live.drops_frame(tr, labels)
        st.dataframe(drops[drops["step"] == step], hide_index=True, width="stretch")
        st.caption(f"The drops made at step {step} ({int((drops['step'] == step).sum())}); "
                   f"{len(drops)} over the whole generation.")
        show(curve, "gen_curve")
        show(lat, "gen_lat")
        files = traces.files(tr)
        d = st.columns(3)
        for col, (suffix, body) in zip(d, files.items()):
            body = access.public(body) if isinstance(body, str) else body  # serve mode: no server paths in files
            col.download_button(f"trace{suffix}", body, file_name=f"trace{suffix}", on_click="ignore",
                                key=f"dl_trace{suffix}", mime="application/json" if suffix == ".json" else "text/csv")
    else:
        st.markdown(colored_tokens_html([used_prompt] + list(table["token"]), [1.0] + list(table["prob"])),
                    unsafe_allow_html=True)
        st.caption("Background: probability of each generated token under the model (red low, green high).")
        show(*figures.figures(saved, loaded.tokenizer, cfg.mixer))
    st.dataframe(table, hide_index=True, width="stretch")
