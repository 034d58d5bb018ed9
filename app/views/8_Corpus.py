"""Corpus: drop decisions over a whole corpus, read from a report of `python -m analysis.reports.corpus` (Parquet)."""
from pathlib import Path

import streamlit as st

from analysis import corpus, corpus_figures
from app import access
from app.common import export_buttons, public, setup
from app.plain import md
import kernels.settings  # (by its full name: `settings` here is a figure's)

REPO = Path(__file__).resolve().parents[2]


def report_roots() -> list[Path]:
    """Where reports are looked for: MIXSCOPE_CORPUS_DIRS (the operator's, os.pathsep-separated), else the
    checkout's docs/ and runs/. A browser user picks among what is found there, never types a path."""
    dirs = kernels.settings.get("MIXSCOPE_CORPUS_DIRS")
    return [p.expanduser() for p in dirs] if dirs is not None else [REPO / "docs", REPO / "runs"]


def label(i: int, path: Path, roots: list[Path]) -> str:
    """A report as the page names it: by its place under its root (in serve mode the root is a number, not a
    server path)."""
    rel = path.relative_to(roots[i]) if path.is_relative_to(roots[i]) else Path(path.name)
    if access.serving():
        return f"<corpus {i + 1}>/{rel}"
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@st.cache_data(max_entries=8, show_spinner="Reading the report…")
def cached_report(path: str, stamp: tuple[float, ...]) -> dict:
    return corpus.read_report(Path(path))


setup("Corpus")
st.caption("What a learned rule and the training-free policies drop over a whole corpus, from a report of "
           "`python -m analysis.reports.corpus`. A token counts as dropped when the last query of its "
           "window no longer sees it (the window's last token is left out); intervals are 95 % bootstrap over "
           "windows, none for a group seen in fewer than 5.")
roots = report_roots()
found = corpus.find_reports(roots)
if not found:
    where = "the corpus report directories" if access.serving() else ", ".join(map(str, roots))
    st.info(f"No corpus report found (looked in {md(where)}): run `python -m analysis.reports.corpus ... --out "
            "runs/corpus`.")
    st.stop()
names = {str(p): label(i, p, roots) for i, p in found}
chosen = st.sidebar.selectbox("Report", list(names), format_func=names.get, key="corpus_report")
try:
    rep = cached_report(chosen, corpus.report_stamp(Path(chosen)))
except (corpus.ReportError, OSError) as e:
    st.error(md(public(str(e))) if not access.serving() else f"{md(names[chosen])} could not be read "
             f"({type(e).__name__}): run its report again")
    st.stop()
man = rep["manifest"]
models = man["models"]
if access.serving():   # the directories a report recorded (perhaps another machine's) are not shown
    models = {k: {**v, "model_dir": k} if isinstance(v, dict) else v for k, v in models.items()}
about = (f"windows of {man.get('window', '?')} tokens · precision {man.get('precision', {})} · "
         + " · ".join(f"{k}: {str(v.get('checkpoint_sha256') if isinstance(v, dict) else v)[:12]}"
                      for k, v in models.items()))
# (a report's fields, shown as text)
st.caption(md(about) if access.serving() else f"{md(man.get('command', '?'))} · {md(about)}")
source = st.sidebar.selectbox("Source", corpus_figures.sources(rep), key="corpus_source",
                              format_func=lambda s: f"{s} ({man['sources'].get(s, {}).get('windows', '?')} windows)")
runs, first = corpus_figures.runs(rep, source)   # (first: the sparsest learned rule's run)
run = st.sidebar.selectbox("Run", runs, index=runs.index(first) if first in runs else 0, key="corpus_run")
least = st.sidebar.slider("Tokens a POS x layer cell needs", 1, 500, 50, key="corpus_min_tokens")
top = st.sidebar.slider("Tokens in the token figure", 10, 100, corpus.TOP_TOKENS, key="corpus_top")
others = st.sidebar.multiselect("Beside it (by layer and by position)", [r for r in runs if r != run],
                                default=corpus_figures.default_others(rep, source, run), key="corpus_others")
figs = corpus_figures.page_figures(rep, names[chosen], source, run, others, least, top)
heads = ["Sparsity against perplexity", f"{md(run)}: by part of speech and layer", "By layer", "By position",
         f"{md(run)}: the most frequent tokens"]   # (a run's name, as the report wrote it: text)
for head, f in zip(heads, figs):
    st.subheader(head)
    st.plotly_chart(f.fig, width="stretch")
    export_buttons(f.fig, f.table, f.name, models, None, f.settings, key=f.name.split("_")[1],
                   precision=man.get("precision"))
    if head == heads[0]:
        st.dataframe(f.table[["run", "family", "budget", "windows", "sparsity", "perplexity", "cost", "cost_lo",
                            "cost_hi"]].sort_values(["family", "sparsity"]).style.format(
            {"sparsity": "{:.1%}", "perplexity": "{:.2f}", "cost": "{:+.2%}", "cost_lo": "{:+.2%}",
             "cost_hi": "{:+.2%}", "budget": "{:.0f}"}, na_rep="-"), hide_index=True)
