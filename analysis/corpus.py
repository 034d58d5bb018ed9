"""Drop decisions at corpus scale: per-window rows in, statistics with bootstrap intervals and figures out (pure).

A window's rows (window_rows) are one per (layer, token) but the window's last token, which no later query could
drop: the token's id, its part of speech, its position in the window and drop_share (the share of the layer's rows,
its KV groups under a per-group policy, whose last query in the window no longer sees it; 0 or 1 for the learned
rule).
A window's metrics (window_metrics) are analysis.reports.matched's per-window sums (NLL, scored tokens, summed query
sparsity, all positions and from position 100 on), so the curves here and that report pool the same numbers.

Statistics pool over windows: a group's drop rate is its summed drop_share over its tokens, and its 95 % interval a
bootstrap over windows (resampled with replacement, so tokens of one window move together).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis import bootstrap
from analysis.plain import plotly_text


TABLES = ("layer", "pos_layer", "pos", "position", "token")   # the statistics a report keeps, stats_<table>.parquet
REPORT_FILES = ("corpus.json", "curves.parquet", *(f"stats_{t}.parquet" for t in TABLES))
RESAMPLES = 1000
TOP_TOKENS = 40        # tokens drawn in the token figure (the most frequent ones, by drop rate)
MIN_TOKEN_COUNT = 20   # a token's rate is reported from this many occurrences on (its rows: one per layer)


def position_bucket(position: np.ndarray) -> np.ndarray:
    """Positions in log2 buckets: 0, 1, 2-3, 4-7, ... (bucket b holds 2^(b-1) .. 2^b - 1; 0 holds position 0)."""
    p = np.asarray(position, dtype=np.int64)
    return np.where(p > 0, np.floor(np.log2(np.maximum(p, 1))).astype(np.int64) + 1, 0)


def bucket_label(b: int) -> str:
    return "0" if b == 0 else str(2 ** (b - 1)) if b == 1 else f"{2 ** (b - 1)}-{2 ** b - 1}"


def window_rows(keeps: np.ndarray, ids: list[int], tags: list[str]) -> pd.DataFrame:
    """keeps [L,R,T,T] (analysis.pruning.method_run's visible masks), ids and POS tags of the window -> one row per
    (layer, token) but the last token: layer, position, token_id, pos, drop_share: the share of the layer's rows
    (its KV groups under a per-group policy) whose last query in the window cannot see the token. Drops are
    permanent, so that is "dropped before the window ends", read the same way for every method (a policy that
    evicts after its query attends, as H2O and TOVA do, has not dropped what it evicts at the last step for any
    query of the window)."""
    n_layers, t = keeps.shape[0], keeps.shape[-1]
    share = (np.asarray(keeps)[:, :, t - 1, :t - 1] == 0).mean(1)   # [L, T-1]
    return pd.DataFrame({"layer": np.repeat(np.arange(n_layers, dtype=np.int16), t - 1),
                         "position": np.tile(np.arange(t - 1, dtype=np.int32), n_layers),
                         "token_id": np.tile(np.asarray(ids[:t - 1], dtype=np.int32), n_layers),
                         "pos": np.tile(np.asarray(tags[:t - 1], dtype=object), n_layers).astype(str),
                         "drop_share": share.reshape(-1).astype(np.float32)})


GROUPS = {"layer": ["layer"], "pos_layer": ["pos", "layer"], "pos": ["pos"], "position": ["bucket"],
          "token": ["token_id"]}
MIN_WINDOWS = 5   # a group seen in fewer windows gets no interval (resamples would mostly miss it or repeat one)


def window_sums(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """One window's rows (or several, with a 'window' column) reduced to what the statistics need: per table, per
    window and group, the summed drop_share, the rows and the occurrences (tokens: rows over the layers a group
    pools). A few thousand numbers a window, whatever its length and the model's depth."""
    rows = rows if "window" in rows else rows.assign(window=0)
    rows = rows.assign(bucket=position_bucket(rows["position"].to_numpy()))
    layers = rows.groupby("window")["layer"].nunique()
    out = {}
    for table, by in GROUPS.items():
        g = rows.groupby(["window", *by], observed=True)["drop_share"].agg(["sum", "size"]).reset_index()
        g["occurrences"] = g["size"] if "layer" in by else g["size"] // g["window"].map(layers)
        out[table] = g
    return out


def propensity(sums: pd.DataFrame, by: list[str], resamples: int = RESAMPLES, seed: int = 0) -> pd.DataFrame:
    """Drop rate per group of `by` columns from per-window sums (window_sums' tables): occurrences (tokens), rows
    ((layer, token) pairs), windows the group occurs in, drop_rate = summed drop_share / rows, and its 95 %
    bootstrap interval over windows (lo, hi; NaN for a group in fewer than MIN_WINDOWS windows). A resample that
    misses a group leaves it out of that group's percentiles."""
    cols = [*by, "occurrences", "rows", "windows", "drop_rate", "lo", "hi"]
    if sums.empty:
        return pd.DataFrame(columns=cols)
    wide = sums.pivot_table(index="window", columns=by, values=["sum", "size", "occurrences"], aggfunc="sum",
                            fill_value=0, observed=True)
    total, size = wide["sum"].to_numpy(np.float64), wide["size"].to_numpy(np.float64)
    w = bootstrap.counts(len(wide), resamples, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = (w @ total) / (w @ size)   # [resamples, groups]
        lo, hi = np.nanpercentile(rates, [2.5, 97.5], axis=0)
    out = wide["sum"].columns.to_frame(index=False)
    out.columns = by
    out["occurrences"] = wide["occurrences"].to_numpy().sum(0).astype(np.int64)
    out["rows"] = size.sum(0).astype(np.int64)   # (layer, token) rows: occurrences times the layers pooled
    out["windows"] = (size > 0).sum(0).astype(np.int64)
    out["drop_rate"] = total.sum(0) / size.sum(0)
    few = out["windows"].to_numpy() < MIN_WINDOWS
    out["lo"], out["hi"] = np.where(few, np.nan, lo), np.where(few, np.nan, hi)
    return out[cols]


def statistics(sums: dict[str, pd.DataFrame], resamples: int = RESAMPLES, seed: int = 0) -> dict[str, pd.DataFrame]:
    """One run on one source (window_sums of all its windows, concatenated per table): the drop rate by layer, by
    (POS, layer), by POS, by position bucket and by token (tokens seen MIN_TOKEN_COUNT times or more)."""
    out = {t: propensity(sums[t], by, resamples, seed) for t, by in GROUPS.items() if t != "token"}
    out["position"]["positions"] = [bucket_label(int(b)) for b in out["position"]["bucket"]]
    tok = sums["token"]
    seen = tok.groupby("token_id")["occurrences"].sum()
    out["token"] = propensity(tok[tok["token_id"].isin(seen[seen >= MIN_TOKEN_COUNT].index)], ["token_id"],
                              resamples, seed)
    return out


def curve(metrics: pd.DataFrame, dense: str = "dense", late: bool = False, resamples: int = RESAMPLES,
          seed: int = 0) -> pd.DataFrame:
    """Per run on one source: pooled sparsity and perplexity, and the cost (perplexity over the dense run's, minus 1)
    with a paired 95 % bootstrap interval over the windows every run finished. metrics: one row per (run, window)
    with window_metrics' columns and run, family, budget."""
    sfx = "_late" if late else ""
    common = set.intersection(*(set(g["window"]) for _, g in metrics.groupby("run")))
    m = metrics[metrics["window"].isin(common)].sort_values(["run", "window"])
    if dense not in set(m["run"]):
        raise ValueError(f"the curve needs the dense run {dense!r} on the same windows")
    ref = m[m["run"] == dense]
    w = bootstrap.counts(len(ref), resamples, seed)
    dnll = ref[f"nll{sfx}"].to_numpy()
    rows = []
    for run, g in m.groupby("run", sort=False):
        nll, tok, hid = (g[f"{k}{sfx}"].to_numpy(np.float64) for k in ("nll", "tokens", "hidden"))
        cost = bootstrap.cost(nll.sum(), dnll.sum(), tok.sum())
        lo, hi = bootstrap.interval(bootstrap.cost(w @ nll, w @ dnll, w @ tok))
        rows.append({"run": run, "family": g["family"].iloc[0], "budget": g["budget"].iloc[0],
                     "windows": len(g), "tokens": int(tok.sum()), "sparsity": float(hid.sum() / tok.sum()),
                     "perplexity": float(np.exp(nll.sum() / tok.sum())), "cost": float(cost),
                     "cost_lo": float(lo), "cost_hi": float(hi)})
    return pd.DataFrame(rows)


# ---- figures -----------------------------------------------------------------------------------------------------

def _interval(r, lo, hi, n, windows) -> str:
    ci = f"[{lo:.1%}, {hi:.1%}]" if np.isfinite(lo) else f"(no interval: {windows} window(s))"
    return f"{r:.1%} {ci} of {n:,} tokens in {windows} window(s)"


def pos_layer_figure(stats: pd.DataFrame, title: str, min_tokens: int = 50) -> go.Figure:
    """The paper's figure: the share of each part of speech dropped by each layer (cells of at least min_tokens
    tokens), the interval in the hover."""
    s = stats[stats["occurrences"] >= min_tokens]
    order = s.groupby("pos")["occurrences"].sum().sort_values(ascending=False).index
    pivot = s.pivot(index="pos", columns="layer", values="drop_rate").reindex(order)
    hover = s.assign(text=[_interval(*v) for v in zip(s["drop_rate"], s["lo"], s["hi"], s["occurrences"],
                                                      s["windows"])])
    text = hover.pivot(index="pos", columns="layer", values="text").reindex(order)
    fig = go.Figure(go.Heatmap(z=pivot.to_numpy(np.float64), x=[f"L{c}" for c in pivot.columns],
                               y=[plotly_text(p) for p in pivot.index],
                               colorscale="Reds", zmin=0, zmax=1, customdata=text.to_numpy(),
                               colorbar={"title": "dropped"},
                               hovertemplate="%{y}, %{x}: %{customdata}<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="layer", yaxis_title="part of speech",
                      height=max(320, 24 * len(pivot) + 140))
    return fig


def _error(s: pd.DataFrame) -> dict:
    """Error bars of the intervals (none where a group has no interval)."""
    return dict(type="data", symmetric=False, array=(s["hi"] - s["drop_rate"]).fillna(0),
                arrayminus=(s["drop_rate"] - s["lo"]).fillna(0))


def _lines(stats: dict[str, pd.DataFrame], x: str, title: str, xaxis: str, category: bool = False) -> go.Figure:
    fig = go.Figure()
    for run, s in stats.items():
        name = plotly_text(run)   # (a report's run names: text, never plotly's HTML)
        fig.add_trace(go.Scatter(x=s[x], y=s["drop_rate"], mode="lines+markers", name=name, error_y=_error(s),
                                 customdata=[_interval(*v) for v in zip(s["drop_rate"], s["lo"], s["hi"],
                                                                       s["occurrences"], s["windows"])],
                                 hovertemplate="%{x}: %{customdata}<extra>" + name + "</extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title=xaxis, yaxis_title="share dropped by the end",
                      yaxis_range=[0, 1], height=360, xaxis_type="category" if category else None)
    return fig


def position_figure(stats: dict[str, pd.DataFrame], title: str) -> go.Figure:
    """Drop rate by position in the window (log2 buckets), one line per run, with its interval as error bars."""
    return _lines({r: s.sort_values("bucket") for r, s in stats.items()}, "positions", title,
                  "position in the window", category=True)


def layer_figure(stats: dict[str, pd.DataFrame], title: str) -> go.Figure:
    """Drop rate by layer, one line per run, with its interval as error bars."""
    return _lines({r: s.sort_values("layer") for r, s in stats.items()}, "layer", title, "layer")


def token_figure(stats: pd.DataFrame, title: str, top: int = TOP_TOKENS) -> go.Figure:
    """The `top` most frequent tokens (text, id and occurrences on each bar's label: two ids may decode alike),
    ordered by drop rate over all layers, with intervals."""
    s = stats.sort_values("occurrences", ascending=False).head(top).sort_values("drop_rate")
    text = s["token"] if "token" in s else s["token_id"].astype(str)
    labels = [plotly_text(f"{t!r} #{i} ({n:,})") for t, i, n in zip(text, s["token_id"], s["occurrences"])]
    fig = go.Figure(go.Bar(x=s["drop_rate"], y=labels, orientation="h", error_x=_error(s),
                           customdata=[_interval(*v) for v in zip(s["drop_rate"], s["lo"], s["hi"],
                                                                 s["occurrences"], s["windows"])],
                           hovertemplate="%{y}: %{customdata}<extra></extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="share dropped by the end (95 % interval)",
                      xaxis_range=[0, 1], height=max(320, 16 * len(s) + 120), showlegend=False)
    return fig


def curve_figure(curves: pd.DataFrame, title: str) -> go.Figure:
    """Sparsity against perplexity cost: each policy's budget sweep as a line, each learned model a point, with
    the cost's interval; the dense reference at 0."""
    fig = go.Figure()
    for family, g in curves.groupby("family", sort=False):
        g = g.sort_values("sparsity")
        err = dict(type="data", symmetric=False, array=g["cost_hi"] - g["cost"], arrayminus=g["cost"] - g["cost_lo"])
        learned = family == "learned"
        label = [plotly_text(r) if learned else f"{int(b)}" for r, b in zip(g["run"], g["budget"].fillna(0))]
        family = plotly_text(family)
        fig.add_trace(go.Scatter(x=g["sparsity"], y=g["cost"], error_y=err, name=family, text=label,
                                 mode="markers+text" if learned else "lines+markers",
                                 textposition="top left", marker_size=10 if learned else 6,
                                 hovertemplate="%{text}: sparsity %{x:.1%}, cost %{y:+.2%}<extra>" + family
                                               + "</extra>"))
    fig.update_layout(title=plotly_text(title), xaxis_title="sparsity (share of earlier tokens a query cannot see)",
                      yaxis_title="perplexity cost vs dense", xaxis_tickformat=".0%", yaxis_tickformat="+.0%",
                      xaxis_range=[-0.03, 1.03], height=420)
    return fig


def default_others(curves: pd.DataFrame, run: str, k: int = 3) -> list[str]:
    """The runs drawn beside `run` unless chosen: the policies' runs nearest its sparsity, one per policy."""
    c = curves[~curves["family"].isin(["learned", "dense"]) & (curves["run"] != run)]
    target = curves.set_index("run")["sparsity"].get(run, 0.0)
    near = c.assign(gap=(c["sparsity"] - target).abs()).sort_values("gap").drop_duplicates("family")
    return list(near["run"][:k])


def page_figures(report: dict, source: str, run: str, others: list[str] | None = None, min_tokens: int = 50,
                 top: int = TOP_TOKENS) -> list[tuple[str, go.Figure, pd.DataFrame, dict]]:
    """(name, figure, table, settings) of the Corpus page's figures for one source and one run (the command writes
    the same, with the page's defaults): the curve, POS x layer, by layer and by position beside `others`, tokens."""
    curves, stats = report["curves"], report["stats"]
    c = curves[curves["source"] == source]
    others = default_others(c, run) if others is None else others
    shown = [run, *[o for o in others if o != run]]

    def pick(table: str, runs: list[str]) -> pd.DataFrame:
        t = stats[table]
        return t[(t["source"] == source) & t["run"].isin(runs)]

    def by_run(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
        return {r: table[table["run"] == r] for r in shown if r in set(table["run"])}

    spec = {"source": source, "run": run}
    lay, pos = pick("layer", shown), pick("position", shown)
    return [
        (f"corpus_curve_{source}", curve_figure(c, f"{source}: sparsity against perplexity cost"), c,
         {"source": source}),
        (f"corpus_pos_layer_{run}_{source}",
         pos_layer_figure(pick("pos_layer", [run]), f"{run} on {source}: share of each part of speech dropped, per "
                                                    "layer", min_tokens),
         pick("pos_layer", [run]), spec | {"min_tokens": min_tokens}),
        (f"corpus_layers_{run}_{source}", layer_figure(by_run(lay), f"{source}: share dropped by each layer"), lay,
         spec | {"runs": shown}),
        (f"corpus_position_{run}_{source}",
         position_figure(by_run(pos), f"{source}: share dropped by position in the window"), pos,
         spec | {"runs": shown}),
        (f"corpus_tokens_{run}_{source}",
         token_figure(pick("token", [run]), f"{run} on {source}: the {top} most frequent tokens", top),
         pick("token", [run]), spec | {"top": top}),
    ]


# ---- reports on disk ---------------------------------------------------------------------------------------------

class ReportError(ValueError):
    pass


def find_reports(roots: list[Path]) -> list[tuple[int, Path]]:
    """(root index, directory) of the corpus reports (directories holding every REPORT_FILES) at each root or up to
    two levels below it."""
    found = {}
    for i, root in enumerate(roots):
        if not root.is_dir():
            continue
        for d in [root, *root.glob("*"), *root.glob("*/*")]:
            if d.is_dir() and all((d / f).is_file() for f in REPORT_FILES):
                found.setdefault(d.resolve(), (i, d))
    return sorted(found.values(), key=lambda x: (x[0], str(x[1])))


STATS_COLUMNS = {"run", "family", "source", "occurrences", "rows", "windows", "drop_rate", "lo", "hi"}
COLUMNS = {"curves": {"run", "family", "budget", "source", "windows", "sparsity", "perplexity", "cost", "cost_lo",
                      "cost_hi"},
           **{f"stats_{t}": STATS_COLUMNS | set(by) for t, by in GROUPS.items()}}
COLUMNS["stats_position"] |= {"positions"}
COLUMNS["stats_token"] |= {"token"}


def report_stamp(path: Path) -> tuple[float, ...]:
    """When each of a report directory's files last changed (a cache key: a rewritten report is read again);
    OSError when one is missing."""
    return tuple((Path(path) / f).stat().st_mtime for f in REPORT_FILES)


def file_sha256(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_report(path: Path) -> dict:
    """{"manifest", "curves", "stats": {table: frame}} of a report directory; ReportError saying what is wrong: a
    file missing or damaged, a column missing, or a table that is not the one its manifest wrote (a report
    rewritten by halves)."""
    import json
    try:
        manifest = json.loads((path / "corpus.json").read_text(encoding="utf-8"))
        frames = {f.removesuffix(".parquet"): pd.read_parquet(path / f) for f in REPORT_FILES if f.endswith(".parquet")}
    except (OSError, ValueError) as e:
        raise ReportError(f"{path.name}: not a readable corpus report ({e})") from None
    if not isinstance(manifest, dict) or not all(isinstance(manifest.get(k), dict)
                                                 for k in ("models", "sources", "files")):
        raise ReportError(f"{path.name}: corpus.json is not a corpus report's manifest of this version")
    missing = [f"{name}.{c}" for name, f in frames.items() for c in sorted(COLUMNS[name] - set(f.columns))]
    if missing:
        raise ReportError(f"{path.name}: not a corpus report of this version (missing {', '.join(missing[:4])})")
    changed = [f for f, sha in manifest["files"].items() if f in REPORT_FILES and file_sha256(path / f) != sha]
    if changed or set(manifest["files"]) != set(REPORT_FILES) - {"corpus.json"}:
        raise ReportError(f"{path.name}: {', '.join(changed) or 'its tables'} are not what its corpus.json wrote "
                          "(a report rewritten by halves?): run the report again")
    return {"manifest": manifest, "curves": frames["curves"],
            "stats": {t: frames[f"stats_{t}"] for t in TABLES}}
