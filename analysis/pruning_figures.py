"""The Pruning page's figures from a model, a text and the page's settings, so that the page (app/views/7_Pruning.py)
and the command line (analysis.export) draw the same ones. Each is an analysis.bundle.Bundle named as the page's
export buttons name their files (pruning_tokens_by_layer, pruning_scores, ...), with the settings its sidecar records.

The page keeps its widgets, caches and layout and calls these functions in the order it shows their results: the
runs (method_table, scores.recorded, what_if_outcome, timeline.at_snapshot) are model in, tables out; the *_figure(s)
functions are tables in, Bundles out. page_figures runs the page's whole chain for one set of settings, each
setting defaulting to what the page opens on.
"""
from __future__ import annotations

from analysis import intervene as change, pruning, scores, timeline, views
from analysis.bundle import Bundle
from analysis.pruning import LEARNED, NOTHING
from analysis.text import Tokens, check_text, tokenize, window
from models import snapshots
from models.pruning import intervene, policies

SHARE = 0.25            # the page's opening budget: this share of the window held per layer
ALPHA = (1.0, 8.0)      # the soft rule's alpha, as the page's slider allows it (training raised it from 1 to 8)


def prunable(loaded) -> str | None:
    """None when the page can show this model: a pruned one (its rule and the policies) or a dense softmax one
    (the policies); otherwise why not."""
    cfg = loaded.config
    if cfg.prune:
        return None
    if not loaded.model.blocks[0].mixer.replays_policies:
        return ("an Extractor mixes its past inputs by lag and keeps no per-token cache to prune or evict from: pick "
                "a softmax attention model.")
    if cfg.pattern != "dense":
        return f"this model attends through a fixed {cfg.pattern} pattern: pick a dense or a pruned model."
    return None


def default_method(cfg) -> str:
    """What the page opens on: a pruned model's own rule, else the first registered policy in its default mode."""
    if cfg.prune:
        return LEARNED
    name, cls = next(iter(policies.REGISTRY.items()))
    return policies.method_id(name, cls.default_mode)


def default_prompt(n: int) -> int:
    """The prompt of a policy in prompt mode unless the user says otherwise: the first three quarters of the window."""
    return max(2, 3 * n // 4)


def share_budget(method: str, n: int, share: float = SHARE) -> int:
    """A policy's budget in tokens from a share of an n-token window, as the page rounds it (at least the policy's
    smallest budget, at most the window)."""
    low = min(policies.min_budget(method), n)
    return max(low, min(n, round(share * n)))


def method_name(method: str, budget: int | None) -> str:
    """How the page's titles and tables name a method: "learned pruning", "nothing evicted", "tova at 12 tokens"."""
    return {LEARNED: "learned pruning", NOTHING: "nothing evicted"}.get(method, f"{method} at {budget} tokens")


def compare_name(other: str, budget: int) -> str:
    """How the side-by-side view names the policy beside the first method."""
    return f"{policies.title(other)} at {budget} tokens"


def window_of(toks: Tokens, context: int, start: int = 0) -> Tokens:
    """The window the page analyses: the whole text when it fits the page's view (analysis.views.PRUNING_VIEW, at
    most the model's context), else the view's worth of tokens from `start` (the page's slider)."""
    size = views.view(views.PRUNING_VIEW, context)
    if len(toks.ids) <= size:
        if start:
            raise ValueError(f"the text has {len(toks.ids)} tokens, one window of at most {size}: it starts at 0")
        return toks
    if not 0 <= start <= len(toks.ids) - size:
        raise ValueError(f"window start {start}: the text has {len(toks.ids)} tokens and a window {size}, so it "
                         f"starts at 0-{len(toks.ids) - size}")
    return window(toks, start, size)


def tagged_span(text: str, view: Tokens) -> tuple[str, list[tuple[int, int]]]:
    """The window's own text and its tokens' offsets in it: what spaCy tags (analysis.pruning.pos_tags), so a
    window is tagged the same wherever it starts."""
    a, b = view.offsets[0][0], view.offsets[-1][1]
    return text[a:b], [(x - a, y - a) for x, y in view.offsets]


def method_table(model, ids, labels, tags, method: str, budget: int | None = None, prompt: int | None = None):
    """(token table, sparsity per layer, log-probabilities) of one method on one window: one forward. The masks
    [layers, rows, T, T] are not kept (per KV group on SmolLM2 at 1,024 tokens: 94 MB)."""
    keeps, dropped_at, lp = pruning.method_run(model, list(ids), method, budget, prompt)
    return pruning.token_table(keeps, list(labels), list(tags), dropped_at), pruning.sparsity_per_layer(keeps), lp


def settings_of(start: int, n: int, method: str, budget: int | None, prompt: int | None) -> dict:
    """What every Pruning figure's sidecar records of the view."""
    return {"window_start": start, "tokens": n, "method": method, "budget": budget, "prompt": prompt}


# ---- figures -------------------------------------------------------------------------------------------------------

def method_figures(mixer: str, table, method: str, budget: int | None, settings: dict) -> list[Bundle]:
    """The page's first view: the token x layer map, the part of speech by layer map and, for the learned rule on a
    text where it drops something, which parts of speech trigger the drops."""
    name = method_name(method, budget)
    rates = pruning.pos_drop_rates(table)
    out = [Bundle("pruning_tokens_by_layer",
                  pruning.token_layer_figure(table, f"{mixer}, {name}: tokens dropped per layer"), table, settings),
           Bundle("pruning_pos_by_layer",
                  pruning.pos_heatmap(rates, f"{name}: share of tokens dropped, by part of speech and layer"), rates,
                  settings)]
    counts = pruning.trigger_counts(table)
    if len(counts) and method == LEARNED:
        out.append(Bundle("pruning_triggers", pruning.triggers_figure(counts, "which parts of speech trigger drops"),
                          counts, settings))
    return out


def scores_figure(x, fate, at: int, labels: list[str], layer: int, sinks: int, settings: dict) -> Bundle:
    """Layer `layer`'s interaction scores x_{n,j} (scores.layer_scores) from query and key `at` on, with each token's
    fate (scores.fates)."""
    fig = scores.score_figure(x, fate, at, labels, f"layer {layer}: x_n,j (a token is dropped at the first query "
                                                   "whose score is not positive)", sinks)
    return Bundle("pruning_scores", fig, fate, settings | {"layer": layer, "from": at})


def score_terms_figure(rule, q, k, query: int, token: int, layer: int, settings: dict) -> Bundle:
    """x_{query,token} split over the rule's terms (scores.split): the page's view of one closest call."""
    terms = scores.split(rule, q, k, query, token)
    bars = scores.split_figure(terms, 12, f"x_{query},{token} = {terms['value'].sum():+.4f}, term by term")
    return Bundle("pruning_score_terms", bars, terms, settings | {"layer": layer, "query": query, "token": token})


def soft_keep_figure(soft, at: int, labels: list[str], alpha: float, layer: int, settings: dict) -> Bundle:
    """The soft keep structure I_{k,j} at `alpha` (scores.soft_keep); its table is built when written (a 256 x 256
    view is 33,000 rows)."""
    fig = scores.soft_figure(soft, at, labels, f"I_k,j under sigma_alpha, alpha {alpha:g}")
    return Bundle("pruning_soft_keep", fig, lambda: scores.soft_table(soft, at, labels),
                  settings | {"layer": layer, "alpha": alpha, "from": at})


def check_scores_view(n: int, at: int, alpha: float) -> None:
    """ValueError unless the scores view of an n-token window can start at token `at` and draw the soft rule at
    `alpha` (the page's slider ranges)."""
    most = max(0, n - scores.VIEW)
    if not 0 <= at <= most:
        raise ValueError(f"scores from token {at}: the view draws {scores.VIEW} of the window's {n} tokens, from "
                         f"0-{most}")
    if not ALPHA[0] <= alpha <= ALPHA[1]:
        raise ValueError(f"alpha {alpha:g}: the soft rule is drawn at alpha {ALPHA[0]:g}-{ALPHA[1]:g}")


def score_figures(model, ids, labels: list[str], layer: int, settings: dict, at: int = 0, pick: int = 0,
                  alpha: float = 1.0, recorded=None) -> list[Bundle]:
    """The page's "why" view of one layer: its scores from token `at` on, the `pick`-th closest call (scores.fragile)
    split over its terms, and the soft rule at `alpha`. recorded: scores.recorded(model, ids), when already run."""
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer}: the model has layers 0-{model.config.n_layers - 1}")
    check_scores_view(len(ids), at, alpha)
    rule = model.blocks[layer].mixer.pruning
    q, k = (recorded or scores.recorded(model, list(ids)))[layer]
    x = scores.layer_scores(rule, q, k)
    fate = scores.fates(x, rule.sinks)
    out = [scores_figure(x, fate, at, labels, layer, rule.sinks, settings)]
    close = scores.fragile(fate, labels)
    if len(close):
        if not 0 <= pick < len(close):
            raise ValueError(f"closest call {pick}: the view lists {len(close)} (0-{len(close) - 1})")
        out.append(score_terms_figure(rule, q, k, int(close["closest_query"][pick]), int(close["position"][pick]),
                                      layer, settings))
        out.append(soft_keep_figure(scores.soft_keep(x, alpha, rule.sinks), at, labels, alpha, layer, settings))
    return out


def what_if_outcome(model, ids, labels, layer: int, force: tuple | None = None, patch=None, into: str = "pruned",
                    site: str = "residual") -> dict:
    """analysis.intervene's outcome of one forced decision (force: token, keep, at, onward) or one patch of `layer`'s
    states at `site` (its input or its mixer output) at positions `patch` (into "pruned": the dense twin's states
    into the pruned model; "dense": the pruned model's into its twin): two forwards (three with the donor's)."""
    if force is not None:
        return change.force_outcome(model, list(ids), list(labels), [intervene.Force(layer, *force)])
    return change.patch_outcome(model, list(ids), list(labels), layer, list(patch), model, into, site)


def what_if_figure(mixer: str, outcome: dict, labels: list[str], layer: int, settings: dict,
                   force: tuple | None = None, patch=None, into: str = "pruned", site: str = "residual") -> Bundle:
    """What the change (what_if_outcome's) did downstream, per position, titled with the change in words."""
    if force is not None:
        what = change.describe(intervene.Force(layer, *force), labels)
        token, keep, at, onward = force
        how = {"token": token, "keep": keep, "at": at, "onward": onward}
    else:
        what = change.describe_patch(layer, list(patch), into, site=site)
        how = {"patch": list(patch), "donor": "twin", "into": into, "site": site}
    fig = change.effect_figure(outcome["effects"], outcome["summary"]["from"], f"{mixer}: {what}")
    return Bundle("pruning_what_if", fig, outcome["effects"], settings | {"layer": layer, **how})


def shown_snapshots(model_dir) -> tuple[list[dict], list[dict]]:
    """(the snapshots the page replays: at most analysis.views.MAX_SNAPSHOTS, spread evenly; all of the run's)."""
    snaps = snapshots.listing(model_dir)
    return snapshots.keep_evenly(snaps, views.MAX_SNAPSHOTS), snaps


def timeline_figures(res: dict, step: int, shown: list[dict], settings: dict) -> list[Bundle]:
    """How the rule came to be (timeline.join of the shown snapshots' replays), at snapshot step `step`."""
    steps = res["steps"]
    spec = settings | {"snapshot_step": step, "snapshots": [s["path"].name for s in shown]}
    rates = res["pos"][res["pos"]["step"] == step]
    return [Bundle("pruning_timeline",
                   timeline.steps_figure(steps, step, "sparsity and the first tokens over training (this window)"),
                   steps, spec),
            Bundle("pruning_timeline_layers",
                   timeline.layers_figure(res["layers"], step, f"each layer's sparsity at step {step}"), res["layers"],
                   spec),
            Bundle("pruning_timeline_pos",
                   pruning.pos_heatmap(rates, f"step {step}: share of tokens dropped, by part of speech and layer"),
                   rates, spec)]


def compare_prompt(other: str, prompt: int | None, n: int, asked: int | None = None) -> int | None:
    """The prompt the policy beside the first method reads: the first method's, else for a policy in prompt mode
    `asked` or the page's default."""
    if policies.once(other) and prompt is None:
        return default_prompt(n) if asked is None else asked
    return prompt


def comparison_figures(name: str, table, other: str, budget_b: int, table_b, settings: dict) -> list[Bundle]:
    """The first method (`name`, its token table) beside policy `other` at `budget_b`: who drops each token, and what
    each hides by part of speech."""
    name_b = compare_name(other, budget_b)
    d = pruning.disagreement(table, table_b)
    prof = pruning.pos_profile({name: table, name_b: table_b})
    return [Bundle("pruning_disagreement",
                   pruning.disagreement_figure(d, (name, name_b), "who drops each token by the end of the text"), d,
                   settings | {"compare": other, "budget_b": budget_b}),
            Bundle("pruning_pos_profile",
                   pruning.pos_profile_figure(prof, "hidden from later queries, by part of speech (all layers)"), prof,
                   settings | {"compare": other})]


def every_policy_methods(method: str) -> list[str]:
    """The policies the every-policy view runs beside `method`: each in its default mode."""
    defaults = [policies.method_id(p, c.default_mode) for p, c in policies.REGISTRY.items()]
    return [p for p in defaults if p != method]


def every_policy_plan(method: str, target: float, n: int, prompt: int | None) -> list[tuple[str, int, int | None]]:
    """(policy, its budget matched to `target` sparsity on n tokens, the prompt it reads or None) of every policy the
    every-policy view runs beside `method`; a policy in prompt mode reads the first method's prompt or the default."""
    prompt_all = prompt or default_prompt(n)
    return [(p, pruning.matched_budget(p, target, n, prompt_all), prompt_all if policies.once(p) else None)
            for p in every_policy_methods(method)]


def every_policy_figure(tables: dict, settings: dict) -> Bundle:
    """Every method's token table (the first method's, then each policy's at its matched budget, named
    "<policy> at <budget>") as one part-of-speech profile."""
    allprof = pruning.pos_profile(tables)
    fig = pruning.pos_profile_figure(allprof, "every method at matched sparsity: hidden from later queries, by part "
                                              "of speech")
    return Bundle("pruning_pos_profile_all", fig, allprof, settings)


# ---- the page's whole chain ----------------------------------------------------------------------------------------

def checked_method(method: str, budget: int | None, share: float, prompt: int | None, n: int
                   ) -> tuple[int | None, int | None]:
    """(budget, prompt) of the method on an n-token window: a policy's budget from `share` unless given, its prompt
    by default in prompt mode; ValueError for a setting the method does not take or a value out of range."""
    if method == LEARNED:
        if budget is not None or prompt is not None:
            raise ValueError("the learned rule has no budget and no prompt: those are a policy's")
        return None, None
    if budget is None and not 0 < share <= 1:
        raise ValueError(f"share {share:g}: a budget is a share of the window in (0, 1]")
    budget = share_budget(method, n, share) if budget is None else budget
    low = min(policies.min_budget(method), n)
    if not low <= budget <= n:
        raise ValueError(f"budget {budget}: {method} holds {low}-{n} tokens of this {n}-token window")
    if policies.once(method):
        prompt = default_prompt(n) if prompt is None else prompt
    elif prompt is not None:
        raise ValueError(f"{method} evicts step by step: a prompt is for a policy in prompt mode ({method}:prompt)")
    if prompt is not None and not 2 <= prompt <= n:
        raise ValueError(f"prompt {prompt}: the prompt ends after token 2-{n} of this {n}-token window")
    return budget, prompt


def checked_change(cfg, n: int, layer: int, force: tuple | None, patch, into: str, site: str) -> list[int] | None:
    """The what-if view's change, checked: a forced decision or patched positions (sorted, unique), not both."""
    if force is not None and patch is not None:
        raise ValueError("one change at a time: force a decision or patch states, not both")
    if force is not None:
        intervene.check_forces([intervene.Force(layer, *force)], cfg.n_layers, n)
    if patch is None:
        return None
    patch = sorted(set(int(p) for p in patch))
    if not patch or not 0 <= patch[0] <= patch[-1] < n:
        raise ValueError(f"patch {patch}: positions of this {n}-token window are 0-{n - 1}")
    if into not in ("pruned", "dense") or site not in intervene.SITES:
        raise ValueError(f"patch into {into!r} at {site!r}: into 'pruned' (the dense twin's states into the pruned "
                         f"model) or 'dense' (the other way), at {' or '.join(map(repr, intervene.SITES))}")
    return patch


def checked_timeline(loaded, snapshot_step: int | None) -> list[dict]:
    """The training snapshots the timeline view replays; ValueError when there are none or the step is not one."""
    shown, _ = shown_snapshots(loaded.path)
    if not shown:
        raise ValueError(f"{loaded.path.name} holds no training snapshots (train.snapshots) to replay")
    steps = [s["step"] for s in shown]
    if snapshot_step is not None and snapshot_step not in steps:
        raise ValueError(f"snapshot step {snapshot_step}: the snapshots replayed are at steps {steps}")
    return shown


def checked_compare(compare: str | None, method: str, prompt: int | None, n: int, asked: int | None) -> int | None:
    """The prompt the policy beside the method reads (compare_prompt), None without one; ValueError for the method
    itself or a prompt of its own where it reads the method's."""
    if compare is None:
        return None
    if compare in (LEARNED, method):
        raise ValueError(f"compare with {compare!r}: a policy other than the method ({method})")
    prompt_b = compare_prompt(compare, prompt, n, asked)
    if asked is not None and prompt_b != asked:
        raise ValueError(f"{compare} reads the method's prompt ({prompt}): a prompt of its own is for a policy in "
                         "prompt mode beside a method without one")
    if prompt_b is not None and not 2 <= prompt_b <= n:
        raise ValueError(f"prompt {prompt_b}: the prompt ends after token 2-{n} of this {n}-token window")
    return prompt_b


def page_figures(loaded, text: str, *, start: int = 0, method: str | None = None, budget: int | None = None,
                 share: float = SHARE, prompt: int | None = None, layer: int = 0, scores_view: bool = False,
                 scores_from: int = 0, closest: int = 0, alpha: float = 1.0, force: tuple | None = None,
                 patch=None, into: str = "pruned", site: str = "residual", timeline_view: bool = False,
                 snapshot_step: int | None = None, compare: str | None = None, compare_prompt_end: int | None = None,
                 every: bool = False) -> list[Bundle]:
    """Every figure the Pruning page draws for one model (a models.checkpoint.LoadedModel), one text and these
    settings, in the page's order. Each setting is a control of the page, and defaults to what the page opens on:

    start: the window's first token (texts longer than the page's 1,024-token view); method: LEARNED or a policy's
    method id ("h2o", "snapkv:step"; default: default_method); budget: tokens held per layer, or `share` of the
    window; prompt: where a policy in prompt mode's prompt ends (default: three quarters of the window); layer: the
    layer the "why" and "what if" views are about.
    The learned rule's views, each off unless asked for: scores_view (drawn from token scores_from; the closest call
    at index `closest` in scores.fragile's order split into its terms; the soft rule at alpha); a change (force:
    (token, keep, at, onward), or patch: positions, into "pruned" | "dense", site "residual" | "mixer");
    timeline_view (the run's snapshots replayed, drawn at snapshot_step, default the last).
    compare: a policy beside the method at matched sparsity (compare_prompt_end: its prompt in prompt mode when the
    method has none); every: every policy in its default mode at that sparsity."""
    cfg = loaded.config
    why = prunable(loaded)
    if why:
        raise ValueError(why)
    for m in (method, compare):
        if m not in (None, LEARNED):
            policies.parse(m)   # (a ValueError naming the registered policies)
    method = method or default_method(cfg)
    if method == LEARNED and not cfg.prune:
        raise ValueError("the learned rule is a pruned model's: this model has none (pick a policy)")
    toks = tokenize(loaded.tokenizer, check_text(text))   # (at most analysis.views.MAX_CHARS characters)
    if len(toks.ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    view = window_of(toks, cfg.context, start)
    ids, labels, n = view.ids, view.labels, len(view.ids)
    # every setting is checked before the first forward: a mistake costs nothing
    budget, prompt = checked_method(method, budget, share, prompt, n)
    changed = force is not None or patch is not None
    if (scores_view or changed or timeline_view) and method != LEARNED:
        raise ValueError(f"the why, what-if and timeline views are the learned rule's: the method is {method}")
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer}: the model has layers 0-{cfg.n_layers - 1}")
    if scores_view:
        check_scores_view(n, scores_from, alpha)
    patch = checked_change(cfg, n, layer, force, patch, into, site)
    shown = checked_timeline(loaded, snapshot_step) if timeline_view else []
    prompt_b = checked_compare(compare, method, prompt, n, compare_prompt_end)

    span, offsets = tagged_span(text, view)
    tags = pruning.pos_tags(span, offsets)
    table, sp, _ = method_table(loaded.model, ids, labels, tags, method, budget, prompt)
    settings = settings_of(start, n, method, budget, prompt)
    out = method_figures(cfg.mixer, table, method, budget, settings)
    if scores_view:
        out += score_figures(loaded.model, ids, labels, layer, settings, scores_from, closest, alpha)
    if changed:
        res = what_if_outcome(loaded.model, ids, labels, layer, force, patch, into, site)
        out.append(what_if_figure(cfg.mixer, res, labels, layer, settings, force, patch, into, site))
    if timeline_view:
        res = timeline.join([timeline.at_snapshot(loaded.model, s, ids, tags, labels) for s in shown])
        out += timeline_figures(res, shown[-1]["step"] if snapshot_step is None else snapshot_step, shown, settings)
    target = float(sp["sparsity"].mean())
    name = method_name(method, budget)
    if compare is not None:
        budget_b = pruning.matched_budget(compare, target, n, prompt_b)
        table_b, _, _ = method_table(loaded.model, ids, labels, tags, compare, budget_b, prompt_b)
        out += comparison_figures(name, table, compare, budget_b, table_b, settings)
    if every:
        tables = {name: table}
        for p, bp, prompt_p in every_policy_plan(method, target, n, prompt):
            tables[f"{p} at {bp}"] = method_table(loaded.model, ids, labels, tags, p, bp, prompt_p)[0]
        out.append(every_policy_figure(tables, settings))
    return out
