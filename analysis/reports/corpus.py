"""The learned rule and training-free policies over a whole corpus: drop propensity by part of speech, token,
position and layer, and sparsity against perplexity, with bootstrap intervals over windows, into Parquet.

    python -m analysis.reports.corpus PRUNED_DIR [PRUNED_DIR ...] --base DIR --source NAME=SPEC [--source ...]
        [--window 512] [--windows N] [--policies streamingllm,tova,h2o] [--budgets 32,64,128,256] --out DIR
        [--parts DIR] [--resamples 1000] [--formats png,svg,pdf] [--figures RUN,...] [--force]
        [--ray [ADDRESS] [--ray-workers N] [--ray-threads T]]

SPEC is DIR:SPLIT or DIR:all (a prepared data directory: a split, or every split of a source no run trained on), or
a .txt/.md file or a directory of them (your own corpus, tokenized with the base's tokenizer, documents joined by its
end-of-text token). Each source is cut into windows of --window tokens (every window, or --windows of them spread
evenly). Every pruned model runs its own rule; the dense base runs with nothing evicted (the reference) and under
every policy at every budget (models.pruning.replay: the decisions token-by-token decoding makes), so the gamma
family's points sit beside the policies' budget sweeps. Every position a window can score is scored (its first token
has nothing to be predicted from); drop statistics count every token but a window's last (no later query could drop
it). Intervals: 95 % bootstrap over windows (paired for the perplexity cost).

Resumable: each (source, run, window) is written under --parts as it finishes (a Parquet file, then a line in the
run's windows.jsonl), and a rerun of the same protocol skips what is there; a different protocol is refused there.
Written to --out: corpus.json (the protocol, models with their weights' sha256, code version), stats_*.parquet
(per run and source: layer, pos_layer, pos, position, token), curves.parquet, report.md and the figures as bundles
(PNG, SVG, PDF, CSV, JSON spec for `python -m analysis.render`). Files already in --out are refused unless --force.

--ray computes the windows on Ray workers (analysis.reports.cluster; pip install mixscope[cluster]): a Ray instance
of its own on this machine, or the cluster at ADDRESS (HEAD:6379). The parts, and so the report, are the same; a
window that fails is named, the rest go on, and the command exits 1 saying what to rerun (docs/cluster.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from analysis import budgets, corpus, pruning
from models.memory import OverBudget
from analysis.reports.matched import (SOURCE_NAME, Windows, add_ray_arguments, cut_windows, ray_problem,
                                      source_windows)
from analysis.reports.parts import check_protocol, done_windows, window_ids_sha256, write_window
from models.files import write_atomic
from models.data.corpus import DataError
from models.pruning import policies

DEFAULT_POLICIES = "streamingllm,tova,h2o"
DEFAULT_BUDGETS = "32,64,128,256"
TABLES = corpus.TABLES
OUT_FILES = (*corpus.REPORT_FILES, "report.md")
TEXT_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    pass


# ---- sources -----------------------------------------------------------------------------------------------------

def text_windows(path: Path, tokenizer, window: int, count: int | None) -> list[list[int]]:
    """A user's corpus: a .txt/.md file or a directory of them (sorted by name), each a document, tokenized and
    joined by the end-of-text token, cut into windows like a prepared source."""
    from analysis.text import decode_upload
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise CorpusError(f"{path} holds no .txt or .md file")
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for f in files:
        if f.suffix not in TEXT_SUFFIXES:
            raise CorpusError(f"{f}: a corpus is .txt or .md files")
        data = f.read_bytes()
        text = decode_upload(f.name, data, max_chars=len(data))   # (the app's checks: UTF-8 text, not binary)
        ids += tokenizer.encode(text).ids + ([eos] if eos is not None else [])
    if len(ids) < window:
        raise CorpusError(f"{path} has {len(ids)} tokens, fewer than one {window}-token window")
    return cut_windows(ids, window, count)


def windows_of(spec: str, tokenizer, window: int, count: int | None) -> list[list[int]]:
    where = Path(spec)
    if where.suffix in TEXT_SUFFIXES or where.is_dir() and not (where / "manifest.json").is_file():
        if not where.exists():
            raise CorpusError(f"{spec} not found")
        return text_windows(where, tokenizer, window, count)
    return source_windows(spec, window, count)


# ---- runs --------------------------------------------------------------------------------------------------------

def run_plan(pruned: list[str], names: list[str], sizes: list[int]) -> list[dict]:
    """Every run: each pruned model's rule, the dense base, the base under each policy at each budget."""
    plan = [{"run": Path(d).name, "family": "learned", "model": d, "method": pruning.LEARNED, "budget": None}
            for d in pruned]
    plan.append({"run": "dense", "family": "dense", "model": "base", "method": pruning.NOTHING, "budget": None})
    plan += [{"run": f"{n}@{b}", "family": n, "model": "base", "method": n, "budget": b} for n in names for b in sizes]
    return plan


def window_metrics(visible, logprobs) -> dict:
    """analysis.reports.matched's per-window sums, so the curves pool what that report pools."""
    w = Windows()
    w.add(visible, logprobs)
    return {k: float(getattr(w, k)[0]) for k in ("nll", "tokens", "hidden", "nll_late", "tokens_late", "hidden_late")}


def one_window(model, ids: list[int], tags: list[str], run: dict) -> tuple[pd.DataFrame, dict]:
    keeps, _, lp = pruning.method_run(model, ids, run["method"], run["budget"])
    return corpus.window_rows(keeps, ids, tags), window_metrics(keeps, lp)


def window_result(loaded, key: tuple, ids: list[int], run: dict, tags: dict) -> tuple[pd.DataFrame, dict]:
    """one_window of a loaded model, its part-of-speech tags computed once per window (key) in `tags`: what a Ray
    worker computes of a corpus part (analysis.reports.cluster)."""
    if key not in tags:
        tags[key] = tags_of(loaded.tokenizer, ids)
    return one_window(loaded.model, ids, tags[key], run)


def tags_of(tokenizer, ids: list[int]) -> list[str]:
    from analysis.text import from_ids
    text, toks = from_ids(tokenizer, ids)
    return pruning.pos_tags(text, toks.offsets)


def run_all(args, sources: dict[str, list[list[int]]], plan: list[dict], parts: Path) -> None:
    """Runs what is not in --parts yet, one model loaded at a time."""
    from models.checkpoint import load_model_dir
    todo = {(s, r["run"]): sorted(set(range(len(ws))) - set(done_windows(parts / s / r["run"])))
            for s, ws in sources.items() for r in plan}
    total = sum(len(v) for v in todo.values())
    if not total:
        return
    bar = tqdm(total=total, desc="windows x runs", file=sys.stderr)
    tags: dict[tuple[str, int], list[str]] = {}
    for model_key in dict.fromkeys(r["model"] for r in plan):
        runs = [r for r in plan if r["model"] == model_key]
        if not any(todo[(s, r["run"])] for s in sources for r in runs):
            continue
        loaded = load_model_dir(args.base if model_key == "base" else model_key, device=args.device)
        for source, windows in sources.items():
            for r in runs:
                for w in todo[(source, r["run"])]:
                    bar.set_postfix_str(f"{source} {r['run']}")
                    key = (source, w)
                    if key not in tags:
                        tags[key] = tags_of(loaded.tokenizer, windows[w])
                    rows, metrics = one_window(loaded.model, windows[w], tags[key], r)
                    write_window(parts / source / r["run"], w, rows, metrics)
                    bar.update()
        del loaded
    bar.close()


# ---- aggregates --------------------------------------------------------------------------------------------------

def collect(parts: Path, sources: dict, plan: list[dict],
            resamples: int) -> tuple[dict[str, pd.DataFrame], pd.DataFrame, list[str]]:
    """The statistics of every (source, run) from its parts, the curves (one table each, with run and source
    columns) and the code versions that computed the windows. Each window's rows are reduced to its group sums as
    they are read (corpus.window_sums), so the memory is that of one window's rows and the sums."""
    stats = {t: [] for t in TABLES}
    curves, commits = [], set()
    for source in sources:
        metrics = []
        for r in plan:
            d = parts / source / r["run"]
            done = done_windows(d)
            commits |= {m.get("commit", "unknown") for m in done.values()}
            if r["family"] != "dense":
                sums = {t: [] for t in TABLES}
                for w in sorted(done):
                    rows = pd.read_parquet(d / f"{w:05d}.parquet").assign(window=w)
                    for t, table in corpus.window_sums(rows).items():
                        sums[t].append(table)
                joined = {t: pd.concat(v, ignore_index=True) for t, v in sums.items()}
                for t, table in corpus.statistics(joined, resamples).items():
                    stats[t].append(table.assign(run=r["run"], family=r["family"], budget=r["budget"], source=source))
            metrics += [{k: v for k, v in m.items() if k != "commit"} | {"run": r["run"], "family": r["family"],
                                                                          "budget": r["budget"]}
                        for m in done.values()]
        curves.append(corpus.curve(pd.DataFrame(metrics), resamples=resamples).assign(source=source))
    return ({t: pd.concat(v, ignore_index=True) for t, v in stats.items()}, pd.concat(curves, ignore_index=True),
            sorted(commits))


def report_md(command: str, protocol: dict, curves: pd.DataFrame, stats: dict[str, pd.DataFrame]) -> str:
    lines = [f"# Corpus report\n\nGenerated by `{command}`; do not edit by hand.\n",
             f"Windows of {protocol['window']} tokens; every position a window can score is scored (its first token "
             "is not), drop rates count every token but a window's last. Intervals: 95 % bootstrap over windows "
             "(paired for the cost). Policies run on the dense base; the learned rows are each model's own rule.\n"]
    for source, c in curves.groupby("source", sort=False):
        spec = protocol["sources"][source]
        lines.append(f"## {source} (`{spec['spec']}`, {spec['windows']} windows)\n")
        lines.append("| run | sparsity | perplexity | cost vs dense [95 % CI] |\n|---|---:|---:|---|")
        for r in c.sort_values(["family", "sparsity"]).itertuples():
            lines.append(f"| {r.run} | {r.sparsity:.1%} | {r.perplexity:.2f} | {r.cost:+.1%} "
                         f"[{r.cost_lo:+.1%}, {r.cost_hi:+.1%}] |")
        learned = stats["pos"][(stats["pos"]["source"] == source) & (stats["pos"]["family"] == "learned")]
        for run, s in learned.groupby("run", sort=False):
            s = s.sort_values("occurrences", ascending=False).head(12)
            lines.append(f"\n{run}: share of tokens dropped before the window's end, by part of speech (pooled over "
                         "layers)\n")
            lines.append("| POS | tokens | windows | dropped [95 % CI] |\n|---|---:|---:|---|")
            lines += [f"| {r.pos} | {r.occurrences:,} | {r.windows} | {r.drop_rate:.1%} "
                      + (f"[{r.lo:.1%}, {r.hi:.1%}] |" if np.isfinite(r.lo) else "(too few windows) |")
                      for r in s.itertuples()]
        lines.append("")
    return "\n".join(lines) + "\n"


def figures(report: dict, runs: list[str] | None = None) -> list[tuple]:
    """What the Corpus page opens on, per source and learned run (or the runs named; corpus.page_figures with the
    page's defaults); each source's curve once."""
    out, seen = [], set()
    for source in report["curves"]["source"].unique():
        c = report["curves"][report["curves"]["source"] == source]
        for run in runs or c[c["family"] == "learned"]["run"]:
            for item in corpus.page_figures(report, source, run):
                if item[0] not in seen:
                    seen.add(item[0])
                    out.append(item)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.reports.corpus", description=__doc__.split("\n")[0])
    ap.add_argument("pruned", nargs="+", help="pruned model directories (each runs its own rule)")
    ap.add_argument("--base", required=True, help="the dense base: the reference, and what the policies run on")
    ap.add_argument("--source", action="append", required=True,
                    help="NAME=DIR:SPLIT, NAME=DIR:all, or NAME=FILE_OR_DIR of .txt/.md (repeat)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=None, help="windows per source, spread evenly (default: all)")
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="policy ids (models.pruning.policies), step mode")
    ap.add_argument("--budgets", default=DEFAULT_BUDGETS, help="tokens each policy keeps, a sweep")
    ap.add_argument("--resamples", type=int, default=corpus.RESAMPLES)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default=None, help="where finished windows are kept (default OUT/parts)")
    ap.add_argument("--formats", default="png,svg,pdf",
                    help="the figures' image formats (the CSV and the JSON spec for analysis.render: always)")
    ap.add_argument("--figures", default=None,
                    help="the runs whose figures are written, comma-separated (default: every pruned model's)")
    ap.add_argument("--force", action="store_true", help="write over the report files already in --out")
    add_ray_arguments(ap)
    from models.device import add_arguments as add_device_arguments
    add_device_arguments(ap, dtype=None)
    args = ap.parse_args(argv)
    from analysis.export import ExportError
    try:
        return run(args)
    except (CorpusError, OverBudget, DataError, ExportError, corpus.ReportError, ValueError) as e:
        print(f"corpus: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    from analysis import export
    from analysis.export import model_entry
    from models.checkpoint import load_model_dir

    started = export.code_version()   # (read now, before this run writes anything into the checkout)
    formats, names, sizes, drawn = _check_arguments(args)
    out = Path(args.out)
    stale = sorted(out.glob("corpus_*.*")) if out.is_dir() else []   # (an earlier report's figures)
    export.refuse_overwrite([out / f for f in OUT_FILES] + stale, out, args.force)
    _check_models(args)
    tokenizer = load_model_dir(args.base, device="cpu").tokenizer   # (the base is checked whole here, once)
    sources, specs = _sources(args, tokenizer)
    plan = run_plan(args.pruned, names, sizes)
    models = {"base": model_entry(args.base)} | {Path(d).name: model_entry(d) for d in args.pruned}
    parts = Path(args.parts) if args.parts else out / "parts"

    def protocol_on(device: str) -> dict:   # (float32: load_model_dir's, as run_all and the Ray workers load)
        return {"window": args.window, "sources": specs, "runs": [r["run"] for r in plan],
                "precision": {"device": device, "dtype": "float32"},
                "models": {k: v["checkpoint_sha256"] for k, v in models.items()}}

    protocol, failed = _compute(args, sources, plan, parts, protocol_on)
    if failed:
        from analysis.reports.cluster import failure_report
        print(failure_report(failed, parts), file=sys.stderr)
        return 1
    precision = protocol["precision"]
    stats, curves, commits = collect(parts, sources, plan, args.resamples)
    names_of = {i: tokenizer.decode([i]) for i in {int(t) for t in stats["token"]["token_id"]}}
    stats["token"]["token"] = [names_of[int(t)] for t in stats["token"]["token_id"]]
    tables = _write_tables(out, stale, curves, stats)
    command = "python -m analysis.reports.corpus " + " ".join(argv_of(args))
    manifest = {"command": command, "window": args.window, "sources": specs, "models": models,
                "runs": plan, "policies": names, "budgets": sizes, "resamples": args.resamples,
                "precision": precision, "computed_by": commits, "code": started,
                "created": pd.Timestamp.now("UTC").isoformat(timespec="seconds"),
                "files": {f: corpus.file_sha256(out / f) for f in tables}}   # (read_report checks the tables)
    write_atomic(out / "report.md", lambda p: p.write_text(report_md(command, manifest, curves, stats),
                                                           encoding="utf-8"))
    write_atomic(out / "corpus.json", lambda p: p.write_text(json.dumps(manifest, indent=1, default=str) + "\n",
                                                             encoding="utf-8"))
    report = corpus.read_report(out)
    for name, fig, table, settings in figures(report, drawn):
        meta = export.sidecar(models, None, settings | {"report": command}, name, fig, precision)
        export.write_bundle(fig, table, out, name, meta, formats)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _compute(args, sources: dict[str, list[list[int]]], plan: list[dict], parts: Path,
             protocol_on) -> tuple[dict, list]:
    """What --parts lacks, in this process or (--ray) on Ray workers, after the protocol (protocol_on(the device type
    the windows run on)) is checked against --parts; returns the protocol and the windows that failed."""
    if args.ray is None:
        from models.device import resolve
        protocol = protocol_on(resolve(args.device).type)
        check_protocol(parts, protocol, CorpusError)
        run_all(args, sources, plan, parts)
        return protocol, []
    from analysis.reports import cluster
    with cluster.connected(args.ray) as ray:
        lay = cluster.layout(ray, args.device, args.ray_workers, args.ray_threads,
                             cluster.worker_bytes([args.base, *args.pruned], args.window))
        protocol = protocol_on(lay.device)
        check_protocol(parts, protocol, CorpusError)
        return protocol, cluster.run_windows(args, sources, plan, parts, protocol, ray, lay, window_result)


def _check_arguments(args) -> tuple[list[str], list[str], list[int], list[str] | None]:
    """The arguments that need no file checked: the figures' formats, the policies, the budgets (sorted, once each)
    and the runs whose figures are drawn (None: every pruned model's)."""
    from analysis import export
    formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(formats) - set(export.FORMATS))
    if unknown:
        raise CorpusError(f"--formats: {', '.join(unknown)}; choose from {', '.join(export.FORMATS)}")
    if args.windows is not None and args.windows < 1:
        raise CorpusError(f"--windows must be at least 1, got {args.windows}")
    if args.resamples < 1:
        raise CorpusError(f"--resamples must be at least 1, got {args.resamples}")
    names = [n for n in args.policies.split(",") if n]
    bad = policies.check_methods(names) + [f"{n} decides once after a prompt: the corpus runs step mode"
                                           for n in names if policies.once(n)]
    if bad:
        raise CorpusError(f"--policies: {'; '.join(bad)}")
    try:
        sizes = sorted({int(b) for b in args.budgets.split(",") if b})
    except ValueError:
        raise CorpusError(f"--budgets takes whole numbers of tokens, got {args.budgets!r}") from None
    if names and (not sizes or sizes[0] < 1):
        raise CorpusError("--budgets: give at least one budget of 1 token or more")
    drawn = [r for r in (args.figures or "").split(",") if r] or None
    unknown = [r for r in drawn or [] if r not in {Path(d).name for d in args.pruned}]
    if unknown:
        raise CorpusError(f"--figures {', '.join(unknown)}: name pruned models given (by directory name)")
    _check_ray(args)
    trained = [s for s in args.source if s.endswith(":train")]
    if trained:
        raise CorpusError(f"--source {trained[0]}: the models trained on that split, so its numbers would flatter "
                          "them; use test, valid or a source no run trained on (DIR:all)")
    return formats, names, sizes, drawn


def _check_ray(args) -> None:
    """--ray's options usable (matched.ray_problem), else CorpusError."""
    problem = ray_problem(args)
    if problem:
        raise CorpusError(problem)


def _check_models(args) -> None:
    """The models fit the memory budget one at a time, each given as pruned prunes, and their names tell the runs
    apart."""
    budgets.check_dirs([args.base, *args.pruned], args.window, budgets.report_window_bytes, one_at_a_time=True)
    for d in args.pruned:
        if not budgets.config_of(d).prune:
            raise CorpusError(f"{d} does not prune: give the pruned models, and the dense one as --base")
    names_seen = [Path(d).name for d in args.pruned]
    clash = sorted({n for n in names_seen
                    if names_seen.count(n) > 1 or n == "dense" or n in policies.REGISTRY or "@" in n})
    if clash:   # (a run's parts are kept under its name: h2o@16 is a policy's run)
        raise CorpusError("model directory names must be unique, not 'dense' or a policy's name, and without '@': "
                          + ", ".join(clash))


def _sources(args, tokenizer) -> tuple[dict[str, list[list[int]]], dict[str, dict]]:
    """Each --source's windows, and what the protocol records of it (its spec, windows, tokens and their hash)."""
    sources, specs = {}, {}
    for spec in args.source:
        name, eq, where = spec.partition("=")
        if not eq or not SOURCE_NAME.fullmatch(name):
            raise CorpusError(f"--source takes NAME=SPEC with NAME of letters, digits, _ . -, got {spec!r}")
        try:
            sources[name] = windows_of(where, tokenizer, args.window, args.windows)
        except (OSError, DataError, ValueError) as e:
            raise CorpusError(f"--source {spec}: {e}") from None
        specs[name] = {"spec": where, "windows": len(sources[name]), "tokens": args.window * len(sources[name]),
                       "ids_sha256": window_ids_sha256(sources[name])}
    return sources, specs


def _write_tables(out: Path, stale: list[Path], curves: pd.DataFrame,
                  stats: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """The curves and statistics as Parquet files in out (an earlier report's figures removed first); returns
    {file name: table}."""
    out.mkdir(parents=True, exist_ok=True)
    for old in stale:
        old.unlink()
    tables = {"curves.parquet": curves} | {f"stats_{t}.parquet": table for t, table in stats.items()}
    for f, table in tables.items():
        write_atomic(out / f, lambda p, table=table: table.to_parquet(p, index=False))
    return tables


def argv_of(args) -> list[str]:
    """The command's arguments as given (for the report's first line)."""
    parts = [*args.pruned, "--base", args.base, *(x for s in args.source for x in ("--source", s)),
             "--window", str(args.window)]
    if args.windows is not None:
        parts += ["--windows", str(args.windows)]
    parts += ["--policies", args.policies, "--budgets", args.budgets, "--formats", args.formats]
    return parts + (["--figures", args.figures] if args.figures else []) + ["--out", args.out]


if __name__ == "__main__":
    raise SystemExit(main())
