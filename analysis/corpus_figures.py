"""The Corpus page's figures of a report (analysis.reports.corpus), with the page's choices, so that the page
(app/views/8_Corpus.py) and the command line (analysis.export --report) draw the same ones: each an
analysis.bundle.Bundle named as analysis.corpus.page_figures names it, carrying the report's models as the report
recorded them."""
from __future__ import annotations

from analysis import corpus
from analysis.bundle import Bundle


def sources(report: dict) -> list[str]:
    """The report's sources, in the order it wrote them (the page's first is its default)."""
    return list(dict.fromkeys(report["curves"]["source"]))


def runs(report: dict, source: str) -> tuple[list[str], str | None]:
    """(the runs of one source but the dense one, in the report's order; the run the page opens on: the sparsest
    learned rule, else the first, None when there is none)."""
    c = report["curves"][report["curves"]["source"] == source]
    found = [r for r in dict.fromkeys(c["run"]) if r != "dense"]
    learned = c[c["family"] == "learned"].sort_values("sparsity", ascending=False)["run"].tolist()
    return found, learned[0] if learned else next(iter(found), None)


def default_others(report: dict, source: str, run: str) -> list[str]:
    """The runs the page draws beside `run` until others are chosen (analysis.corpus.default_others)."""
    return corpus.default_others(report["curves"][report["curves"]["source"] == source], run)


def page_figures(report: dict, label: str, source: str | None = None, run: str | None = None,
                 others: list[str] | None = None, min_tokens: int = 50, top: int = corpus.TOP_TOKENS) -> list[Bundle]:
    """The Corpus page's five figures of one report (corpus.read_report's), `label` naming it in their sidecars;
    each choice defaults to the page's: the first source, its sparsest learned run, the policies nearest it."""
    names = sources(report)
    source = names[0] if source is None else source
    if source not in names:
        raise ValueError(f"source {source!r}: the report has {', '.join(names)}")
    found, first = runs(report, source)
    run = first if run is None else run
    if run not in found:
        raise ValueError(f"run {run!r}: the report's runs on {source} are {', '.join(found)}")
    others = default_others(report, source, run) if others is None else others
    bad = [o for o in others if o not in found or o == run]
    if bad:
        raise ValueError(f"beside {run}: {', '.join(bad)} is not another run of the report on {source}")
    if not 1 <= min_tokens <= 500 or not 10 <= top <= 100:
        raise ValueError(f"min tokens {min_tokens}, top {top}: the page draws cells of 1-500 tokens, 10-100 tokens")
    man = report["manifest"]
    spec = {"report": label, "precision": man.get("precision")}
    return [Bundle(name, fig, table, spec | settings, man["models"])
            for name, fig, table, settings in corpus.page_figures(report, source, run, others, min_tokens, top)]
