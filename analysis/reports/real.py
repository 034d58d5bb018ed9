"""Real pretrained models pruned with our methods: docs/real.md and its POS figure, from the runs and their base.

    python -m analysis.reports.real --base assets/models/smollm2-135m RUN_DIR [RUN_DIR ...] [--data data/smollm2]
        [--source NAME=DIR:SPLIT|all ...] [--windows 24] [--policies METHOD,...]
        [--prompt-share 0.75] [--match RUN_NAME]
        [--window 512] [--max-windows N] [--pos-docs 6] [--out docs/real.md] [--figure docs/real_pos.png]
        [--matched RUN.json ...] [--parts DIR] [--ray [ADDRESS] [--ray-workers N] [--ray-threads T]]

--matched takes the held-out protocol from saved runs of analysis.reports.matched (--json; several processes can
each run some sources) instead of running it here: they must be runs of these models, base and window.

The headline tables are the held-out protocol (analysis.reports.matched): per source (default: the test split of
--data), every position scored and positions >= 100 apart, bootstrap intervals over windows, the training-free
policies at the --match model's sparsity. Perplexity and sparsity by context size use the pruning table's protocol
(analysis.reports.pruning: the test documents joined into windows of `window` tokens; a token's bucket is its
position in the window, so positions below 100 are not in it). Sparsity per layer and the part-of-speech view
(docs/methods.md#adaptively-sparse-attention: which tags are dropped, which trigger drops, per layer) come from the
first `pos-docs` test documents, each cut to one window, tagged with spaCy. Every model stays loaded; a window past a
model's context, past what a replay reads, or whose runs would not fit the memory budget beside them
(analysis.budgets) is refused before they load, naming the largest that fits.

The held-out protocol keeps each finished window under --parts (default: beside --out, docs/real.parts, removed once
the report is written when this run made it), so a rerun after an interruption or a failed window redoes only what
is missing; --ray computes its windows on Ray workers (analysis.reports.matched, docs/cluster.md; it needs a pruned
run), the rest of the report here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analysis import pruning
from analysis.budgets import config_of
from analysis.reports import matched
from analysis.text import tokenize, window
import kernels.settings  # (by its full name: `settings` here is the protocol's)
from models.checkpoint import load_model_dir
from analysis.reports.pruning import model_buckets
from models.data import load_documents
from models.device import add_arguments as add_device_arguments
from models.files import CheckpointError
from models.pruning import policies


def pos_view(loaded, docs: list[str], size: int) -> pd.DataFrame:
    """One token table (analysis.pruning.token_table) over several documents, positions kept per document."""
    nlp, tables = pruning.tagger(), []
    for i, text in enumerate(docs):
        toks = window(tokenize(loaded.tokenizer, text), 0, size)
        if len(toks.ids) < 2:
            continue
        text = text[:toks.offsets[-1][1]]
        keeps = pruning.keep_matrices(loaded.model, toks.ids)
        tables.append(pruning.token_table(keeps, toks.labels, pruning.pos_tags(text, toks.offsets, nlp)).assign(doc=i))
    return pd.concat(tables, ignore_index=True)


def ran_elsewhere(protocol: dict, runs: list[str], base: str, window: int) -> str | None:
    """Why a saved protocol run (analysis.reports.matched --json) is not of these models (None: it is): the same
    directories (resolved), the same window and, where the run saved them, the same weights."""
    want, had = [Path(d).resolve() for d in (*runs, base)], [Path(d).resolve() for d in (*protocol["models"],
                                                                                         protocol["base"])]
    if want != had:
        return f"it ran {', '.join(map(str, had))}, not {', '.join(map(str, want))}"
    if protocol["window"] != window:
        return f"it ran {protocol['window']}-token windows, not {window}"
    if protocol.get("weights") and not matched.same_weights(protocol["weights"], [base, *runs]):
        return "the weights in those directories changed since it ran"
    return None


def prunes(model_dir: str) -> bool:
    """Whether a run prunes, from its config before anything loads (one that cannot be read: left to the loader,
    whose error names the file)."""
    try:
        return bool(config_of(model_dir).prune)
    except CheckpointError:
        return True


def figure_path(figure: str, name: str, several: bool) -> Path:
    """figure itself for a single pruned run; with several, each run's name before the suffix."""
    path = Path(figure)
    return path.with_name(f"{path.stem}_{name}{path.suffix}") if several else path


def render(command: str, cards: dict, buckets: pd.DataFrame, layers: pd.DataFrame, rates: pd.DataFrame,
           triggers: pd.DataFrame, figures: dict[str, Path], protocol: tuple | None = None) -> str:
    """protocol: (analysis.reports.matched.evaluate's results, the matched model's name, the window, the prompt
    length or None), or None without a pruned run."""
    lines = ["# Real models: context pruning on SmolLM2-135M", "",
             f"Generated by `{command}`; do not edit by hand.", "",
             "## Runs", "", "| model | steps | trainable params | gamma | context | adapter | wall time | device |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for name, card in cards.items():
        tr, cfg = card.get("train", {}), card.get("config", {})
        params = card.get("trainable_params")   # (a card of a run trained from scratch has none)
        lines.append(f"| {name} | {card.get('steps', '-')} | {f'{params:,}' if isinstance(params, int) else '-'} | "
                     f"{tr.get('gamma', '-')} | {cfg.get('context', '-')} | {cfg.get('adapter') or '-'} | "
                     f"{card.get('wall_time_s', 0) / 60:.1f} min | {card.get('device', '-')} |"
                     if "steps" in card else f"| {name} (base) | - | - | - | - | - | - | - |")
    if protocol:
        results, match, window, prompt = protocol
        sp, (rsp, rcost) = matched.BAR_SPARSITY, matched.REGIME
        after = (f" and, after a {prompt}-token prompt, less than every policy matched over the queries that follow it "
                 "(SnapKV included)") if prompt else ""
        lines += ["", "## Against the training-free policies, in domain and out of it", "",
                  matched.preamble(match, window, prompt), "",
                  f"The bar (the held-out issue's): on every source, {match} drops at least {sp:.0%} of the context "
                  f"and costs less perplexity than every training-free policy matched to its sparsity{after}, each "
                  f"paired interval above 0 (not called with fewer than {matched.MIN_VERDICT_WINDOWS} windows); the "
                  "hindsight oracle reads the future: it is in the tables as a reference, not in the bar. A policy "
                  f"whose smallest budget leaves it more than {matched.MATCH_GAP:.0%} below that sparsity (it sees "
                  "more) cannot be matched: it is reported in the last column, not counted in the bar. The paper's "
                  "regime: "
                  f"at least {rsp:.0%} dropped for at most {rcost:+.0%} (point estimate, every position). Strongest "
                  f"policy: the one {match} leads by least.", ""]
        head = ("| source | windows | sparsity | cost vs dense [95 % CI] | beats every policy | strongest policy: lead "
                "[95 % CI] |")
        sep = "|---|---:|---:|---|---|---|"
        if prompt:
            head += " after the prompt: sparsity, cost | beats every policy | strongest policy: lead [95 % CI] |"
            sep += "---|---|---|"
        lines += [head + " bar met | paper's regime | policies short of its sparsity (their smallest budget): "
                  "sparsity, lead [95 % CI] |", sep + "---|---|---|"]
        word = {True: "yes", False: "no", None: "n/a"}

        def lead(name, value):
            return f"{name}: {value[0]:+.2%} [{value[1][0]:+.2%}, {value[1][1]:+.2%}]" if value else "-"

        for v in matched.verdict(results, match):
            row = (f"| {v['source']} | {v['windows']} | {v['sparsity']:.1%} | {v['cost']:+.2%} "
                   f"[{v['cost_ci'][0]:+.2%}, {v['cost_ci'][1]:+.2%}] | {word[v['beats_all']]} | "
                   f"{lead(v['strongest'], v['strongest_lead'])} |")
            if "prompt" in v:
                row += (f" {v['prompt_sparsity']:.1%}, {v['prompt_cost']:+.2%} | {word[v['prompt_beats_all']]} | "
                        f"{lead(v['prompt_strongest'], v['prompt_strongest_lead'])} |")
            short = "; ".join(f"{name}{' ' + where if where else ''}: {sp:.1%}, "
                              f"{lead_:+.2%} [{ci[0]:+.2%}, {ci[1]:+.2%}]"
                              for where, name, sp, lead_, ci in v["unmatched"]) or "-"
            lines.append(row + f" {word[v['bar']]} | {word[v['regime']]} | {short} |")
        lines += [""] + [ln.replace("## ", "### ", 1) if ln.startswith("## ") else ln
                         for ln in matched.sections(results, match)]
    lines += ["", "## Perplexity and sparsity by context size (test split; positions 100 and later only)", "",
              "| model | context | tokens | perplexity | vs base | sparsity |", "|---|---|---:|---:|---:|---:|"]
    base = buckets[buckets["model"] == buckets["model"].iloc[0]].set_index("bucket")["perplexity"]
    for _, r in buckets.iterrows():
        lines.append(f"| {r['model']} | {r['bucket']} | {r['tokens']:,} | {r['perplexity']:.3f} | "
                     f"{r['perplexity'] / base[r['bucket']] - 1:+.2%} | {r['sparsity']:.1%} |")
    if not layers.empty:
        lines += ["", "## Sparsity per layer", "", "| model | " + " | ".join(f"L{i}" for i in layers.columns) + " |",
                  "|---|" + "---:|" * len(layers.columns)]
        for name, row in layers.iterrows():
            lines.append(f"| {name} | " + " | ".join(f"{v:.0%}" for v in row) + " |")
        lines += ["", "## Parts of speech", "",
                  "Drop rate by POS tag, mean over layers (tokens counted once per layer):", "",
                  "| model | POS | tokens | drop rate |", "|---|---|---:|---:|"]
        for _, r in rates.iterrows():
            lines.append(f"| {r['model']} | {r['pos']} | {int(r['tokens']):,} | {r['drop_rate']:.1%} |")
        lines += ["", "Tags of the tokens whose queries dropped others (all layers):", "",
                  "| model | trigger POS | drops |", "|---|---|---:|"]
        for _, r in triggers.iterrows():
            lines.append(f"| {r['model']} | {r['trigger_pos']} | {int(r['drops']):,} |")
        for name, path in figures.items():
            lines += ["", f"![{name}: drop rate by POS and layer]({Path(path).name})"]
    return "\n".join(lines) + "\n"


def pruned_views(loaded, docs: list[str], window: int) -> tuple[pd.Series, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A pruned run's rows of the report on the first documents: the share each layer drops (every token but each
    window's last), drop rates by part of speech and layer (the figure's), by part of speech alone, and the parts of
    speech whose step triggers most drops."""
    name = loaded.path.name
    table = pos_view(loaded, docs, window)
    per_layer = table[table["position"] < table["position"].max()].groupby("layer")["dropped"].mean()
    rate = pruning.pos_drop_rates(table)
    by_pos = (rate.groupby("pos", as_index=False).agg(tokens=("tokens", "sum"), drop_rate=("drop_rate", "mean"))
              .assign(model=name).sort_values("drop_rate", ascending=False))
    trig = (table[table["dropped"]].groupby("trigger_pos").size().reset_index(name="drops")
            .assign(model=name).sort_values("drops", ascending=False).head(6))
    return per_layer, rate, by_pos, trig


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m analysis.reports.real")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--base", required=True)
    ap.add_argument("--data", default="data/smollm2")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="windows of the by-context-size table (default: all)")
    ap.add_argument("--pos-docs", type=int, default=6)
    ap.add_argument("--out", default="docs/real.md")
    ap.add_argument("--figure", default="docs/real_pos.png")
    ap.add_argument("--matched", nargs="+", default=None, metavar="RUN.json",
                    help="the held-out protocol's saved runs (analysis.reports.matched --json) instead of running it")
    matched.add_arguments(ap, default_source="test=DATA:test")
    matched.add_compute_arguments(ap, "--out")
    add_device_arguments(ap, dtype=None)  # perplexity in float32 on any device
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    policies.load_plugins(kernels.settings.get("MIXSCOPE_POLICIES"))  # the operator's own policies (docs/policies.md)
    saved = None
    if args.matched:
        given = [n for n in ("source", "match", "parts", "ray") if getattr(args, n)] + [
            n for n in ("policies", "windows", "prompt_share") if getattr(args, n) != ap.get_default(n)]
        if given:
            ap.error("--matched brings its own sources, policies, windows, prompt share and match, and runs nothing: "
                     "drop "
                     + ", ".join("--" + n.replace("_", "-") for n in given))
        try:
            saved = matched.merge(args.matched)
        except ValueError as e:
            ap.error(str(e))
        why = ran_elsewhere(saved[0], args.runs, args.base, args.window)
        if why:
            ap.error(f"--matched: {why}")
    args.source = args.source or [f"test={args.data}:test"]
    sources, names, prompt = matched.parse(ap, args, args.window) if not saved else ({}, [], None)
    matched.check_ray(ap, args)
    if args.ray and not any(map(prunes, args.runs)):
        ap.error("--ray computes the held-out protocol, which needs a pruned run (model.prune) among the runs; "
                 "the rest of the report runs here: drop --ray")
    matched.check_window(ap, [args.base, *args.runs], args.window)
    docs_text = load_documents(args.data, "test")
    buckets, cards, layer_rows, rates, triggers, figures, runs = [], {}, {}, [], [], {}, []
    for d in [args.base, *args.runs]:
        loaded = load_model_dir(d, device=args.device)
        name = loaded.path.name
        cards[name] = loaded.card
        runs.append(loaded)
        buckets += model_buckets(loaded, args.window, args.data, args.max_windows)
        if loaded.config.prune:
            layer_rows[name], rate, by_pos, trig = pruned_views(loaded, docs_text[:args.pos_docs], args.window)
            rates.append(by_pos)
            triggers.append(trig)
            if args.figure:  # one figure per pruned run, never one over another
                from analysis.export import figure_bytes
                figures[name] = figure_path(args.figure, name, len(args.runs) > 1)
                figures[name].write_bytes(figure_bytes(pruning.pos_heatmap(rate, f"{name}: drop rate by POS and layer"),
                                                       "png"))
    protocol, flags = None, ""
    if saved:
        settings, results = saved
        protocol = (results, settings["match"], args.window,
                    matched.prompt_length(settings["prompt_share"], args.window))
        flags = f" {matched.command_flags(settings)} (the protocol from runs joined by --matched)"
    elif any(r.config.prune for r in runs[1:]):
        match = matched.match_name(ap, args, runs[1:])
        parts = Path(args.parts) if args.parts else matched.default_parts(args.out)
        loaded = {"base": runs[0].model} | {Path(d).name: r.model for d, r in zip(args.runs, runs[1:])}
        try:
            results = matched.run_protocol(args, args.base, args.runs, [r.config.prune for r in runs[1:]], sources,
                                           names, match, prompt, parts, loaded, "real")
        except matched.HeldOutFailed as e:
            print(e, file=sys.stderr)
            return 1
        except ValueError as e:   # (parts of another protocol; a Ray cluster not reached, or workers that do not fit)
            print(f"real: {e}", file=sys.stderr)
            return 2
        protocol = (results, match, args.window, prompt)
        flags = " " + matched.command_flags(matched.settings(args, args.runs, match))
    command = ("python -m analysis.reports.real --base " + " ".join([args.base, *args.runs])
               + f" --window {args.window}" + (f" --max-windows {args.max_windows}" if args.max_windows else "")
               + f" --pos-docs {args.pos_docs}" + flags)
    text = render(command, cards, pd.DataFrame(buckets).drop(columns="method"), pd.DataFrame(layer_rows).T,
                  pd.concat(rates) if rates else pd.DataFrame(), pd.concat(triggers) if triggers else pd.DataFrame(),
                  figures, protocol)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    if protocol and not saved and not args.parts:
        matched.remove_parts(parts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
