"""The table of model directories the app can open, with the numbers from their cards."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

import torch

from analysis.plain import plotly_text
from kernels import settings
from models.checkpoint import CheckpointError, inspect_model_dir, read_card
from models.config import ConfigError
from models.evaluate import paper_metrics, zoo_references
from models.params import COMPONENTS, count_parameters, count_trainable
from models.transformer import DecoderLM

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("analysis.zoo")


def models_root() -> Path:
    """Where the shipped models live; MIXSCOPE_MODELS overrides (tests, other zoos)."""
    return settings.get("MIXSCOPE_MODELS")


def find_model_dirs(root: Path) -> list[Path]:
    """Sub-directories of root that look like model directories (they hold a config.json)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").exists())


def model_id(path: Path, root: Path | None = None) -> str:
    """A model's unique id: its path relative to the models root (a shipped model: its folder name), or, for one
    added by path, "path:" and that path as given (never equal to a shipped one's). `?model=` takes it."""
    root = models_root() if root is None else root
    try:   # a folder (or a symlink) directly in the root: its name there, links resolved for the parent only
        if Path(path).name and Path(path).parent.resolve() == Path(root).resolve():
            return Path(path).name
    except (OSError, RuntimeError):
        pass
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except (ValueError, OSError, RuntimeError):
        return f"path:{path}"


def model_labels(paths: list[Path], root: Path | None = None) -> dict[str, str]:
    """id -> what a selector shows: the folder name, or, when two models share it, the name and where it lives."""
    ids = [model_id(p, root) for p in paths]
    names = [Path(p).name for p in paths]
    where = {i: Path(i.removeprefix("path:")).parent if i.startswith("path:") else "shipped" for i in ids}
    return {i: n if names.count(n) == 1 else f"{n} ({where[i]})"
            for i, n in zip(ids, names)}


def layered_counts(cfg, freeze_base: bool = False) -> dict:
    """Parameter counts by component, the trainable ones and the KV-cache bytes per token of DecoderLM(cfg), from a
    one- and a two-layer model on the meta device (every count is linear in n_layers: layers are alike), so listing
    a model costs the same at any n_layers."""
    values = []
    for n in (1, 2):
        with torch.device("meta"):  # shapes only: counts and cache size need no weights
            model = DecoderLM(dataclasses.replace(cfg, n_layers=n))
        values.append({**count_parameters(model), "trainable": count_trainable(model, freeze_base)["total"],
                       "kv": model.cache_bytes_per_token()})
    one, two = values
    return {k: one[k] + (cfg.n_layers - 1) * (two[k] - one[k]) for k in one}


def describe(path: Path, loaded=None) -> dict:
    """One table row for a model directory, from its config, card and safetensors headers alone (a
    30-layer model costs no more than a small one; models.checkpoint.inspect_model_dir), or from `loaded`.
    A broken directory gives its error instead of numbers (a hostile one too: never an exception)."""
    row = {"model": path.name, "path": str(path)}
    try:
        info = loaded or inspect_model_dir(path)
        cfg, card = info.config, info.card
        # everything, or (with adapters) adapters + norms + pruning, or (base frozen) pruning alone
        freeze = bool(card.get("train", {}).get("freeze_base"))
        if loaded is not None:
            model = loaded.model
            counts = count_parameters(model)
            counts |= {"trainable": count_trainable(model, freeze)["total"], "kv": model.cache_bytes_per_token()}
        else:
            counts = layered_counts(cfg, freeze)
    except (CheckpointError, ConfigError) as e:
        return row | {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - one model that cannot be listed must not take the page down
        log.exception("listing %s", path)
        return row | {"error": f"it cannot be listed ({type(e).__name__})"}
    return row | {
        "mixer": cfg.mixer, "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
        "context": cfg.context, "attention params": counts["mixer"], "total params": counts["total"],
        **{f"{c} params": counts[c] for c in COMPONENTS},
        "adapter": cfg.adapter or "", "trainable %": 100.0 * counts["trainable"] / counts["total"],
        "test ppl": card.get("test_perplexity"), "KV-cache bytes/token": counts["kv"],
        "train steps": card.get("steps"), "train tokens": card.get("tokens_seen"),
        "train tokens/s": card.get("train_tokens_per_s"), "status": card.get("status") or "untrained",
        "data": card.get("data", {}).get("dir"), "note": getattr(info, "base_missing", None) or "", "error": None,
    }


def with_paper_metrics(table: pd.DataFrame, root: Path | None = None) -> pd.DataFrame:
    """PRR vs the zoo's `mha` directory and PEoP vs its `sha` directory (docs/methods.md;
    models.evaluate.zoo_references), where those exist. root: the zoo (default: models_root())."""
    if table.empty or "mixer" not in table:
        return table.assign(PRR=None, PEoP=None)
    root = models_root() if root is None else root
    ref = zoo_references(root)
    ref_data = _card_data(Path(root) / "mha")
    # perplexities compare only on the same test set in the same tokenizer: PRR / PEoP for those models alone
    same = [ref_data is None or r.get("data") in (None, ref_data) for _, r in table.iterrows()]
    metrics = [paper_metrics(r["test ppl"], r["attention params"], ref.get("mha"), ref.get("sha"))
               if r["error"] is None and pd.notna(r.get("test ppl")) and ok else {"prr": None, "peop": None}
               for ok, (_, r) in zip(same, table.iterrows())]
    return table.assign(PRR=[m["prr"] for m in metrics], PEoP=[m["peop"] for m in metrics])


def zoo_rows(table: pd.DataFrame, root: Path | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the toy zoo: the rows scored on the same test set as the zoo's `mha` directory, the rest: real models,
    models added by path). Without that reference every row is in the rest."""
    ref = _card_data(Path(models_root() if root is None else root) / "mha")
    if ref is None or "data" not in table:
        return table.iloc[0:0], table
    mine = table["data"] == ref
    return table[mine], table[~mine]


def _card_data(model_dir: Path) -> str | None:
    try:
        return read_card(Path(model_dir) / "card.json").get("data", {}).get("dir")
    except (OSError, ValueError, AttributeError):   # (CheckpointError is a ValueError)
        return None


def zoo_table(paths: list[Path], loader=None, root: Path | None = None) -> pd.DataFrame:
    rows = []
    labels = model_labels(paths, root)
    for p in paths:
        label = labels[model_id(p, root)]
        try:
            loaded = loader(p) if loader else None
        except (CheckpointError, ConfigError) as e:
            rows.append({"model": label, "path": str(p), "error": str(e)})
            continue
        rows.append(describe(p, loaded) | {"model": label})
    table = pd.DataFrame(rows)
    if "error" not in table:
        table["error"] = None
    table["error"] = table["error"].astype(object).where(table["error"].notna(), None)
    return with_paper_metrics(table, root)


# the label estimate efficiency_figure places its names by: pixels of the narrowest plot it is drawn in (an
# export's 700 x 460 px figure less its margins; the browser's is wider, so labels apart there are apart here too)
PLOT_PX = (540, 280)
CHAR_PX, LINE_PX, MARKER_PX = 7.0, 14.0, 12.0
# where a name may sit around its marker, in the order tried: plotly's textposition, and the box's offset from the
# marker's centre in units of (label width, label height) for its left-bottom corner
PLACES = {"top center": (-0.5, 0.0), "bottom center": (-0.5, -1.0), "middle right": (0.0, -0.5),
          "middle left": (-1.0, -0.5), "top right": (0.0, 0.0), "top left": (-1.0, 0.0),
          "bottom right": (0.0, -1.0), "bottom left": (-1.0, -1.0)}


def axis_range(values: np.ndarray, pad: float = 0.08) -> tuple[float, float]:
    lo, hi = float(np.min(values)), float(np.max(values))
    span = hi - lo or max(abs(hi), 1.0)
    return lo - pad * span, hi + pad * span


def label_boxes(px: np.ndarray, py: np.ndarray, labels: list[str], places: list[str]) -> list[tuple]:
    """Each label's (x0, y0, x1, y1) in plot pixels at its place beside its marker (px, py)."""
    boxes = []
    for x, y, text, place in zip(px, py, labels, places):
        w, h = CHAR_PX * len(text), LINE_PX
        fx, fy = PLACES[place]
        gap_x = MARKER_PX / 2 * (1 if fx == 0.0 else -1 if fx == -1.0 else 0)
        gap_y = MARKER_PX / 2 * (1 if fy == 0.0 else -1 if fy == -1.0 else 0)
        x0, y0 = x + fx * w + gap_x, y + fy * h + gap_y
        boxes.append((x0, y0, x0 + w, y0 + h))
    return boxes


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def label_places(px: np.ndarray, py: np.ndarray, labels: list[str]) -> list[str]:
    """A textposition per point such that no name covers another name or a marker, where one exists among PLACES
    (greedy, the lowest points first; a point with no free place keeps the one that covers least)."""
    r = MARKER_PX / 2
    markers = [(x - r, y - r, x + r, y + r) for x, y in zip(px, py)]
    chosen: dict[int, tuple] = {}
    places = ["top center"] * len(labels)
    for i in sorted(range(len(labels)), key=lambda k: (py[k], px[k])):
        def clashes(place):
            box = label_boxes(px[i:i + 1], py[i:i + 1], labels[i:i + 1], [place])[0]
            inside = box[0] >= 0 and box[2] <= PLOT_PX[0] and box[1] >= 0 and box[3] <= PLOT_PX[1]
            return (sum(_overlap(box, b) for b in chosen.values())
                    + sum(_overlap(box, m) for j, m in enumerate(markers) if j != i) + (not inside))
        best = min(PLACES, key=lambda place: (clashes(place), list(PLACES).index(place)))
        places[i] = best
        chosen[i] = label_boxes(px[i:i + 1], py[i:i + 1], labels[i:i + 1], [best])[0]
    return places


def plot_pixels(x: np.ndarray, y: np.ndarray, xr: tuple, yr: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Data coordinates (x already log10 where its axis is) in PLOT_PX pixels, y upwards."""
    return ((x - xr[0]) / (xr[1] - xr[0]) * PLOT_PX[0], (y - yr[0]) / (yr[1] - yr[0]) * PLOT_PX[1])


def point_labels(px: np.ndarray, py: np.ndarray, names: list[str]) -> tuple[list[str], list[str]]:
    """(text, textposition) per point: points whose markers overlap share one label (their names joined, left to
    right, on the leftmost; the others unlabelled, since no place beside one of them is free of the others), and
    every label sits where label_places finds room."""
    group = list(range(len(names)))

    def root(i):
        while group[i] != i:
            i = group[i]
        return i
    for i in range(len(names)):
        for j in range(i):
            if np.hypot(px[i] - px[j], py[i] - py[j]) < MARKER_PX:
                group[root(i)] = root(j)
    members: dict[int, list[int]] = {}
    for i in range(len(names)):
        members.setdefault(root(i), []).append(i)
    heads = [min(m, key=lambda k: (px[k], k)) for m in members.values()]
    labels = [", ".join(names[k] for k in sorted(m, key=lambda k: (px[k], k))) for m in members.values()]
    places = label_places(px[heads], py[heads], labels)
    text, where = [""] * len(names), ["top center"] * len(names)
    for k, label, place in zip(heads, labels, places):
        text[k], where[k] = label, place
    return text, where


def efficiency_figure(table: pd.DataFrame) -> go.Figure:
    """Test perplexity against attention parameters (the MHE paper's efficiency view), each point named where its
    name covers no other name or point (point_labels)."""
    ok = table[table["test ppl"].notna()] if "test ppl" in table else table.iloc[0:0]
    if "error" in ok:
        ok = ok[ok["error"].isna()]
    if "data" in ok and ok["data"].notna().any():  # one test set only: the most common one (the zoo's)
        ok = ok[ok["data"] == ok["data"].mode().iloc[0]]
    # names of directories (and what a config names its mixer): text, never plotly's HTML
    ok = ok.assign(model=ok["model"].map(plotly_text), mixer=ok["mixer"].map(plotly_text))
    if len(ok):
        lx = np.log10(ok["attention params"].astype(float).clip(lower=1).to_numpy())
        ly = ok["test ppl"].astype(float).to_numpy()
        xr, yr = axis_range(lx), axis_range(ly)
        label, place = point_labels(*plot_pixels(lx, ly, xr, yr), list(ok["model"]))
        ok = ok.assign(label=label, place=place)
    fig = px.scatter(ok, x="attention params", y="test ppl", text="label" if len(ok) else None, color="mixer",
                     log_x=True, title="test perplexity vs attention parameters (lower left is better)",
                     hover_name="model", hover_data=["total params", "KV-cache bytes/token"])
    fig.update_traces(marker={"size": MARKER_PX})
    fig.update_layout(height=460, showlegend=False)
    if len(ok):
        fig.update_xaxes(range=list(xr))
        fig.update_yaxes(range=list(yr))
        for trace in fig.data:   # px.scatter: one trace per mixer, its points in the table's order
            trace.textposition = list(ok.loc[ok["mixer"] == trace.name, "place"])
    return fig
