"""Learned context pruning against heuristic KV-cache eviction (docs/methods.md): docs/eviction.md.

    python -m analysis.reports.eviction --dense DIR --pruned DIR [--data data] [--window 512] [--windows 8]
        [--policies METHOD,...] [--targets 0.5,0.8] [--prompt-share 0.75]
        [--out docs/eviction.md] [--figure docs/eviction.png] [--pos-figure docs/eviction_pos.png]

Every model reads the same consecutive windows of the test split. Each policy runs on the dense model through
models.pruning.replay (one forward per window; the decisions token-by-token decoding makes, tests/test_replay.py),
the pruned model through its own full forward (what its decode makes, tests/test_policies.py). Two readings:

1. The whole window read as it arrives: the step policies (StreamingLLM, TOVA, H2O) at the budgets whose sparsity
   is nearest the pruned model's own and each --targets value (the sparsity a budget gives follows from the window
   length alone). A per-POS profile of what each method drops at the pruned model's sparsity goes in one figure.
2. Prompt, then generation: the first --prompt-share of each window is a prompt and only the queries after it
   are scored, so SnapKV (which compresses a prompt once) can take part; every policy's budget is matched to the
   pruned model's sparsity over those queries.

A window past either model's context, past what a replay reads, or whose runs would not fit the memory budget
beside both models (analysis.budgets) is refused before they load, naming the largest that fits.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from tqdm import tqdm

from analysis import pruning
from analysis.budgets import check_dirs, report_window_bytes
from analysis.plain import plotly_text
from analysis.text import from_ids
from kernels import settings
from models.checkpoint import load_model_dir
from models.data.corpus import load_tokens
from models.device import add_arguments as add_device_arguments
from models.memory import OverBudget
from models.pruning import mean_sparsity, policies


class Pool:
    """Pooled log-likelihood and query sparsity of one method over windows: the queries that predict a token (all
    but the last), from query `first` on."""

    def __init__(self):
        self.nll = self.tokens = self.hidden = self.queries = 0.0

    def add(self, visible, logprobs, first: int = 0):
        """visible [L,R,T,T] (uint8 or bool; R: KV groups or 1), logprobs [T-1] (query i predicts token i+1)."""
        import torch
        v = torch.as_tensor(visible)
        queries = v.shape[-1] - 1 - first
        # the queries first..T-2 (query 0 counted as 0 when first is 0, as perplexity pools it), mean over layers;
        # one layer's masks in float at a time (all of them would be 4 bytes a cell)
        per_layer = torch.stack([mean_sparsity(layer.float(), count_first=True, start=first, stop=-1) for layer in v])
        self.hidden += float(per_layer.mean()) * queries
        self.queries += queries
        lp = logprobs[first:]
        self.nll -= float(lp.sum())
        self.tokens += len(lp)

    def row(self) -> dict:
        return {"perplexity": math.exp(self.nll / self.tokens), "sparsity": self.hidden / self.queries,
                "tokens": int(self.tokens)}


def figure(table: pd.DataFrame, title: str, dense: float | None = None) -> go.Figure:
    """Perplexity against sparsity, a line per method. The title (a model's name) and the methods' names (an
    operator's policies may be named anything) are raw text, drawn as their characters."""
    fig = go.Figure()
    for name, part in table.groupby("method", sort=False):
        fig.add_trace(go.Scatter(x=part["sparsity"], y=part["perplexity"], mode="lines+markers",
                                 name=plotly_text(name)))
    if dense is not None:
        fig.add_hline(y=dense, line_dash="dot", annotation_text=f"dense {dense:.2f}",
                      annotation_position="bottom right")
    fig.update_layout(title=plotly_text(title), xaxis_title="sparsity (share of earlier tokens a query cannot see)",
                      yaxis_title="perplexity", height=420)
    return fig


def table_md(table: pd.DataFrame, dense: float) -> list[str]:
    lines = ["| method | model | budget | sparsity | perplexity | vs dense |", "|---|---|---:|---:|---:|---:|"]
    for _, r in table.iterrows():
        budget = "-" if pd.isna(r["budget"]) else f"{int(r['budget'])}"
        if budget != "-" and int(r["budget"]) == policies.min_budget(r["method"]):
            budget += " (its smallest)"
        lines.append(f"| {r['method']} | {r['model']} | {budget} | {r['sparsity']:.1%} | {r['perplexity']:.3f} | "
                     f"{r['perplexity'] / dense - 1:+.2%} |")
    return lines


def render(command: str, whole: pd.DataFrame, split: pd.DataFrame, profile: pd.DataFrame, window: int, n_windows: int,
           prompt: int, figures: dict[str, str | None]) -> str:
    lines = ["# Learned pruning against KV-cache eviction policies", "",
             f"Generated by `{command}`; do not edit by hand.", "",
             f"{n_windows} windows of {window} tokens of the test split. Policies run on the dense model, replayed "
             "over each window in one forward (the decisions token-by-token decoding makes); perplexity pooled over "
             "tokens, sparsity (share of its earlier tokens a query cannot see) averaged over queries and layers.", "",
             "## The whole window, read as it arrives", ""]
    lines += table_md(whole, float(whole.loc[whole["method"] == "dense", "perplexity"].iloc[0]))
    if figures.get("curve"):
        lines += ["", f"![perplexity against sparsity]({figures['curve']})"]
    lines += ["", "## Prompt, then generation", "",
              f"The first {prompt} tokens of each window are the prompt; only the {window - prompt - 1} queries "
              "after it are scored and counted. A policy in prompt mode (`:prompt`, and SnapKV by default) compresses "
              "the prompt once and keeps what follows (SnapKV: its last 32 queries vote, pooled over 7 positions); in "
              "step mode it evicts at every step. Per KV group unless the name says `-layer` (TOVA: per layer unless "
              "`-group`); the oracle reads the full model's later attention (a reference, not always a bound). "
              "Budgets matched to the pruned model's sparsity over those queries.", ""]
    lines += table_md(split, float(split.loc[split["method"] == "dense", "perplexity"].iloc[0]))
    lines += ["", "## What each method hides, by part of speech", "",
              "At the pruned model's sparsity (each policy at the budget matched to it, in brackets): for tokens of "
              "each part of speech (spaCy, coarse tags), the mean share of the later queries in the window that "
              "cannot see them, over all layers: each method's sparsity, split by what it hides.", ""]
    wide = profile.pivot(index="pos", columns="method", values="hidden_share")
    counts = profile.groupby("pos")["token_layers"].max()
    wide = wide.loc[counts.sort_values(ascending=False).index[:12]]
    lines += ["| POS | " + " | ".join(wide.columns) + " |", "|---|" + "---:|" * len(wide.columns)]
    for pos, r in wide.iterrows():
        lines.append(f"| {pos} | " + " | ".join(f"{v:.1%}" if pd.notna(v) else "-" for v in r) + " |")
    if figures.get("pos"):
        lines += ["", f"![share dropped by part of speech]({figures['pos']})"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    policies.load_plugins(settings.get("MIXSCOPE_POLICIES"))  # the operator's own policies (docs/policies.md)
    names, step_names, prompt, windows = _plan(ap, args)
    dense = load_model_dir(args.dense, device=args.device)
    pruned = load_model_dir(args.pruned, device=args.device)
    n = args.window

    # the pruned model and the dense one, every window (their runs give the targets of both readings)
    base, pools = _base_runs(dense.model, pruned.model, windows, prompt)
    learned_whole, learned_gen = pools["learned"][0]["sparsity"], pools["learned"][1]["sparsity"]

    rows = [dict(method="dense", model=dense.path.name, budget=None, **pools["dense"][0]),
            dict(method="learned pruning", model=pruned.path.name, budget=None, **pools["learned"][0])]
    split = [dict(method="dense", model=dense.path.name, budget=None, **pools["dense"][1]),
             dict(method="learned pruning", model=pruned.path.name, budget=None, **pools["learned"][1])]
    tagged = _tag(dense.tokenizer, windows)
    tables = {"learned pruning": pd.concat([pruning.token_table(vis, labels, tags).assign(window=i)
                                            for i, ((vis, _, _), (labels, tags))
                                            in enumerate(zip(base["learned"], tagged))])}

    targets = [learned_whole] + [float(t) for t in args.targets.split(",") if t]
    step_rows, step_tables = _step_policies(dense, windows, tagged, step_names, targets)
    rows += step_rows
    tables |= step_tables
    split += _prompt_policies(dense, windows, names, learned_gen, prompt)

    whole, split = pd.DataFrame(rows), pd.DataFrame(split)
    profile = pruning.pos_profile(tables)
    command = (f"python -m analysis.reports.eviction --dense {args.dense} --pruned {args.pruned} --data {args.data} "
               f"--window {args.window} --windows {args.windows} --policies {args.policies} "
               f"--targets {shlex.quote(args.targets)} "
               f"--prompt-share {args.prompt_share}")
    figs = _figures(args, whole, profile, rows[0]["perplexity"], learned_whole, dense.path.name, pruned.path.name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(render(command, whole, split, profile, n, len(windows), prompt, figs), encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m analysis.reports.eviction", description=__doc__.split("\n")[0])
    ap.add_argument("--dense", required=True)
    ap.add_argument("--pruned", required=True)
    ap.add_argument("--data", default="data")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--policies",
                    default="streamingllm,tova,tova-group,h2o,h2o-layer,oracle,h2o:prompt,snapkv,snapkv-layer,"
                            "oracle:prompt",
                    help="method ids (models.pruning.policies); step-mode ones run in both readings, prompt-mode "
                         "ones in the second")
    ap.add_argument("--targets", default="0.5,0.8", help="sparsities besides the pruned model's own (whole windows)")
    ap.add_argument("--prompt-share", type=float, default=0.75, help="the prompt's share of a window (second table)")
    ap.add_argument("--out", default="docs/eviction.md")
    ap.add_argument("--figure", default="docs/eviction.png")
    ap.add_argument("--pos-figure", default="docs/eviction_pos.png")
    add_device_arguments(ap, dtype=None)
    return ap


def _plan(ap: argparse.ArgumentParser, args) -> tuple[list[str], list[str], int, list[list[int]]]:
    """The arguments checked before any model loads (a refusal exits through ap.error): the methods, the step-mode
    ones among them, the prompt's length and the test split's windows."""
    names = [n for n in args.policies.split(",") if n]
    bad = policies.check_methods(names)
    if bad:
        ap.error(f"--policies: {'; '.join(bad)}")
    step_names = [n for n in names if not policies.once(n)]
    prompt = round(args.prompt_share * args.window)
    if not 2 <= prompt < args.window - 1:
        ap.error("--prompt-share leaves no prompt or no query after it")
    for what, path in (("--out", args.out), ("--figure", args.figure), ("--pos-figure", args.pos_figure)):
        if path and Path(path).exists() and not Path(path).is_file():
            ap.error(f"{what} {path} is not a file")
    try:   # both models are held at once, each window's runs beside them
        check_dirs([args.dense, args.pruned], args.window, report_window_bytes)
    except OverBudget as e:
        ap.error(str(e))
    text = load_tokens(args.data, "test")
    windows = [[int(t) for t in text[i * args.window:(i + 1) * args.window]] for i in range(args.windows)]
    windows = [w for w in windows if len(w) == args.window]
    if not windows:
        ap.error(f"the test split of {args.data} has fewer than {args.window} tokens")
    return names, step_names, prompt, windows


def _base_runs(dense_model, pruned_model, windows: list[list[int]], prompt: int) -> tuple[dict, dict]:
    """The dense model (nothing dropped) and the pruned one (its own rule) on every window: their runs, and per
    model the pooled rows of both readings (the whole window; the queries after the prompt)."""
    base = {"dense": [], "learned": []}
    for ids in tqdm(windows, desc="dense and pruned", leave=False):
        base["dense"].append(pruning.method_run(dense_model, ids, pruning.NOTHING))
        base["learned"].append(pruning.method_run(pruned_model, ids, pruning.LEARNED))
    pools = {}
    for key in ("dense", "learned"):
        whole, gen = Pool(), Pool()
        for vis, _, lp in base[key]:
            whole.add(vis, lp)
            gen.add(vis, lp, first=prompt)
        pools[key] = (whole.row(), gen.row())
    return base, pools


def _tag(tokenizer, windows: list[list[int]]) -> list[tuple]:
    """Each window's token labels and their parts of speech."""
    nlp = pruning.tagger()
    tagged = []
    for ids in windows:
        t, toks = from_ids(tokenizer, ids)
        tagged.append((toks.labels, pruning.pos_tags(t, toks.offsets, nlp)))
    return tagged


def _step_policies(dense, windows: list[list[int]], tagged: list[tuple], step_names: list[str],
                   targets: list[float]) -> tuple[list[dict], dict[str, pd.DataFrame]]:
    """The first reading: each step policy on the dense model over whole windows, at the budget of each target
    sparsity. Returns its rows, and the token tables of each policy at the first target's budget."""
    n = len(windows[0])
    rows, tables = [], {}
    for name in step_names:
        budgets = [policies.budget_for(name, t, n - 1) for t in targets]  # the n - 1 scored queries
        for b in sorted(set(budgets)):
            pool, parts = Pool(), []
            for i, ids in enumerate(tqdm(windows, desc=f"{name} {b}", leave=False)):
                vis, dropped_at, lp = pruning.method_run(dense.model, ids, name, b)
                pool.add(vis, lp)
                if b == budgets[0]:
                    parts.append(pruning.token_table(vis, *tagged[i], dropped_at).assign(window=i))
            rows.append(dict(method=name, model=dense.path.name, budget=b, **pool.row()))
            if parts:
                tables[f"{name} ({b})"] = pd.concat(parts)
            print(f"{name} budget {b}: sparsity {rows[-1]['sparsity']:.1%}, perplexity {rows[-1]['perplexity']:.3f}",
                  file=sys.stderr)
    return rows, tables


def _prompt_policies(dense, windows: list[list[int]], names: list[str], learned_gen: float,
                     prompt: int) -> list[dict]:
    """The second reading: every policy on the dense model after a prompt, at the budget matched to the pruned
    model's sparsity over the queries after it. Returns its rows."""
    n = len(windows[0])
    split = []
    for name in names:  # prompt, then generation
        b = policies.budget_for(name, learned_gen, n - 1, prompt, first=prompt)
        pool = Pool()
        for ids in tqdm(windows, desc=f"{name} {b} after a prompt", leave=False):
            vis, _, lp = pruning.method_run(dense.model, ids, name, b, prompt)
            pool.add(vis, lp, first=prompt)
        split.append(dict(method=name, model=dense.path.name, budget=b, **pool.row()))
        print(f"{name} budget {b} after a {prompt}-token prompt: sparsity {split[-1]['sparsity']:.1%}, "
              f"perplexity {split[-1]['perplexity']:.3f}", file=sys.stderr)
    return split


def _figures(args, whole: pd.DataFrame, profile: pd.DataFrame, dense_perplexity: float, learned_whole: float,
             dense_name: str, pruned_name: str) -> dict[str, str | None]:
    """The curve and the part-of-speech figure where asked for: {"curve", "pos": file name} of those written."""
    figs: dict[str, str | None] = {}
    from analysis.export import figure_bytes
    if args.figure:
        Path(args.figure).parent.mkdir(parents=True, exist_ok=True)
        curves = whole[whole["method"] != "dense"].sort_values(["method", "sparsity"])
        fig = figure(curves, f"{dense_name}: perplexity against sparsity", dense_perplexity)
        Path(args.figure).write_bytes(figure_bytes(fig, "png"))
        figs["curve"] = Path(args.figure).name
    if args.pos_figure:
        Path(args.pos_figure).parent.mkdir(parents=True, exist_ok=True)
        fig = pruning.pos_profile_figure(profile, "hidden from later queries, by part of speech, "
                                         f"at {learned_whole:.0%} sparsity", min_count=50,
                                         subtitle=f"{pruned_name}; policies on {dense_name}")
        Path(args.pos_figure).write_bytes(figure_bytes(fig, "png"))
        figs["pos"] = Path(args.pos_figure).name
    return figs


if __name__ == "__main__":
    raise SystemExit(main())
