"""The main result the app opens on: the flagship model (SmolLM2-135M fine-tuned with a learned pruning rule), the
corpus report committed with it (docs/corpus_smollm2, written by `python -m analysis.reports.corpus`), and the
sample texts a visitor can run it on (assets/texts)."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from analysis import corpus
from models.checkpoint import read_card
from models.files import CheckpointError

REPO = Path(__file__).resolve().parent.parent
FLAGSHIP = "smollm2-pruned-window"
REPORT = REPO / "docs" / "corpus_smollm2"
SAMPLES = REPO / "assets" / "texts"


def trained_dirs(report: dict, root: Path) -> set[str]:
    """The data directories the report's learned runs were fine-tuned on, from the cards of the models of those names
    in the models folder `root` (a run whose model is not there counts for nothing)."""
    dirs = set()
    for r in report["manifest"].get("runs", []):
        if not isinstance(r, dict) or r.get("family") != "learned":
            continue
        try:
            card = read_card(Path(root) / Path(str(r.get("run"))).name / "card.json")
        except (CheckpointError, OSError):
            continue
        data = card.get("data")
        if isinstance(data, dict) and isinstance(data.get("dir"), str):
            dirs.add(os.path.normpath(data["dir"]))
    return dirs


def source_kind(manifest: dict, source: str, trained: set[str]) -> str | None:
    """How a report's source relates to the fine-tuning data (`trained`: trained_dirs): a split of it ("in domain"),
    a prepared source none of the runs saw ("held out"), or None for a text corpus of one's own (a file or a
    directory of them: nothing says what it holds)."""
    spec = str(manifest.get("sources", {}).get(source, {}).get("spec", ""))
    where, colon, split = spec.rpartition(":")
    if not colon or not where:
        return None
    if os.path.normpath(where) in trained:
        return ("in domain: its training split included" if split == "all" else
                f"in domain: the {split} split of the fine-tuning data")
    return "held out: a source the fine-tuning never saw" if trained else None


def learned_line(curves: pd.DataFrame, source: str, run: str, window: int | str = "?") -> str | None:
    """What the learned run measured on one source, in words, with its interval over windows (None when the report
    has no such run)."""
    row = curves[(curves["source"] == source) & (curves["run"] == run)]
    if row.empty:
        return None
    r = row.iloc[0]
    return (f"{run} hides {r['sparsity']:.0%} of the earlier tokens from each query for {r['cost']:+.1%} perplexity "
            f"[95 % CI {r['cost_lo']:+.1%}, {r['cost_hi']:+.1%}] over {int(r['windows'])} windows of "
            f"{window} tokens")


def headline(report: dict, root: Path, run: str = FLAGSHIP) -> list[dict]:
    """Per source of the report: its name, how it relates to the fine-tuning data (source_kind, with the cards in the
    models folder `root`), the learned run's line and the curve of sparsity against perplexity cost (the run beside
    the dense reference and every policy's budget sweep; the report's other learned runs are left to the Corpus
    page)."""
    man, curves = report["manifest"], report["curves"]
    trained = trained_dirs(report, root)
    out = []
    for source in dict.fromkeys(curves["source"]):
        c = curves[(curves["source"] == source) & ((curves["family"] != "learned") | (curves["run"] == run))]
        kind = source_kind(man, source, trained)
        title = f"{source} ({kind.split(':')[0]})" if kind else source
        out.append({"source": source, "kind": kind, "line": learned_line(curves, source, run, man.get("window", "?")),
                    "figure": corpus.curve_figure(c, f"{title}: sparsity against perplexity cost"), "table": c})
    return out


def samples(folder: Path | None = None) -> dict[str, str]:
    """title -> text of each sample (a .txt file: its title, a blank line, the text), in file-name order."""
    out = {}
    for path in sorted((SAMPLES if folder is None else folder).glob("*.txt")):
        title, _, text = path.read_text(encoding="utf-8").partition("\n\n")
        out[title.strip()] = text.strip()
    return out


def read_main_report(path: Path | None = None) -> dict | None:
    """The committed report (REPORT unless path), or None when this checkout has none (or it does not read)."""
    try:
        return corpus.read_report(REPORT if path is None else path)
    except (corpus.ReportError, OSError):
        return None

