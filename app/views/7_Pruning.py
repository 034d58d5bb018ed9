"""Pruning: which tokens a method drops, per layer and part of speech, and what it costs. The method is a model's
own learned context pruning (its rule) or a heuristic KV-cache eviction policy (StreamingLLM, TOVA, H2O, SnapKV) at
a budget, on any softmax attention model; two methods can be put side by side on one text at matched sparsity."""
from contextlib import nullcontext
from pathlib import Path

import pandas as pd
import streamlit as st

from analysis import live, pruning, scores, timeline, tokens, views
from analysis import pruning_figures as figures
from analysis.pruning import LEARNED, NOTHING
from analysis.pruning_figures import default_prompt, prunable
from app import heavy
from app.common import (LISTING_TTL_S, dense_base_path, directory_stamp, export_buttons, load, method_title,
                        model_paths, model_text_tokens, public, setup, shown_path, window_picker)
from app.plain import md
from models.checkpoint import CheckpointError, read_json, valid_sparsity
from models.delta import unfetched_base
from models.generate import layer_bytes_per_token
from models import snapshots
from models.pruning import policies


def first_pruned() -> str | None:
    """The page opens on the largest pruned model that opens without a download (configs only, nothing loaded):
    the real pruned SmolLM2 once its base is fetched (`make run` does it), else the small pruned model."""
    paths = model_paths()
    return largest_pruned(tuple(str(p) for p in paths), directory_stamp(paths))


@st.cache_data(max_entries=16, ttl=LISTING_TTL_S, show_spinner=False)
def largest_pruned(paths: tuple[str, ...], stamp: tuple) -> str | None:
    """first_pruned's choice among these directories: every config and card read in a slot (the server's queue
    counts it), once while their files are unchanged (stamp: app.common.directory_stamp)."""
    best = None
    with heavy.slot():
        for path in map(Path, paths):
            try:
                cfg = read_json(path / "config.json")
                if not cfg.get("prune") or unfetched_base(path):
                    continue
                card = read_json(path / "card.json") if (path / "card.json").is_file() else {}
                # the largest model; among equals, the one that drops most (its card's validation sparsity)
                size = (cfg.get("n_layers", 0) * cfg.get("d_model", 0), valid_sparsity(card) or 0.0)
                if best is None or size > best[0]:
                    best = (size, path.name)
            except (OSError, CheckpointError):
                continue
    return best[1] if best else None


# parameters: past this, a second forward or a second model waits to be asked for (MIXSCOPE_LARGE_MODEL overrides)
LARGE = views.large_model()
MAX_VIEW = views.PRUNING_VIEW  # tokens per analysed window (analysis.views says why)


@st.cache_data(max_entries=8, show_spinner=False)
def cached_method(path: str, ids: tuple[int, ...], method: str, budget: int | None, prompt: int | None,
                  labels: tuple[str, ...], tags: tuple[str, ...]):
    """pruning_figures.method_table, in a slot: one forward."""
    with heavy.slot():
        return figures.method_table(load(path).model, ids, labels, tags, method, budget, prompt)


def run_method(path, ids, method, budget=None, prompt=None):
    with st.spinner(f"{METHODS.get(method, 'nothing evicted')}: one forward over {len(ids)} tokens…"):
        return cached_method(path, ids, method, budget, prompt, tuple(view.labels), tuple(tags))  # (the window, below)


@st.cache_data(max_entries=32, show_spinner="Tagging parts of speech (spaCy)…")
def cached_tags(text: str, offsets: tuple[tuple[int, int], ...]):
    with heavy.slot():
        return pruning.pos_tags(text, list(offsets))


@st.cache_data(max_entries=64)
def cached_logprobs(path: str, ids: tuple[int, ...]):
    with heavy.slot():
        return tokens.token_logprobs(load(path).model, list(ids))


@st.cache_data(max_entries=4, show_spinner="Recording the interaction scores (one forward)…")
def cached_interaction(path: str, ids: tuple[int, ...]):
    with heavy.slot():
        return scores.recorded(load(path).model, list(ids))


def show(bundle, key: str, where=None) -> None:
    """A figure (a pruning_figures Bundle) and its export buttons, on the page or in a column (where)."""
    with where if where is not None else nullcontext():
        st.plotly_chart(bundle.fig, width="stretch")
        export_buttons(bundle.fig, bundle.table, bundle.name, loaded.path, text, bundle.settings, key=key)


@heavy.fragment
def score_view(layer: int) -> None:
    """x_{n,j} of one layer: the heatmap with the threshold, each token's closest call, one score's terms, the soft
    rule at a chosen alpha. A fragment: its controls redraw this part alone."""
    st.subheader(f"Why: layer {layer}'s interaction scores")
    if not st.toggle("Show the scores behind the decisions (one more forward)", key="prune_scores"):
        return
    rule = loaded.model.blocks[layer].mixer.pruning
    q, k = cached_interaction(path, ids)[layer]
    x = scores.layer_scores(rule, q, k)
    fate = scores.fates(x, rule.sinks)
    at = 0
    if n > scores.VIEW:
        at = int(st.slider("Drawn from token", 0, n - scores.VIEW, 0, key="prune_scores_at",
                           help=f"{scores.VIEW} queries x {scores.VIEW} keys at a time"))
    show(figures.scores_figure(x, fate, at, view.labels, layer, rule.sinks, settings), "scores")
    st.markdown("**Closest calls**: the tokens whose score came nearest the threshold while they were still held "
                "(a negative one is the drop itself: raised above 0 it delays the drop; a small positive one: lowered "
                "below 0 it drops the token there, earlier)")
    close = scores.fragile(fate, view.labels)
    st.dataframe(close.style.format({"score": "{:+.4f}"}), hide_index=True)
    if not len(close):
        return
    c1, c2 = st.columns(2)
    pick = c1.selectbox("Split a closest call over its terms", range(len(close)), key="prune_scores_pick",
                        format_func=lambda i: f"{close['token'][i]!r} (position {close['position'][i]}) at query "
                                              f"{close['closest_query'][i]}")
    j, q_at = int(close["position"][pick]), int(close["closest_query"][pick])
    show(figures.score_terms_figure(rule, q, k, q_at, j, layer, settings), "score_terms", c1)
    alpha = c2.slider("alpha of the soft rule (training raised it from 1 to 8)", *figures.ALPHA, figures.ALPHA[0], 0.5,
                      key="prune_scores_alpha")
    soft, hard = scores.soft_keep(x, alpha, rule.sinks), scores.soft_keep(x, float("inf"), rule.sinks)
    c2.metric(f"sparsity of this layer at alpha {alpha:g}", f"{scores.soft_sparsity(soft):.1%}",
              f"{scores.soft_sparsity(hard):.1%} at inference (the step)", delta_color="off")
    show(figures.soft_keep_figure(soft, at, view.labels, alpha, layer, settings), "soft_keep", c2)


@st.cache_data(max_entries=8, show_spinner="Running the model with the change, and without…")
def cached_change(path: str, ids: tuple[int, ...], labels: tuple[str, ...], layer: int, force: tuple | None,
                  patch: tuple[int, ...] | None, into: str = "pruned", site: str = "residual"):
    """pruning_figures.what_if_outcome of one forced decision or one patch, in a slot."""
    model = load(path).model
    with heavy.slot():
        return figures.what_if_outcome(model, ids, labels, layer, force, patch, into, site)


@heavy.fragment
def what_if(layer: int) -> None:
    """Force the rule's decision about one token at this layer (or from it on), or give this layer the dense twin's
    states at chosen positions, and see what changed downstream: a fragment, its controls redraw this part alone."""
    st.subheader(f"What if: force a decision at layer {layer}, or patch in the dense twin's states")
    if not st.toggle("Run a change (two more forwards)", key="prune_iv"):
        return
    kind = st.radio("Change", ["force a decision", "patch the dense twin's states", "patch into the dense twin"],
                    horizontal=True, key="prune_iv_kind",
                    help="Patch the dense twin's states: into the pruned model. Patch into the dense twin: the pruned "
                         "model's states, into its twin (the same weights with the rule off).")
    c1, c2, c3 = st.columns(3)
    force = patch = None
    site = "residual"
    into = "dense" if kind == "patch into the dense twin" else "pruned"
    if kind == "force a decision":
        j = int(c1.selectbox("Token", range(n - 1), key="prune_iv_token",
                             format_func=lambda i: f"{i}: {view.labels[i]!r}"))
        keep = c2.radio("Force it", ["kept", "dropped"], horizontal=True, key="prune_iv_keep") == "kept"
        at = None if keep else int(c2.number_input("from query", j + 1, n - 1, j + 1, key="prune_iv_at"))
        onward = c3.checkbox("and in every later layer", key="prune_iv_onward")
        force = (j, keep, at, onward)
    else:
        p = int(c1.number_input("Position", 0, n - 1, min(n - 1, n // 2), key="prune_iv_pos"))
        width = int(c2.number_input("and the next", 0, 64, 0, key="prune_iv_width",
                                    help="positions after it, patched too"))
        patch = tuple(range(p, min(n, p + width + 1)))
        site = "mixer" if c3.radio("Patch", ["the layer's input", "its attention output"], horizontal=True,
                                   key="prune_iv_site",
                                   help="The layer's input: the residual stream entering the block. Its attention "
                                        "output: what the block's attention adds, before the residual sum; the rest "
                                        "of the block is the model's own.") == "its attention output" else "residual"
        if into == "dense":
            c3.caption("Into the dense twin (the same weights with the rule off): the pruned model's own states. The "
                       "twin drops nothing, so no decision can change.")
        else:
            c3.caption("Donor: the same weights with the rule off (nothing dropped), reading the same text.")
    res = cached_change(path, ids, tuple(view.labels), layer, force, patch, into, site)
    s = res["summary"]
    m = st.columns(4)
    m[0].metric(f"perplexity from position {s['from']}", f"{s['ppl_from_after']:.3f}",
                f"{s['ppl_from_after'] - s['ppl_from_before']:+.3f} (was {s['ppl_from_before']:.3f})",
                delta_color="inverse", help=f"The {s['scored_from']} predictions the change can reach")
    m[1].metric("perplexity, whole window", f"{s['ppl_after']:.3f}", f"{s['ppl_after'] - s['ppl_before']:+.3f}",
                delta_color="inverse", help=f"All {s['scored']} predictions")
    m[2].metric("largest KL of a next-token distribution", f"{s['max_kl']:.4f}",
                f"at position {s['max_kl_position']}", delta_color="off")
    free = int((~res["changed"]["forced"]).sum())
    m[3].metric("later decisions changed", f"{free}", help="Drops in any layer that moved or appeared or vanished "
                "as a consequence (the forced ones not counted)")
    show(figures.what_if_figure(cfg.mixer, res, view.labels, layer, settings, force, patch, into, site), "iv")
    st.dataframe(res["by_layer"], hide_index=True)
    if len(res["changed"]):
        st.markdown("**Changed decisions** (the query that dropped the token before and after; -1: held to the end)")
        st.dataframe(res["changed"], hide_index=True)


@st.cache_data(max_entries=64, show_spinner=False)
def cached_snapshot(path: str, ids: tuple[int, ...], tags: tuple[str, ...], labels: tuple[str, ...], name: str,
                    stamp: float):
    snap = snapshots.entry(path, Path(path) / snapshots.DIR / name)   # (one header read, not the whole listing)
    if snap is None:
        raise snapshots.SnapshotError(f"{name} is gone or no longer a snapshot of this run")
    with heavy.slot():
        return timeline.at_snapshot(load(path).model, snap, list(ids), list(tags), list(labels))


@heavy.fragment
def timeline_view() -> None:
    """How the rule came to be: the run's snapshots (train.snapshots) replayed on this window, a slider over them."""
    shown, snaps = figures.shown_snapshots(path)
    if not snaps:
        return
    st.subheader("How the rule came to be")
    more = f" ({len(shown)} of {len(snaps)}, spread evenly)" if len(snaps) > len(shown) else ""
    if not st.toggle(f"Replay the training run's {len(shown)} snapshots{more} on this window ({len(shown)} forwards)",
                     key="prune_timeline"):
        return
    bar, parts = st.progress(0.0, text="replaying the snapshots…"), []
    for k, snap in enumerate(shown):   # (each cached: a second visit, or another window's return, is instant)
        try:
            parts.append(cached_snapshot(path, ids, tuple(tags), tuple(view.labels), snap["path"].name,
                                         snap["path"].stat().st_mtime))
        except (snapshots.SnapshotError, OSError) as e:   # (a model directory a user added may hold anything)
            st.warning(f"left out: {md(public(str(e)))}")
        bar.progress((k + 1) / len(shown), text=f"snapshot {k + 1}/{len(shown)} (step {snap['step']})")
    bar.empty()
    if not parts:
        return
    res = timeline.join(parts)
    steps = res["steps"]

    def name(i: int) -> str:
        alpha = steps["alpha"][i]
        return f"step {steps['step'][i]}" + (f" (alpha {alpha:.2f})" if alpha == alpha and alpha is not None else "")

    i = st.select_slider("Snapshot", list(range(len(steps))), len(steps) - 1, key="prune_timeline_at",
                         format_func=name)
    step = int(steps["step"][i])
    for bundle, key in zip(figures.timeline_figures(res, step, shown, settings),
                           ("timeline", "timeline_layers", "timeline_pos")):
        show(bundle, key)


def budget_controls(method: str, n: int, key: str, where) -> tuple[int, int | None]:
    """(budget in tokens, the prompt's length in prompt mode or None) from a share of the window or a token count."""
    low = min(policies.min_budget(method), n)
    a, b, c = where.columns(3)
    unit = a.radio("Budget as", ["share of the window", "tokens"], horizontal=True, key=f"{key}_unit")
    if unit == "tokens":
        budget = int(b.number_input(f"Budget (tokens held per layer, {low}-{n})", low, n, max(low, n // 4),
                                    key=f"{key}_tok"))
    else:
        share = b.slider("Budget (share of the window held per layer)", 0.01, 1.0, figures.SHARE, 0.01,
                         key=f"{key}_share")
        budget = figures.share_budget(method, n, share)
        b.caption(f"= {budget} tokens")
    prompt = None
    if policies.once(method):
        prompt = int(c.number_input("Prompt mode: the prompt ends after token", 2, n, default_prompt(n),
                                    key=f"{key}_prompt",
                                    help="The policy compresses the prompt once, to the budget; the tokens after "
                                         "it are read as generated and all kept."))
    return budget, prompt


def cache_bytes(model, table: pd.DataFrame, learned: bool) -> tuple[int, int]:
    """(bytes held after the text, bytes a dense cache holds): per layer, the tokens the rule has not dropped
    times a token's K/V (plus K_int for the learned rule, which keeps it)."""
    own, dense = layer_bytes_per_token(model)
    held = (1 - table["drop_share"]).groupby(table["layer"]).sum()   # under per-group eviction: a share per group
    per = own if learned else dense
    return int(round(sum(float(held[i]) * per[i] for i in range(len(per))))), table["position"].nunique() * sum(dense)


setup("Pruning")   # (loads the operator's plug-in policies first)
POLICIES = policies.methods()   # every registered policy (plug-ins too: docs/policies.md), in each mode
METHODS = {r: method_title(r) for r in (LEARNED, *POLICIES)}
st.caption("Which earlier tokens a model can do without. A context-pruned model drops token j for good at the first "
           "later query n whose interaction score x_{n,j} is not positive; a KV-cache eviction policy keeps a budget "
           "of tokens per layer, or per KV group (the query heads that share one K/V head), and evicts by position "
           "(StreamingLLM) or by attention (TOVA, H2O, SnapKV), step by step or once after a prompt; the oracle "
           "evicts what later queries of the full model attend to least, summed, reading the future: a reference, "
           "not a rule, and not always a bound (the sum favours tokens every query glances at over the newest ones "
           "the next queries need).")
loaded, text, toks = model_text_tokens(default=first_pruned(), accept=prunable)
cfg, path = loaded.config, str(loaded.path)
view, start = window_picker(toks, cfg.context, "prune_window", MAX_VIEW)
ids, n = tuple(view.ids), len(view.ids)
span, offsets = figures.tagged_span(text, view)   # (spaCy tags the window's own text)
tags = cached_tags(span, tuple(offsets))

options = ([LEARNED] if cfg.prune else []) + list(policies.REGISTRY)
mc1, mc2 = st.columns([3, 2])
method = mc1.selectbox("Method", options, key="prune_method",
                       format_func=lambda r: METHODS[LEARNED] if r == LEARNED else policies.REGISTRY[r].title or r)
budget = prompt = None
if method != LEARNED:
    modes = policies.REGISTRY[method].modes
    mode = mc2.radio("Mode", modes, index=modes.index(policies.REGISTRY[method].default_mode), horizontal=True,
                     key=f"prune_mode_{method}",
                     format_func={"step": "step by step", "prompt": "once after a prompt"}.get)
    method = policies.method_id(method, mode)
    budget, prompt = budget_controls(method, n, "prune_budget", st)
    if cfg.prune:
        st.caption("The policy runs on this model's own weights with its learned rule switched off.")
table, sp, lp = run_method(path, ids, method, budget, prompt)
settings = figures.settings_of(start, n, method, budget, prompt)


def nothing_ppl() -> float:
    """Perplexity of the same weights with every token kept (one forward, cached per window)."""
    return tokens.perplexity(run_method(path, ids, NOTHING)[2])


held_bytes, dense_bytes = cache_bytes(loaded.model, table, method == LEARNED)
n_params = sum(p.numel() for p in loaded.model.parameters())
# a large model on a CPU takes seconds a forward (SmolLM2 at 512 tokens: 1.5-3 s on 2 cores), so what needs one
# more runs when asked for; a small model or a GPU runs it at once
large_on_cpu = n_params > LARGE and loaded.model.wte.weight.device.type == "cpu"
ppl = tokens.perplexity(lp)
m = st.columns(5)
ppl0 = None
asked = large_on_cpu and m[3].toggle("perplexity with nothing evicted (one more forward)", key="prune_reference")
compare_with = [p for p in POLICIES if p != method]   # the side-by-side box's choices, below
# (the views below: a "compare with" choice that is the method itself now is reset by its box, not a need)
needed = st.session_state.get("prune_compare", "-") in compare_with or st.session_state.get("prune_all", False)
if not large_on_cpu or asked or needed:
    ppl0 = nothing_ppl()
    m[3].metric("perplexity (nothing evicted)", f"{ppl0:.2f}", help="The same weights with every token kept (a "
                "pruned model's rule switched off).")
m[0].metric("mean sparsity (all layers)", f"{sp['sparsity'].mean():.1%}")
m[1].metric("cache held after the text", f"{held_bytes / 1024:.1f} KiB",
            f"saved {live.saved(held_bytes, dense_bytes):.0%} of dense", delta_color="off",
            help="1 - held / a dense cache's (K, V of every token), as the Generate page defines saved")
m[2].metric(f"perplexity ({'pruned' if method == LEARNED else method})", f"{ppl:.2f}",
            None if ppl0 is None else f"{ppl / ppl0 - 1:+.2%} vs nothing evicted", delta_color="inverse")
base_dir = dense_base_path(loaded) if cfg.prune else None
# a large dense base is a second large model in memory: loaded only when asked for
ask = base_dir and n_params > LARGE and not m[4].toggle(f"compare with the dense base ({md(Path(base_dir).name)})",
                                                         key="prune_base")
if base_dir and not ask:
    try:
        base_lp = cached_logprobs(str(Path(base_dir)), ids)
        m[4].metric("perplexity (dense base)", f"{tokens.perplexity(base_lp):.2f}")
    except (CheckpointError, ValueError) as e:  # (load() refuses, in serve mode, a base outside its roots)
        m[4].caption(f"dense base {md(shown_path(base_dir))}: {md(public(str(e)))}")   # (serve mode: no path)
elif cfg.prune and not base_dir:
    m[4].caption("no dense base recorded on this model's card")

name = figures.method_name(method, budget)
layer = st.selectbox("Layer", range(cfg.n_layers), key="prune_layer")
st.markdown(pruning.struck_text_html(table, layer), unsafe_allow_html=True)
st.caption("Struck through: dropped by this layer before the end of the text (hover for when and at which token's "
           "step; StreamingLLM step by step evicts before that token's query attends, the others after). Dotted: "
           "dropped by some of the layer's KV groups only.")

first = {f.name: f for f in figures.method_figures(cfg.mixer, table, method, budget, settings)}
show(first["pruning_tokens_by_layer"], "tokmap")
show(first["pruning_pos_by_layer"], "pos")
if "pruning_triggers" in first:   # (the learned rule's, where it drops something)
    show(first["pruning_triggers"], "trig")
elif not len(pruning.trigger_counts(table)):
    st.info("No token is dropped in this text.")
else:
    st.caption("Triggers are shown for the learned rule: a policy evicts to stay within its budget, whichever token "
               "arrives.")
st.dataframe(sp.style.format({"sparsity": "{:.1%}"}), hide_index=True)
if method == LEARNED:
    score_view(layer)
    what_if(layer)
    timeline_view()

# ---- two methods side by side at matched sparsity -------------------------------------------------------------------
st.subheader("Side by side at matched sparsity")
target = float(sp["sparsity"].mean())
c1, c2 = st.columns([2, 3])
other = c1.selectbox("Compare with", ["-"] + compare_with,
                     format_func=lambda r: METHODS.get(r, "nothing (pick a policy)"), key="prune_compare")
if other != "-":
    prompt_b = prompt
    if policies.once(other) and prompt_b is None:
        prompt_b = int(c2.number_input("Prompt mode: the prompt ends after token", 2, n, default_prompt(n),
                                       key="prune_prompt_b"))
    budget_b = pruning.matched_budget(other, target, n, prompt_b)
    table_b, sp_layers_b, lp_b = run_method(path, ids, other, budget_b, prompt_b)
    sp_b = float(sp_layers_b["sparsity"].mean())
    ppl0 = ppl0 or nothing_ppl()   # (the comparison's table is read against it)
    ppl_b = tokens.perplexity(lp_b)
    name_b = figures.compare_name(other, budget_b)
    summary = pd.DataFrame([{"method": name, "sparsity": target, "perplexity": ppl,
                             "vs nothing evicted": ppl / ppl0 - 1},
                            {"method": name_b, "sparsity": sp_b, "perplexity": ppl_b,
                             "vs nothing evicted": ppl_b / ppl0 - 1}])
    st.dataframe(summary.style.format({"sparsity": "{:.1%}", "perplexity": "{:.2f}", "vs nothing evicted": "{:+.2%}"}),
                 hide_index=True)
    st.caption(f"{other}'s budget is the one whose sparsity on a {n}-token text is nearest {target:.1%} "
               "(it follows from the length alone).")
    if abs(sp_b - target) > 0.02:
        st.warning(f"{other} cannot match {target:.1%} here: its budget runs from {policies.min_budget(other)} "
                   f"tokens to the whole window, which gives {sp_b:.1%} at the nearest.")
    cmp, prof = figures.comparison_figures(name, table, other, budget_b, table_b, settings)
    show(cmp, "cmp")
    d = cmp.table
    by_layer = pruning.disagreement_by_layer(d).rename(columns={"a only": f"{name} only", "b only": f"{name_b} only"})
    st.dataframe(by_layer.style.format({"overlap": "{:.0%}"}), hide_index=True)
    st.markdown("**Tokens they disagree on** (layers in which only one of them dropped it)")
    st.dataframe(pruning.disputed_tokens(d).rename(columns={"a_only": f"{name} only", "b_only": f"{name_b} only"}),
                 hide_index=True)
    show(prof, "prof")

if st.toggle("Every policy at this sparsity (one forward each, each in its default mode)", key="prune_all"):
    rows, tables = [{"method": name, "budget": budget, "sparsity": target, "perplexity": ppl}], {name: table}
    ppl0 = ppl0 or nothing_ppl()
    bar = st.progress(0.0, text="running the policies…")
    plan = figures.every_policy_plan(method, target, n, prompt)
    for i, (p, bp, prompt_p) in enumerate(plan):
        t_p, sp_p, lp_p = run_method(path, ids, p, bp, prompt_p)
        tables[f"{p} at {bp}"] = t_p
        rows.append({"method": p, "budget": bp, "sparsity": float(sp_p["sparsity"].mean()),
                     "perplexity": tokens.perplexity(lp_p)})
        bar.progress((i + 1) / len(plan), text=f"{p} done")
    bar.empty()
    every = pd.DataFrame(rows).assign(vs_nothing_evicted=lambda f: f["perplexity"] / ppl0 - 1)
    every["budget"] = every["budget"].astype("Int64")  # tokens (none for the learned rule)
    st.dataframe(every.style.format({"sparsity": "{:.1%}", "perplexity": "{:.2f}", "vs_nothing_evicted": "{:+.2%}"}),
                 hide_index=True)
    off = [r["method"] for r in rows[1:] if abs(r["sparsity"] - target) > 0.02]
    if off:
        st.caption(f"Not matched (their smallest or largest budget is as near as they get): {', '.join(off)}.")
    read = {prompt_p for _, _, prompt_p in plan} - {None}
    if read:
        st.caption(f"Policies in prompt mode read the first {read.pop()} tokens as the prompt.")
    show(figures.every_policy_figure(tables, settings), "profall")
