"""mixscope in a notebook: open a model, run its learned pruning rule or an eviction policy on a text, read what
was dropped as DataFrames, compare methods at matched sparsity, draw and export the Pruning page's figures. Every
number comes from the functions the Pruning page calls (analysis.pruning, on models.pruning.replay); this module
only composes them. A worked example: docs/python.md.

Why `from analysis import lab` and not `import mixscope`: with the top level fixed, `mixscope` would be a setuptools
package-dir mapping onto a folder in analysis/, served in editable installs by setuptools' import hook: one file then
is two modules (`mixscope`, `analysis.<folder>`), `import mixscope` fails in a checkout not pip-installed (pytest from
the repository root, a fresh clone), and tests/test_layers.py's floors do not know the name. `analysis.lab` imports
wherever `analysis` does, on the analysis floor (models/ and kernels/ below, never app/), with no packaging change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from analysis import export as exporting, pruning, pruning_figures, views
from analysis.pruning import LEARNED, NOTHING
from analysis.text import Tokens, check_text, tokenize, window
from analysis.tokens import perplexity
from analysis.zoo import find_model_dirs, models_root
from kernels import settings
from models.checkpoint import CheckpointError, LoadedModel, load_model_dir
from models.pruning import policies

__all__ = ["LEARNED", "NOTHING", "CheckpointError", "Run", "Drawing", "shipped", "methods", "load", "run", "matched",
           "compare", "disagreement", "draw", "export", "FIGURES"]


def shipped() -> list[str]:
    """The shipped models' names (the folders of the models root, MIXSCOPE_MODELS; default assets/models).

    >>> "mha-1024-pruned" in lab.shipped()
    True"""
    return [p.name for p in find_model_dirs(models_root())]


def methods() -> list[str]:
    """What run() takes as `method`: "learned" (the model's own rule), "none" (nothing dropped) and every eviction
    policy's method id ("tova", "h2o:prompt", ...; plug-ins too once loaded: docs/policies.md).

    >>> lab.methods()[:4]
    ['learned', 'none', 'streamingllm', 'streamingllm:prompt']"""
    return [LEARNED, NOTHING, *policies.methods()]


def load(model: str | Path, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    """A model by shipped name ("smollm2-pruned-window") or by directory path, on `device` in `dtype` (default: as the
    app, MIXSCOPE_DEVICE and MIXSCOPE_DTYPE: CUDA when present, float32). A name without "/" that is a shipped
    model is that one (write "./mha" for a folder of your own named like one). Never downloads: a delta whose base
    is missing is refused with the command that fetches it (`make fetch`).

    >>> model = lab.load("mha-1024-pruned")
    >>> model.config.n_layers, model.path.name
    (4, 'mha-1024-pruned')"""
    path = Path(model).expanduser()
    name = str(model)
    if "/" not in name and "\\" not in name and (models_root() / name).is_dir():
        path = models_root() / name
    elif not path.is_dir():
        raise CheckpointError(f"{name} is neither a model directory nor a shipped model "
                              f"(shipped: {', '.join(shipped()) or 'none'} in {models_root()})")
    loaded = load_model_dir(path, device=device or settings.get("MIXSCOPE_DEVICE"),
                            dtype=dtype or settings.get("MIXSCOPE_DTYPE"))
    loaded.model.requires_grad_(False)
    return loaded


@dataclass(repr=False)
class Run:
    """What one method did to one window of a text (one forward). table: analysis.pruning.token_table, one row per
    (layer, token): dropped by the end, drop_share (of the layer's KV groups), dropped_at (the step), trigger_token,
    lifetime, hidden_share, the token's text and part of speech. per_layer: sparsity per layer. logprobs: log p of
    every token after the first, every position scored."""
    loaded: LoadedModel
    text: str            # the whole text given; the run read window_tokens of it, from token `start`
    start: int
    window_tokens: Tokens
    method: str
    budget: int | None
    prompt: int | None
    table: pd.DataFrame
    per_layer: pd.DataFrame
    logprobs: np.ndarray

    def __repr__(self) -> str:
        return (f"Run({self.name} on {self.loaded.path.name}, {len(self.window_tokens.ids)} tokens: sparsity "
                f"{self.sparsity:.1%}, perplexity {self.perplexity:.2f})")

    @property
    def name(self) -> str:
        """How the page names the method: "learned pruning", "tova at 37 tokens", "nothing evicted"."""
        return pruning_figures.method_name(self.method, self.budget)

    @property
    def perplexity(self) -> float:
        return perplexity(self.logprobs)

    @property
    def sparsity(self) -> float:
        """Mean over layers of the share of earlier tokens each query no longer sees (the page's mean sparsity)."""
        return float(self.per_layer["sparsity"].mean())

    @property
    def drops(self) -> pd.DataFrame:
        """One row per (layer, token) dropped by the end: when (dropped_at), by which token's step, and its text."""
        cols = ["layer", "position", "token", "pos", "dropped_at", "trigger_token", "trigger_pos", "lifetime"]
        return self.table.loc[self.table["dropped"], cols].sort_values(["layer", "dropped_at", "position"])

    def layer(self, i: int) -> pd.DataFrame:
        """The drop table of layer i alone (one row per token)."""
        return self.table[self.table["layer"] == i].reset_index(drop=True)

    @property
    def pos_rates(self) -> pd.DataFrame:
        """analysis.pruning.pos_drop_rates: per layer and part of speech, tokens and share dropped."""
        return pruning.pos_drop_rates(self.table)

    @property
    def triggers(self) -> pd.DataFrame:
        """analysis.pruning.trigger_counts: per layer, drops by the part of speech of the token whose step dropped."""
        return pruning.trigger_counts(self.table)

    @property
    def settings(self) -> dict:
        """What the run was, as the page's export sidecars record it."""
        return {"window_start": self.start, "tokens": len(self.window_tokens.ids), "method": self.method,
                "budget": self.budget, "prompt": self.prompt}


def run(model: LoadedModel | str | Path, text: str, method: str = LEARNED, budget: int | None = None,
        sparsity: float | None = None, prompt: int | None = None, start: int = 0) -> Run:
    """One method over the window of `text` the Pruning page analyses (at most 1,024 tokens, or the model's context,
    from token `start`). method: "learned", "none", or a policy id (methods()) at `budget` tokens held per layer or
    at the budget whose sparsity is nearest `sparsity` (analysis.pruning.matched_budget). A policy in prompt mode
    ("h2o:prompt") compresses the first `prompt` tokens once (default: the page's, three quarters of the window).

    >>> run = lab.run(model, "The bridge over the river was finished in the spring.")
    >>> run.drops.head()                                   # which layer dropped which token, when
    >>> lab.run(model, run.text, "tova", sparsity=run.sparsity).perplexity"""
    loaded = model if isinstance(model, LoadedModel) else load(model)
    text = check_text(text)
    win = window(tokenize(loaded.tokenizer, text), start, views.view(views.PRUNING_VIEW, loaded.config.context))
    n = len(win.ids)
    if n < 2:
        raise ValueError(f"the window from token {start} has {n} token(s): a run needs at least 2")
    if method in (LEARNED, NOTHING):
        if budget is not None or sparsity is not None:
            raise ValueError(f"{method!r} has no budget: budget and sparsity are a policy's")
        prompt = None
    else:
        prompt = (prompt or max(2, 3 * n // 4)) if policies.once(method) else None   # (parse: an unknown id refused)
        if budget is None and sparsity is None:
            raise ValueError(f"{method} needs a budget (tokens held per layer) or a target sparsity")
        budget = budget if budget is not None else pruning.matched_budget(method, sparsity, n, prompt)
    a = win.offsets[0][0]   # spaCy tags the window's own text, as the page does
    tags = pruning.pos_tags(text[a:win.offsets[-1][1]], [(x - a, y - a) for x, y in win.offsets])
    keeps, dropped_at, lp = pruning.method_run(loaded.model, win.ids, method, budget, prompt)
    return Run(loaded, text, start, win, method, budget, prompt,
               pruning.token_table(keeps, win.labels, tags, dropped_at), pruning.sparsity_per_layer(keeps), lp)


def matched(model: LoadedModel | str | Path, text: str, others=("tova", "h2o"), reference: str = LEARNED,
            budget: int | None = None, prompt: int | None = None, start: int = 0) -> dict[str, Run]:
    """The reference method's run (default the learned rule) and each of `others` at the budget whose sparsity is
    nearest the reference's, by name (Run.name), the reference first.

    >>> runs = lab.matched(model, text, ["tova", "streamingllm"])
    >>> {name: round(r.sparsity, 3) for name, r in runs.items()}"""
    ref = run(model, text, reference, budget=budget, prompt=prompt, start=start)
    out = {ref.name: ref}
    for method in others:
        r = run(ref.loaded, text, method, sparsity=ref.sparsity, prompt=prompt, start=start)
        out[r.name] = r
    return out


def compare(runs: dict[str, Run] | list[Run]) -> pd.DataFrame:
    """One row per run: method, budget, sparsity, perplexity and its change against the same weights with nothing
    evicted (one more forward per model and window), as the page's "every policy at this sparsity" table.

    >>> lab.compare(lab.matched(model, text, ["tova", "h2o"]))"""
    runs = list(runs.values()) if isinstance(runs, dict) else list(runs)
    dense: dict[tuple, float] = {}
    rows = []
    for r in runs:
        key = (id(r.loaded.model), tuple(r.window_tokens.ids))
        if key not in dense:
            dense[key] = perplexity(pruning.method_run(r.loaded.model, list(key[1]), NOTHING)[2])
        rows.append({"method": r.name, "method_id": r.method, "budget": r.budget, "prompt": r.prompt,
                     "sparsity": r.sparsity, "perplexity": r.perplexity,
                     "vs_nothing_evicted": r.perplexity / dense[key] - 1})
    return pd.DataFrame(rows).astype({"budget": "Int64", "prompt": "Int64"})


def disagreement(a: Run, b: Run) -> pd.DataFrame:
    """Per (layer, token) of one text: who dropped it by the end ("both", "a only", "b only", "neither");
    analysis.pruning.disagreement_by_layer and disputed_tokens summarise it.

    >>> a, b = lab.matched(model, text, ["tova"]).values()
    >>> lab.disagreement(a, b)["who"].value_counts()"""
    return pruning.disagreement(a.table, b.table)


@dataclass
class Drawing:
    """A figure with the table it draws (its CSV) and the runs and settings its sidecar records. Shown in a
    notebook as its plotly figure; `.fig` is the go.Figure."""
    name: str
    fig: go.Figure = field(repr=False)
    table: pd.DataFrame = field(repr=False)
    runs: list[Run]
    settings: dict

    def _repr_mimebundle_(self, *args, **kwargs):
        return self.fig._repr_mimebundle_(*args, **kwargs)


def _figure(kind: str, rs: list[Run]) -> tuple[go.Figure, pd.DataFrame]:
    """(figure, the table it draws) of the Pruning page, titled as the page titles it: a run's own figures are the
    page's first view (pruning_figures.method_figures), so the two are equal for one window and one method."""
    r = rs[0]
    if kind in ("tokens_by_layer", "pos_by_layer", "triggers"):
        drawn = {b.name: b for b in pruning_figures.method_figures(r.loaded.config.mixer, r.table, r.method,
                                                                   r.budget, r.settings)}
        if f"pruning_{kind}" in drawn:
            return drawn[f"pruning_{kind}"].fig, drawn[f"pruning_{kind}"].table
        # the page draws triggers for a learned rule that drops something; asked for, a policy's are drawn alike
        counts = r.triggers
        return pruning.triggers_figure(counts, "which parts of speech trigger drops"), counts
    if kind == "pos_profile":
        prof = pruning.pos_profile({x.name: x.table for x in rs})
        return pruning.pos_profile_figure(prof, "hidden from later queries, by part of speech (all layers)"), prof
    d = disagreement(*rs)
    return pruning.disagreement_figure(d, (r.name, rs[1].name), "who drops each token by the end of the text"), d


# the Pruning page's figures (named as its export buttons name their files: pruning_<kind>), and how many runs each
# draws: (fewest, most; None: any number)
FIGURES = {"tokens_by_layer": (1, 1), "pos_by_layer": (1, 1), "triggers": (1, 1), "pos_profile": (1, None),
           "disagreement": (2, 2)}


def draw(runs: Run | dict[str, Run] | list[Run], kind: str = "tokens_by_layer") -> Drawing:
    """One of the Pruning page's figures (FIGURES) of a run, or of several runs of one text (pos_profile: any
    number; disagreement: two). The first run's settings are the sidecar's, the others' methods and budgets added.

    >>> lab.draw(run, "pos_by_layer")                      # shown in a notebook
    >>> lab.draw(lab.matched(model, text, ["tova"]), "disagreement").table.head()"""
    rs = [runs] if isinstance(runs, Run) else list(runs.values()) if isinstance(runs, dict) else list(runs)
    if kind not in FIGURES:
        raise ValueError(f"unknown figure {kind!r}; choose from {', '.join(FIGURES)}")
    low, high = FIGURES[kind]
    if not rs or len(rs) < low or (high is not None and len(rs) > high):
        raise ValueError(f"{kind} draws {low if low == high else f'at least {low}'} run(s), got {len(rs)}")
    fig, table = _figure(kind, rs)
    extra = {"compare": [r.method for r in rs[1:]], "budgets": [r.budget for r in rs[1:]]} if len(rs) > 1 else {}
    return Drawing(f"pruning_{kind}", fig, table, rs, rs[0].settings | extra)


def export(drawing: Drawing, out_dir: str | Path, formats=tuple(exporting.FORMATS), name: str | None = None
           ) -> list[Path]:
    """The drawing as NAME.{png,svg,pdf,csv,json} in out_dir (analysis.export.write_bundle: the images in `formats`
    only, the CSV and the JSON sidecar always), the sidecar as the app's buttons and `mixscope export` write it:
    model and text hashes, settings, versions and the plotly spec `mixscope render` redraws. Files there are replaced.
    Images need Chromium (Debian's `chromium`); formats=() writes the CSV and sidecar alone.

    >>> lab.export(lab.draw(run, "pos_by_layer"), "figures", formats=("svg",))"""
    first = drawing.runs[0]
    name = name or drawing.name
    meta = exporting.sidecar(first.loaded.path, first.text, drawing.settings, name, drawing.fig,
                             exporting.precision_of(first.loaded.model))
    return exporting.write_bundle(drawing.fig, drawing.table, out_dir, name, meta, formats)
