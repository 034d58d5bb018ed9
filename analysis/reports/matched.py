"""Learned pruning against training-free eviction at matched sparsity, in domain and out of it: the protocol of
docs/real.md (analysis.reports.real runs it beside the rest of that report; this command writes its tables alone).

    python -m analysis.reports.matched --base DIR PRUNED_DIR [PRUNED_DIR ...] --source test=data/smollm2:test
        --source kjv=data/heldout_kjv:all [--window 512] [--windows 24] [--policies METHOD,...]
        [--prompt-share 0.75] [--match PRUNED_NAME] [--out docs/real_matched.md] [--json RESULTS.json]
        [--parts DIR] [--ray [ADDRESS] [--ray-workers N] [--ray-threads T]]
    python -m analysis.reports.matched --merge A.json B.json [...] --out docs/real_matched.md

A long run can be split by source across processes (one core each): each writes --json, and --merge renders the
sources of several runs of one protocol (same models, window, policies, prompt, match) as one report.

The protocol (the held-out issue's): for each source, `windows` windows of `window` tokens spread evenly over its
tokens (a source's split, or all of a source that no run trained on). Every position a window can score is scored
(token 0 of a window has no context to be predicted from), and positions >= 100 are reported apart. Each pruned
model runs its own rule (any other model runs dense: a fine-tune's control); each policy runs on the dense base
(models.pruning.replay: the decisions token-by-token decoding makes) at the budget whose sparsity matches, on that
source, the sparsity the `--match` model measured there. A second reading, prompt then generation: the first
--prompt-share of each window is a prompt read in full and only the queries after it are scored and counted, so
the policies in prompt mode (compressing the prompt once: SnapKV's form, and every other policy's `:prompt`) take
part beside the step policies, each matched to the `--match` model's sparsity over those queries. Per KV group
unless a name says `-layer`; the oracle (hindsight) is a reference, not a rule (nor always a bound). Perplexity is
pooled over tokens; sparsity (share of its earlier tokens a query cannot see) is averaged over queries and layers.
Intervals: a 95 % bootstrap over windows (2,000 resamples, seed 0), paired where two methods are compared (the same
resampled windows for both). A window past a model's context, past what a replay reads, or whose runs would not fit
the memory budget beside every model loaded (analysis.budgets) is refused before they load, naming the largest
that fits.

Resumable, in two phases: (1) the dense base and every model on every window, then the budgets matched to --match's
sparsity from those windows, then (2) every policy at its budget on every window. Each (source, run, window) is
written under --parts as it finishes (default: beside --json, else --out, as NAME.parts; removed once the report is
written, when this run made it), a protocol of other models, windows or device is refused there, a window that
fails is named while the rest go on (exit 1), and a rerun computes only what is missing. --ray computes each phase's
windows on Ray workers (analysis.reports.cluster; pip install mixscope[cluster]): the same parts, so the same tables
(docs/cluster.md).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from analysis import bootstrap, pruning
from analysis.budgets import check_dirs, config_of, report_window_bytes
from analysis.reports.parts import check_protocol, commit_now, done_windows, window_ids_sha256, write_window
import kernels.settings  # (by its full name: `settings` here is the protocol's)
from models.checkpoint import load_model_dir
from models.files import CheckpointError, code_version, file_sha256
from models.data.corpus import DataError, load_tokens
from models.device import add_arguments as add_device_arguments
from models.memory import OverBudget
from models.pruning import policies, sparsity

LATE = 100  # positions from here on are reported apart: every query there has at least 100 earlier tokens
SPLITS = ("train", "valid", "test")
# every policy per KV group and per layer, in step mode and compressing a prompt once, and the hindsight bound
DEFAULT_POLICIES = ("streamingllm", "tova", "tova-group", "h2o", "h2o-layer", "snapkv:step", "oracle",
                    "streamingllm:prompt", "tova:prompt", "h2o:prompt", "snapkv", "snapkv-layer", "oracle:prompt")
BAR_SPARSITY = 0.5            # the held-out issue's bar: at least this share dropped, below every policy's cost
REGIME = (0.6, 0.03)          # the paper's regime: at least 60 % dropped for at most +3 %
MIN_VERDICT_WINDOWS = 10      # fewer windows give intervals too narrow to call (one window: a point)
MATCH_GAP = 0.01              # a policy more than this below match's sparsity could not reach it (its smallest
                              # budget sees more): reported beside the bar, not in it
DEFAULT_OUT = "docs/real_matched.md"
SOURCE_NAME = re.compile(r"\w[\w.-]*")  # goes into markdown headings and table cells


@dataclass
class Windows:
    """Per-window sums of one method on one source: summed NLL and token counts, all positions and >= LATE, and
    the summed query sparsity over the same queries. Queries before `first` (a prompt) are neither scored nor
    counted."""
    first: int = 0
    nll: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    nll_late: list = field(default_factory=list)
    tokens_late: list = field(default_factory=list)
    hidden_late: list = field(default_factory=list)

    def add(self, visible, logprobs) -> None:
        """visible [L,R,T,T] (uint8 or bool; R rows per layer: its KV groups under a per-group policy, else one),
        logprobs [T-1] (query i predicts token i+1)."""
        self.add_queries(*query_values(visible, logprobs))

    def add_queries(self, s: np.ndarray, lp: np.ndarray) -> None:
        """One window from its per-query values (query_values: sparsity float32, log-probability float64)."""
        s, lp = s[self.first:], lp[self.first:]
        late = max(0, LATE - self.first)
        self.nll.append(-lp.sum())
        self.tokens.append(len(lp))
        self.hidden.append(float(s.sum()))
        self.nll_late.append(-lp[late:].sum())
        self.tokens_late.append(len(lp[late:]))
        self.hidden_late.append(float(s[late:].sum()))

    def arrays(self, late: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if late:
            return np.array(self.nll_late), np.array(self.tokens_late), np.array(self.hidden_late)
        return np.array(self.nll), np.array(self.tokens), np.array(self.hidden)


def query_values(visible, logprobs) -> tuple[np.ndarray, np.ndarray]:
    """Per query of a window: its sparsity (share of its earlier tokens it cannot see, mean over layers and rows;
    float32) and its log-probability (float64). Windows sums them, so a window's mean sparsity is
    models.pruning.mean_sparsity(count_first=True) over the same queries (query 0 counted as 0)."""
    v = torch.as_tensor(visible)
    # one [T, T] mask in float at a time: the whole [L, R, T, T] in float32 would be 4 bytes a cell (1 GB at 1,700
    # tokens on SmolLM2, per group)
    s = torch.cat([sparsity(m[None].float()) for m in v.reshape(-1, *v.shape[-2:])])[:, :-1].mean(0)
    return s.numpy(), np.asarray(logprobs, dtype=np.float64)


def source_windows(spec: str, window: int, count: int | None) -> list[list[int]]:
    """DIR:SPLIT (a split of a data directory) or DIR:all (all its splits joined, for a source no run trained
    on): `count` windows spread evenly over the tokens (fewer when the text is short; None: every window)."""
    data, _, split = spec.rpartition(":")
    if not data or split not in (*SPLITS, "all"):
        raise ValueError(f"a source is DIR:SPLIT with SPLIT one of {', '.join(SPLITS)} or all, got {spec!r}")
    tokens = np.concatenate([load_tokens(data, s) for s in (SPLITS if split == "all" else (split,))])
    if len(tokens) < window:
        raise ValueError(f"{spec} has fewer than {window} tokens")
    return cut_windows(tokens, window, count)


def cut_windows(tokens, window: int, count: int | None) -> list[list[int]]:
    """Consecutive windows of `window` tokens (at least one must fit), `count` of them spread evenly (None: all)."""
    n = len(tokens) // window
    picks = range(n) if count is None else np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(int))
    return [[int(t) for t in tokens[i * window:(i + 1) * window]] for i in picks]


def cost(method: Windows, dense: Windows, idx: np.ndarray, late: bool) -> np.ndarray:
    """Perplexity relative to the dense base, pooled over the windows idx ([R, W] resamples or [W]) -> [R] or []."""
    nll, tok, _ = method.arrays(late)
    dnll, _, _ = dense.arrays(late)
    return bootstrap.cost(nll[idx].sum(-1), dnll[idx].sum(-1), tok[idx].sum(-1))


def pooled_sparsity(method: Windows, late: bool) -> float:
    """The queries' sparsity pooled over windows (each query weighs the same), as the table reports it."""
    _, tok, hidden = method.arrays(late)
    return float(hidden.sum() / tok.sum())


def summary(runs: dict[str, Windows], dense: str, match: str, late: bool, resamples: int = 2000) -> list[dict]:
    """One row per method: sparsity, perplexity cost vs the dense run with its interval, and (for methods other than
    `match`) the paired difference cost(method) - cost(match) with its interval: above 0, `match` costs less."""
    n = len(runs[dense].tokens)
    idx, every = bootstrap.draws(n, resamples), np.arange(n)
    base = runs[dense]
    _, tok, _ = base.arrays(late)
    rows = []
    for name, run in runs.items():
        row = {"method": name, "sparsity": pooled_sparsity(run, late), "tokens": int(tok.sum()), "windows": n,
               "perplexity": float(np.exp(run.arrays(late)[0].sum() / tok.sum())),
               "cost": float(cost(run, base, every, late)), "cost_ci": bootstrap.interval(cost(run, base, idx, late))}
        if name not in (dense, match):
            diff = cost(run, base, idx, late) - cost(runs[match], base, idx, late)
            row["vs_match"] = float(cost(run, base, every, late) - cost(runs[match], base, every, late))
            row["vs_match_ci"] = bootstrap.interval(diff)
            row["wins"] = int(sum(float(cost(run, base, np.array([i]), late))
                                  > float(cost(runs[match], base, np.array([i]), late))
                                  for i in range(n)))
        rows.append(row)
    return rows


def preamble(match: str, window: int, prompt: int | None = None) -> str:
    text = (f"Windows of {window} tokens spread evenly over each source; every position a window can score is scored "
            f"(all but its first token), and positions >= {LATE} are reported apart. Policies run on the dense base at "
            f"the budget matched to {match}'s sparsity on that source (per KV group: each group of heads sharing keys "
            "keeps its own tokens, unless a name ends in -layer: one token set per layer, shared by the groups), step "
            "by step as the text arrives; the oracle (hindsight) is a reference, not a rule. Cost: perplexity "
            "relative to the dense base, pooled over tokens, with a 95 % bootstrap interval over windows. "
            f"\"{match} ahead by\": cost(policy) - cost({match}) on the same resampled windows (above 0: {match} costs "
            f"less); \"windows won\": windows where the policy costs more than {match}.")
    if prompt:
        text += (f" After a prompt: the first {prompt} tokens of each window are a prompt read in full, and only the "
                 f"{window - prompt - 1} queries after it are scored and counted; a policy in prompt mode compresses "
                 f"the prompt once and keeps what follows (SnapKV: its last 32 queries vote, max-pooled over 7 "
                 f"positions); the step policies evict as before; every policy's budget is matched to {match}'s "
                 f"sparsity over those queries.")
    return text


def reference(method: str) -> bool:
    """A hindsight policy (the oracle) reads later queries' attention: a reference in the tables, not a rule the bar
    counts (no deployable rule can read the future)."""
    cls = policies.REGISTRY.get(method.partition(":")[0])
    return cls is not None and cls.hindsight


def _standing(rows: list[dict], budgets: dict, match: str) -> dict:
    """match's row against the policies among rows (hindsight references left out): beats every matched one (each
    paired interval above 0; None when there is none or too few windows to call), the strongest matched one
    (lowest bound on match's lead), and the policies that could not reach match's sparsity (at their smallest
    budget they see more)."""
    m = next(r for r in rows if r["method"] == match)
    others = [r for r in rows if r["method"] in budgets and not reference(r["method"])]
    matched = [r for r in others if r["sparsity"] >= m["sparsity"] - MATCH_GAP]
    callable_ = bool(matched) and m["windows"] >= MIN_VERDICT_WINDOWS
    strongest = min(matched, key=lambda r: r["vs_match_ci"][0]) if matched else None
    return {"row": m, "beats_all": all(r["vs_match_ci"][0] > 0 for r in matched) if callable_ else None,
            "strongest": strongest["method"] if strongest else "-",
            "strongest_lead": (strongest["vs_match"], strongest["vs_match_ci"]) if strongest else None,
            "unmatched": [(r["method"], r["sparsity"], r["vs_match"], r["vs_match_ci"])
                          for r in others if r not in matched]}


def verdict(results: dict[str, dict], match: str) -> list[dict]:
    """Per source, on every position: does `match` drop at least BAR_SPARSITY of the context and cost less than
    every policy matched to its sparsity, each paired interval above 0 (the held-out issue's bar; None with fewer
    than MIN_VERDICT_WINDOWS windows or no matched policy); the strongest policy (lowest bound on match's lead);
    the policies that could not reach its sparsity (`unmatched`: name, sparsity, lead, interval; reported, not
    in the bar); and the paper's regime on the point estimate. With a prompt reading, the bar also needs match
    ahead of every matched policy there (SnapKV included when it reaches the sparsity): prompt_* give that
    reading's standing."""
    out = []
    for source, res in results.items():
        whole = _standing(res["all"], res["budgets"], match)
        m, beats = whole["row"], whole["beats_all"]
        v = {"source": source, "windows": m["windows"], "sparsity": m["sparsity"], "cost": m["cost"],
             "cost_ci": m["cost_ci"], "beats_all": beats,
             "bar": None if beats is None else beats and m["sparsity"] >= BAR_SPARSITY,
             "regime": m["sparsity"] >= REGIME[0] and m["cost"] <= REGIME[1],
             "strongest": whole["strongest"], "strongest_lead": whole["strongest_lead"],
             "unmatched": [("", *u) for u in whole["unmatched"]]}
        if "prompt" in res:
            gen = _standing(res["prompt"]["rows"], res["prompt"]["budgets"], match)
            v.update(prompt=res["prompt"]["length"], prompt_sparsity=gen["row"]["sparsity"],
                     prompt_cost=gen["row"]["cost"], prompt_beats_all=gen["beats_all"],
                     prompt_strongest=gen["strongest"], prompt_strongest_lead=gen["strongest_lead"])
            v["unmatched"] += [("after the prompt", *u) for u in gen["unmatched"]]
            if v["bar"] is not None:
                v["bar"] = None if gen["beats_all"] is None else v["bar"] and gen["beats_all"]
        out.append(v)
    return out


def _table(title: str, rows: list[dict], budgets: dict, match: str) -> list[str]:
    lines = [f"## {title} ({rows[0]['windows']} windows, {rows[0]['tokens']:,} scored tokens)", "",
             f"| method | budget | sparsity | perplexity | cost vs dense [95 % CI] | {match} ahead by [95 % CI] "
             "| windows won |",
             "|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        ahead = (f"{r['vs_match']:+.2%} [{r['vs_match_ci'][0]:+.2%}, {r['vs_match_ci'][1]:+.2%}]"
                 if "vs_match" in r else "-")
        won = f"{r['wins']}/{r['windows']}" if "wins" in r else "-"
        lines.append(f"| {r['method']} | {budgets.get(r['method'], '-')} | {r['sparsity']:.1%} | "
                     f"{r['perplexity']:.3f} | {r['cost']:+.2%} [{r['cost_ci'][0]:+.2%}, {r['cost_ci'][1]:+.2%}] | "
                     f"{ahead} | {won} |")
    return lines + [""]


def sections(results: dict[str, dict], match: str) -> list[str]:
    """The markdown tables per source: every position; positions >= LATE; after a prompt (when read); first, the
    code that computed the windows (runs saved before it was recorded have none)."""
    code = sorted({c for res in results.values() for c in res.get("computed_by", ())})
    lines = [f"Code that computed the windows (commit): {', '.join(f'`{c}`' for c in code)}", ""] if code else []
    for source, res in results.items():
        lines += _table(f"{source}: every position", res["all"], res["budgets"], match)
        lines += _table(f"{source}: positions >= {LATE}", res["late"], res["budgets"], match)
        if "prompt" in res:
            p = res["prompt"]
            lines += _table(f"{source}: after a {p['length']}-token prompt", p["rows"], p["budgets"], match)
    return lines


def render(command: str, results: dict[str, dict], match: str, window: int, prompt: int | None = None) -> str:
    lines = ["# Learned pruning against training-free eviction at matched sparsity, in and out of domain", "",
             f"Generated by `{command}`; do not edit by hand.", "", preamble(match, window, prompt), ""]
    return "\n".join(lines + sections(results, match))


# ---- the protocol's windows, as parts -----------------------------------------------------------------------------
#
# Each (source, run, window) is a part under the parts directory: PARTS/SOURCE/RUN/NNNNN.parquet (the window's
# per-query sparsity and log-probability), then its line in PARTS/SOURCE/RUN/windows.jsonl (written as the corpus
# report writes its parts: analysis.reports.parts.write_window). Phase one runs the dense base ("dense") and each
# model (its directory's name) on every window; the policies' budgets are then matched, per source, to the --match
# model's sparsity read back from its parts; phase two runs each policy at its budget ("NAME@BUDGET", and
# "NAME@BUDGET-after-PROMPT" in the prompt reading). The tables are assembled from the parts alone, so a window
# computed here or on a Ray worker (analysis.reports.cluster, with window_result) gives the same report.

PHASES = ("phase 1 of 2: dense base and models, windows", "phase 2 of 2: policies at matched budgets, windows")


class HeldOutFailed(RuntimeError):
    """Windows failed: the message lists them, and that a rerun redoes only what is missing."""


def model_run(name: str, prunes: bool) -> dict:
    """Phase one's run of the dense base ("dense") or a model: a pruned one under its own rule, any other dense."""
    return {"run": name, "method": pruning.LEARNED if prunes else pruning.NOTHING, "budget": None, "prompt": None}


def policy_run(name: str, budget: int, prompt: int | None = None) -> dict:
    """Phase two's run of a policy at its matched budget, over the whole window or after a `prompt`-token prompt."""
    run = f"{name}@{budget}" + (f"-after-{prompt}" if prompt else "")
    return {"run": run, "method": name, "budget": budget, "prompt": prompt}


def window_part(model, ids: list[int], run: dict):
    """(rows, metrics) of one window under one run: the per-query values Windows sums, and what the window's line
    in windows.jsonl records besides."""
    vis, _, lp = pruning.method_run(model, ids, run["method"], run["budget"], run["prompt"])
    s, lp = query_values(vis, lp)
    return pd.DataFrame({"sparsity": s, "logprob": lp}), {"method": run["method"], "budget": run["budget"],
                                                          "prompt": run["prompt"]}


def window_result(loaded, key: tuple, ids: list[int], run: dict, cache: dict):
    """window_part of a loaded model: what a Ray worker computes of a held-out part (analysis.reports.cluster)."""
    return window_part(loaded.model, ids, run)


def read_part(part_dir: Path, w: int) -> tuple[np.ndarray, np.ndarray]:
    """A part's per-query values, as window_part computed them (float32 sparsity, float64 log-probabilities)."""
    rows = pd.read_parquet(part_dir / f"{w:05d}.parquet")
    return rows["sparsity"].to_numpy(), rows["logprob"].to_numpy()


def read_run(part_dir: Path, n: int, firsts: tuple[int, ...]) -> list[Windows]:
    """A run's n windows from its parts, as Windows for each `first` (query the sums start at) in firsts."""
    out = [Windows(first=f) for f in firsts]
    for w in range(n):
        values = read_part(part_dir, w)
        for windows in out:
            windows.add_queries(*values)
    return out


def missing(every: list, parts: Path) -> list:
    """The parts of `every` that parts lacks (analysis.reports.parts.done_windows: a Parquet file and its line)."""
    done: dict[tuple[str, str], dict] = {}
    out = []
    for part in every:
        key = (part.source, part.run["run"])
        if key not in done:
            done[key] = done_windows(parts / part.source / part.run["run"])
        if part.window not in done[key]:
            out.append(part)
    return out


class Here:
    """Windows computed in this process on the models loaded here ({model key: model}), written as they finish;
    a window that raises is named and the rest go on (as on Ray workers)."""

    def __init__(self, models: dict, prog: str):
        self.models, self.prog, self.commit = models, prog, commit_now()

    def run(self, todo: list, sources: dict[str, list[list[int]]], parts: Path, desc: str, total: int) -> list:
        if not todo:
            return []
        failed = []
        with tqdm(total=total, initial=total - len(todo), desc=desc, file=sys.stderr) as bar:
            for part in todo:
                try:
                    rows, metrics = window_part(self.models[part.model], sources[part.source][part.window], part.run)
                except Exception as e:   # (any window's error: named below, and the rest still run)
                    failed.append((part, f"{type(e).__name__}: {e}"))
                    tqdm.write(f"{self.prog}: {part} failed: {failed[-1][1]}", file=sys.stderr)
                    bar.set_postfix_str(f"{len(failed)} failed")
                else:
                    write_window(parts / part.source / part.run["run"], part.window, rows, metrics,
                                 commit=self.commit)
                bar.update()
        return failed


def evaluate(models: dict[str, bool], sources: dict[str, list[list[int]]], names: list[str], window: int,
             match: str, prompt: int | None, parts: Path, compute, prog: str = "matched") -> dict[str, dict]:
    """The protocol over parts: models ({name: prunes}, in order; each part's model key is "base" for the dense
    row, else the name) -> {source: {"budgets", "all", "late"}} and, with `prompt`, "prompt": {"length",
    "budgets", "rows"}. compute(todo, sources, parts, desc, total) computes and writes the parts --parts lacks and
    returns those that failed (Here.run, or analysis.reports.cluster.Pool.run); HeldOutFailed when any did.

    Per source: the dense base, each model (a pruned one under its own rule, any other dense: a fine-tune's
    control) and each step policy at the budget matched to `match`'s sparsity there; with a prompt, every policy
    in `names` (SnapKV too) matched over the queries after the prompt."""
    from analysis.reports.cluster import Part, failure_report
    firsts = (0, prompt) if prompt else (0,)
    runs = {"dense": model_run("dense", False)} | {name: model_run(name, p) for name, p in models.items()}
    every = [Part("base" if name == "dense" else name, source, run, w)
             for name, run in runs.items() for source, ws in sources.items() for w in range(len(ws))]
    failed = compute(missing(every, parts), sources, parts, PHASES[0], len(every))
    # the budgets, from the match model's parts (on a source where all of them are there)
    lost = {(p.source, p.run["run"]) for p, _ in failed}
    budgets, gen_budgets, every = {}, {}, []
    for source, ws in sources.items():
        if (source, match) in lost:
            continue
        targets = [pooled_sparsity(w, late=False) for w in read_run(parts / source / match, len(ws), firsts)]
        budgets[source] = {name: policies.budget_for(name, targets[0], window - 1)
                           for name in names if not policies.once(name)}
        every += [Part("base", source, policy_run(name, b), w) for name, b in budgets[source].items()
                  for w in range(len(ws))]
        if prompt:
            gen_budgets[source] = {name: policies.budget_for(name, targets[1], window - 1, prompt, first=prompt)
                                   for name in names}
            every += [Part("base", source, policy_run(name, b, prompt), w) for name, b in gen_budgets[source].items()
                      for w in range(len(ws))]
    failed += compute(missing(every, parts), sources, parts, PHASES[1], len(every))
    if failed:
        waiting = [s for s in sources if s not in budgets]
        also = (f" and then the policies on {', '.join(waiting)} (their budgets wait for {match}'s windows there)"
                if waiting else "")
        raise HeldOutFailed(failure_report(failed, parts, prog, also))
    results = {}
    for source, ws in sources.items():
        n = len(ws)
        whole, gen = {}, {}
        for name, run in runs.items():
            whole[name], *after = read_run(parts / source / run["run"], n, firsts)
            if prompt:
                gen[name] = after[0]
        for name, b in budgets[source].items():
            whole[name], = read_run(parts / source / policy_run(name, b)["run"], n, (0,))
        results[source] = {"budgets": budgets[source], "all": summary(whole, "dense", match, False),
                           "late": summary(whole, "dense", match, True)}
        read = [*runs.values(), *(policy_run(name, b) for name, b in budgets[source].items())]
        if prompt:
            for name, b in gen_budgets[source].items():
                gen[name], = read_run(parts / source / policy_run(name, b, prompt)["run"], n, (prompt,))
            results[source]["prompt"] = {"length": prompt, "budgets": gen_budgets[source],
                                         "rows": summary(gen, "dense", match, False)}
            read += [policy_run(name, b, prompt) for name, b in gen_budgets[source].items()]
        # (the code each window's line names: a default --parts is removed once the report is written)
        results[source]["computed_by"] = sorted({m.get("commit", "unknown") for r in read
                                                 for m in done_windows(parts / source / r["run"]).values()})
        for r in results[source]["all"]:
            print(f"{source} {r['method']}: sparsity {r['sparsity']:.1%}, cost {r['cost']:+.2%}", file=sys.stderr)
    return results


def parts_protocol(window: int, weights: dict[str, str], sources: dict[str, list[list[int]]], device: str) -> dict:
    """What every part under one --parts shares: the window, the models' weights (sha256, by run's model key), each
    source's windows as tokens and the device type (float32: load_model_dir's, here and on Ray workers). The
    policies, their budgets and the prompt are in the runs' names, so other ones add runs beside these."""
    return {"window": window, "models": weights, "precision": {"device": device, "dtype": "float32"},
            "sources": {s: {"windows": len(ws), "ids_sha256": window_ids_sha256(ws)} for s, ws in sources.items()}}


DEFAULT_MARK = "made-at-the-default-place"


def default_parts(output: str) -> Path:
    """Where a run keeps its parts unless --parts says: beside its output (docs/real.md: docs/real.parts). A
    directory made here is marked, so that only such a one is removed once its report is written (one kept with
    --parts at the same place stays)."""
    parts = Path(output).with_suffix(".parts")
    if not parts.exists():
        parts.mkdir(parents=True)
        (parts / DEFAULT_MARK).write_text("parts a run made at its default place; removed once its report is written\n",
                                          encoding="utf-8")
    return parts


def remove_parts(parts: Path) -> None:
    """A parts directory that default_parts made, once its report is written: the files this protocol wrote, and
    the directories they leave empty (anything else there stays). One default_parts did not make is kept."""
    if not (parts / DEFAULT_MARK).is_file():
        return
    (parts / DEFAULT_MARK).unlink()
    for log in parts.glob("*/*/windows.jsonl"):
        for w in done_windows(log.parent):
            (log.parent / f"{w:05d}.parquet").unlink(missing_ok=True)
        log.unlink()
    (parts / "protocol.json").unlink(missing_ok=True)
    for d in sorted((d for d in parts.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)) + [parts]:
        try:
            d.rmdir()
        except OSError:   # (not empty: not ours alone)
            pass


def run_protocol(args, base: str, dirs: list[str], prunes: list[bool], sources: dict[str, list[list[int]]],
                 names: list[str], match: str, prompt: int | None, parts: Path, loaded: dict | None,
                 prog: str) -> dict[str, dict]:
    """evaluate in this process on the models `loaded` ({"base": model, name: model}) or, with --ray, on Ray
    workers that open base and dirs themselves; the parts' protocol is checked against --parts first (ValueError
    naming what differs). HeldOutFailed when windows failed."""
    keys = ["base", *(Path(d).name for d in dirs)]
    weights = dict(zip(keys, weights_sha256([base, *dirs]).values()))
    models = {Path(d).name: p for d, p in zip(dirs, prunes)}
    if args.ray is None:
        from models.device import resolve
        check_protocol(parts, parts_protocol(args.window, weights, sources, resolve(args.device).type))
        return evaluate(models, sources, names, args.window, match, prompt, parts, Here(loaded, prog).run, prog)
    from analysis.reports import cluster
    with cluster.connected(args.ray, prog) as ray:
        lay = cluster.layout(ray, args.device, args.ray_workers, args.ray_threads,
                             cluster.worker_bytes([base, *dirs], args.window))
        check_protocol(parts, parts_protocol(args.window, weights, sources, lay.device))
        specs = {k: {"key": k, "path": str(Path(d).resolve()), "sha256": weights[k]}
                 for k, d in zip(keys, [base, *dirs])}
        pool = cluster.Pool(ray, lay, specs, window_result, prog=prog)
        return evaluate(models, sources, names, args.window, match, prompt, parts, pool.run, prog)


def add_ray_arguments(ap: argparse.ArgumentParser) -> None:
    """--ray and its worker options (the windows on a Ray cluster: docs/cluster.md), the corpus report's too."""
    ap.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="compute the windows on Ray workers: a local Ray instance, or the cluster at ADDRESS "
                         "(HEAD:6379); give it after the model directories (docs/cluster.md)")
    ap.add_argument("--ray-workers", type=int, default=None,
                    help="Ray workers, each holding one model (default: one a CPU, or a GPU with --device cuda)")
    ap.add_argument("--ray-threads", type=int, default=None,
                    help="torch threads (Ray CPUs) a worker holds (default: its share of the cores, at least 1)")


def add_compute_arguments(ap: argparse.ArgumentParser, out: str) -> None:
    """--parts and the --ray options (the protocol's windows on a Ray cluster: docs/cluster.md)."""
    ap.add_argument("--parts", default=None,
                    help=f"where finished windows are kept, so a rerun redoes only what is missing (default: beside "
                         f"{out}, NAME.parts, removed once the report is written when the run made it)")
    add_ray_arguments(ap)


def ray_problem(args) -> str | None:
    """Why the --ray options cannot be used, or None: Ray not installed (found before any model loads), an address
    that is a model directory argparse took for it, or the worker options without --ray."""
    if args.ray is None:
        if args.ray_workers is not None or args.ray_threads is not None:
            return "--ray-workers and --ray-threads go with --ray"
        return None
    if args.ray != "local" and Path(args.ray).exists():
        return (f"--ray {args.ray}: that is a path, not a Ray address; give --ray after the model directories, "
                "or --ray=ADDRESS")
    from analysis.reports.cluster import ClusterError, import_ray
    try:
        import_ray()
    except ClusterError as e:
        return str(e)
    return None


def check_ray(ap: argparse.ArgumentParser, args) -> None:
    """ap.error unless --ray is usable (ray_problem)."""
    problem = ray_problem(args)
    if problem:
        ap.error(problem)


def check_window(ap: argparse.ArgumentParser, dirs: list[str], window: int, one_at_a_time: bool = False) -> None:
    """ap.error, before any model loads, when `window` does not fit (models.memory's planner, through
    analysis.budgets.check_dirs): the models in dirs are held at once (the base and every run; a Ray worker: one at
    a time), one window's runs beside them (analysis.budgets.report_window_bytes)."""
    try:
        check_dirs(dirs, window, report_window_bytes, one_at_a_time=one_at_a_time)
    except OverBudget as e:
        ap.error(str(e))


def add_arguments(ap: argparse.ArgumentParser, default_source: str | None = None, required: bool = True) -> None:
    ap.add_argument("--source", action="append", default=None, required=required and default_source is None,
                    help="NAME=DIR:SPLIT or NAME=DIR:all (repeat)"
                         + (f"; default {default_source}" if default_source else ""))
    ap.add_argument("--windows", type=int, default=24, help="windows per source (the protocol)")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help="method ids (models.pruning.policies: a name, ':prompt' or ':step' for the other mode); "
                         "step-mode ones run in both readings, prompt-mode ones (compress once) in the second")
    ap.add_argument("--prompt-share", type=float, default=0.75,
                    help="the prompt's share of a window in the prompt-then-generation reading (0: no such reading)")
    ap.add_argument("--match", default=None,
                    help="the pruned model whose sparsity the policies match (default: the first)")


def parse(ap: argparse.ArgumentParser, args, window: int) -> tuple[dict[str, list[list[int]]], list[str], int | None]:
    """The --source windows, the --policies names and the prompt length (None: no prompt reading), or ap.error
    with what is wrong."""
    if args.windows < 1:
        ap.error(f"--windows must be at least 1, got {args.windows}")
    names = list(dict.fromkeys(n for n in args.policies.split(",") if n))   # (a name twice is one row)
    bad = policies.check_methods(names)
    if bad:
        ap.error(f"--policies: {'; '.join(bad)}")
    prompt = prompt_length(args.prompt_share, window)
    if prompt is not None and not (0 < args.prompt_share < 1 and 2 <= prompt < window - 1):
        ap.error(f"--prompt-share {args.prompt_share} leaves no prompt or no query after it in {window}-token windows")
    once = [n for n in names if policies.once(n)]
    if once and prompt is None and args.policies == ap.get_default("policies"):  # no prompt reading: not there
        names, once = [n for n in names if n not in once], []
    if once and prompt is None:
        ap.error(f"--policies {', '.join(once)} decide after a prompt: give --prompt-share above 0")
    sources = {}
    for spec in args.source:
        name, eq, where = spec.partition("=")
        if not eq or not SOURCE_NAME.fullmatch(name):
            ap.error(f"--source takes NAME=DIR:SPLIT with NAME of letters, digits, _ . -, got {spec!r}")
        try:
            sources[name] = source_windows(where, window, args.windows)
        except (ValueError, OSError, DataError) as e:
            ap.error(f"--source {spec}: {e}")
    return sources, names, prompt


def match_name(ap: argparse.ArgumentParser, args, models: list) -> str:
    """--match, or the first pruned model; it must be one of the pruned models. Rows are keyed by directory
    name: two models of one name, or one named like the dense row, a policy or a policy's run (NAME@BUDGET),
    would mix their windows."""
    names = [p.path.name for p in models]
    clash = sorted({n for n in names if names.count(n) > 1 or n == "dense" or n in policies.REGISTRY or "@" in n})
    if clash:
        ap.error(f"model directory names must be unique, not 'dense' or a policy's name, and without '@': "
                 f"{', '.join(clash)}")
    pruned = [p.path.name for p in models if p.config.prune]
    if not pruned:
        ap.error("no pruned model (model.prune) to match the policies to")
    match = args.match or pruned[0]
    if match not in pruned:
        ap.error(f"--match {match} is not one of the pruned models ({', '.join(pruned)})")
    return match


def command_flags(protocol: dict) -> str:
    """The protocol's flags (settings) as a command line repeats them."""
    return (" ".join(f"--source {shlex.quote(s)}" for s in protocol["sources"])
            + f" --windows {protocol['windows']} --policies {protocol['policies']}"
            + f" --prompt-share {protocol['prompt_share']} --match {protocol['match']}")


# what two saved runs must share for their sources to sit in one report; the weights' hashes and the code's commit
# too, where a run saved them (runs saved before they were recorded have neither)
PROTOCOL_KEYS = ("models", "base", "window", "windows", "policies", "prompt_share", "match")
PROVENANCE_KEYS = ("weights", "commit")
RESULT_KEYS = ("budgets", "all", "late")


def weights_sha256(dirs: list[str]) -> dict[str, str]:
    """Each model directory's weights file hash (a delta's own file: its base.json pins the base), keyed by the
    path as given, in order: compare the values (same_weights), since a path may be spelled another way later."""
    return {str(d): file_sha256(Path(d) / "model.safetensors") for d in dirs}


def same_weights(saved: dict, dirs: list[str]) -> bool:
    return list(saved.values()) == list(weights_sha256(dirs).values())


def settings(args, models: list[str], match: str) -> dict:
    """The protocol's settings as --json saves them (command_flags reads them back)."""
    return {"models": models, "base": args.base, "window": args.window, "windows": args.windows,
            "policies": args.policies, "prompt_share": args.prompt_share, "match": match, "sources": args.source}


def provenance(args, models: list[str]) -> dict:
    """What ran the protocol, taken before the models load (what they loaded, not what the files hold hours later):
    the weights' hashes ([base, *models]) and the code's commit."""
    return {"weights": weights_sha256([args.base, *models]), "commit": code_version()}


def merge(paths: list[str]) -> tuple[dict, dict]:
    """Saved runs (--json) of one protocol -> (its settings with every run's sources, the results in the order
    given); ValueError naming what differs, or a source in two runs."""
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a saved run ({e})") from None
        ok = (isinstance(run, dict) and all(k in run for k in (*PROTOCOL_KEYS, "results", "sources"))
              and isinstance(run["results"], dict)
              and all(isinstance(r, dict) and all(k in r for k in RESULT_KEYS) for r in run["results"].values()))
        if not ok:
            raise ValueError(f"{path}: not a saved run of this command (written with --json)")
        runs.append(run)
    first, results = runs[0], {}
    for path, run in zip(paths, runs):
        differ = [k for k in (*PROTOCOL_KEYS, *PROVENANCE_KEYS) if run.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"{path} differs from {paths[0]} in {', '.join(differ)}: not one protocol")
        for source, res in run["results"].items():
            if source in results:
                raise ValueError(f"source {source} is in more than one run")
            results[source] = res
    protocol = ({k: first.get(k) for k in (*PROTOCOL_KEYS, *PROVENANCE_KEYS)}
                | {"sources": [s for run in runs for s in run["sources"]]})
    return protocol, results


def prompt_length(prompt_share: float, window: int) -> int | None:
    return round(prompt_share * window) if prompt_share else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.reports.matched", description=__doc__.split("\n")[0])
    ap.add_argument("pruned", nargs="*", help="model directories: pruned ones run their own rule, others run dense")
    ap.add_argument("--base", help="the dense base the policies run on (required unless --merge)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--out", default=None,
                    help="the report (default docs/real_matched.md; with --json, only when given: runs of some "
                         "sources should not write over the whole report)")
    ap.add_argument("--json", default=None, help="also save the results here, for --merge")
    ap.add_argument("--merge", nargs="+", default=None, metavar="RUN.json",
                    help="render saved runs (--json) of one protocol as one report instead of running")
    add_arguments(ap, required=False)  # checked below: not with --merge
    add_compute_arguments(ap, "--json, else --out")
    add_device_arguments(ap, dtype=None)
    args = ap.parse_args(argv)
    if args.merge:
        if args.pruned or args.source or args.parts or args.ray:
            ap.error("--merge renders saved runs: give no model directories, --source, --parts or --ray")
        try:
            protocol, results = merge(args.merge)
        except ValueError as e:
            ap.error(str(e))
        window = protocol["window"]
        command = (f"python -m analysis.reports.matched {' '.join(protocol['models'])} --base {protocol['base']} "
                   f"--window {window} {command_flags(protocol)}; sources run apart, joined by --merge")
        write(args.out or DEFAULT_OUT, render(command, results, protocol["match"], window,
                               prompt_length(protocol["prompt_share"], window)))
        return 0
    check_ray(ap, args)   # (first: --ray given before the model directories takes one of them)
    if not args.pruned or not args.base or not args.source:
        ap.error("give the pruned model directories, --base and at least one --source (or --merge)")
    policies.load_plugins(kernels.settings.get("MIXSCOPE_POLICIES"))  # the operator's own policies (docs/policies.md)
    check_window(ap, [args.base, *args.pruned], args.window, one_at_a_time=args.ray is not None)  # (before any source)
    sources, names, prompt = parse(ap, args, args.window)
    ran = provenance(args, args.pruned) if args.json else {}
    if args.ray is None:
        base = load_model_dir(args.base, device=args.device)
        pruned = [load_model_dir(p, device=args.device) for p in args.pruned]
        loaded = {"base": base.model} | {Path(p).name: m.model for p, m in zip(args.pruned, pruned)}
    else:   # (the workers load the models: here only their configs, for --match)
        try:
            pruned = [SimpleNamespace(path=Path(d), config=config_of(d)) for d in args.pruned]
        except CheckpointError as e:
            ap.error(str(e))
        loaded = None
    match = match_name(ap, args, pruned)
    given = args.parts is not None
    parts = Path(args.parts) if given else default_parts(args.json or args.out or DEFAULT_OUT)
    try:
        results = run_protocol(args, args.base, args.pruned, [p.config.prune for p in pruned], sources, names, match,
                               prompt, parts, loaded, "matched")
    except HeldOutFailed as e:
        print(e, file=sys.stderr)
        return 1
    except ValueError as e:   # (parts of another protocol; a Ray cluster not reached, or workers that do not fit)
        print(f"matched: {e}", file=sys.stderr)
        return 2
    protocol = settings(args, args.pruned, match) | ran
    command = (f"python -m analysis.reports.matched {' '.join(args.pruned)} --base {args.base} --window {args.window} "
               + command_flags(protocol))
    if args.json:
        write(args.json, json.dumps(protocol | {"results": results}, indent=1))
    if args.out or not args.json:
        write(args.out or DEFAULT_OUT, render(command, results, match, args.window, prompt))
    if not given:
        remove_parts(parts)
    return 0


def write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
