"""The table of model directories the app can open."""
from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from models.checkpoint import CheckpointError, load_model_dir
from models.params import count_parameters

REPO = Path(__file__).resolve().parent.parent


def models_root() -> Path:
    """Where the shipped models live; MIXSCOPE_MODELS overrides (tests, other zoos)."""
    return Path(os.environ.get("MIXSCOPE_MODELS", REPO / "assets" / "models"))


def find_model_dirs(root: Path) -> list[Path]:
    """Sub-directories of root that look like model directories (they hold a config.json)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").exists())


def describe(path: Path) -> dict:
    """One table row for a model directory; a broken directory gives its error instead of numbers."""
    row = {"model": path.name, "path": str(path)}
    try:
        loaded = load_model_dir(path)
    except CheckpointError as e:
        return row | {"error": str(e)}
    cfg, model = loaded.config, loaded.model
    counts = count_parameters(model)
    return row | {
        "mixer": cfg.mixer, "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
        "context": cfg.context, "params": counts["total"], "mixer params": counts["mixer"],
        "mixer out params": counts["mixer_out"], "cache bytes/token": model.cache_bytes_per_token(),
        "error": None,
    }


def zoo_table(paths: list[Path]) -> pd.DataFrame:
    return pd.DataFrame([describe(p) for p in paths])
