"""Training snapshots along the alpha schedule: what the trained tensors were at chosen steps, so the way a pruning
rule came to be can be replayed on a fixed text (analysis.timeline, the Pruning page's timeline).

A run with `train.snapshots: N` writes, in its model directory, snapshots/step_SSSSSS.safetensors at step 0 (the
rule as initialised, before any update) and at N steps spread evenly over the alpha schedule (its last at the
schedule's end), each holding only the tensors that train (the rule's alone when the base is frozen: 8.8 MB a
snapshot on SmolLM2-135M) with the step, alpha and tokens seen in its metadata. A resumed run keeps the snapshots
it has and writes the rest.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.files import write_atomic

DIR = "snapshots"
MAX_BYTES = 2**30   # all of a run's snapshots at most (the trained tensors times the count): refused above


class SnapshotError(ValueError):
    pass


def snapshot_steps(steps: int, alpha_steps: int | None, count: int) -> list[int]:
    """Step 0, `count` steps spread evenly over the alpha schedule (alpha_steps, default every step) and the run's
    last step (the finished model's rule); [] when count is 0."""
    if count <= 0:
        return []
    span = min(alpha_steps or steps, steps)
    return sorted({0, steps} | {round(span * k / count) for k in range(1, count + 1)})


def keep_evenly(snaps: list[dict], most: int) -> list[dict]:
    """At most `most` snapshots, spread evenly, the first and the last always among them."""
    if len(snaps) <= most:
        return snaps
    picks = sorted({round(i * (len(snaps) - 1) / (most - 1)) for i in range(most)})
    return [snaps[i] for i in picks]


def clear(model_dir: str | Path, after: int = -1) -> None:
    """Remove the snapshots past step `after` (all of them by default): a run that starts over, or resumes from an
    earlier checkpoint than its last snapshot, writes them again on the path it now takes."""
    for s in listing(model_dir):
        if s["step"] > after:
            s["path"].unlink()


def path_of(model_dir: str | Path, step: int) -> Path:
    return Path(model_dir) / DIR / f"step_{step:06d}.safetensors"


def save(model_dir: str | Path, params: dict[str, torch.Tensor], step: int, meta: dict) -> Path:
    """The tensors (written whole, then renamed: a stop leaves no half file) with step and meta in the header."""
    path = path_of(model_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in params.items()}
    write_atomic(path, lambda p: save_file(tensors, str(p), metadata={"snapshot": json.dumps({"step": step, **meta})}))
    return path


def check_size(params: dict[str, torch.Tensor], count: int) -> None:
    """Refuse `count` snapshots of these tensors over MAX_BYTES in all."""
    need = count * sum(p.numel() * p.element_size() for p in params.values())
    if need > MAX_BYTES:
        raise SnapshotError(f"{count} snapshots of {len(params)} trained tensors take {need / 2**30:.1f} GB, over "
                            f"{MAX_BYTES / 2**30:.0f} GB: take fewer, or freeze the base (train.freeze_base)")


MAX_FILE_BYTES = MAX_BYTES   # one snapshot file read at most (a model directory a browser user added is untrusted)


def _alpha(value) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _home(model_dir: str | Path) -> Path | None:
    """Where the snapshots physically are: the model directory's own snapshots folder, resolved; None when there is
    none, or when the folder itself is a symlink or links out of the directory (its files are then read from
    nowhere: a model directory a browser user added is untrusted)."""
    try:
        home = Path(model_dir).resolve() / DIR
        if (Path(model_dir) / DIR).resolve() != home or not home.is_dir():
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    return home


def listing(model_dir: str | Path) -> list[dict]:
    """The snapshots a model directory holds, by step (entry of each step_*.safetensors, those it leaves out
    skipped); none when the snapshots folder links out of the directory."""
    root = _home(model_dir)
    if root is None:
        return []
    found = [entry(model_dir, Path(model_dir) / DIR / path.name) for path in sorted(root.glob("step_*.safetensors"))]
    return sorted((s for s in found if s is not None), key=lambda s: s["step"])


def entry(model_dir: str | Path, path: Path) -> dict | None:
    """{"step", "alpha", "tokens_seen", "path"} of one snapshot file, or None for a file that is not a regular file
    inside the directory's own snapshots folder (a link out of it, a folder that links out, a FIFO), one over
    MAX_FILE_BYTES, one whose header cannot be read or whose step is not its name's (a model directory a browser
    user added is untrusted)."""
    try:
        home = _home(model_dir)
        real = path.resolve()
        if home is None or real.parent != home or not real.is_file() or real.stat().st_size > MAX_FILE_BYTES:
            return None
        with safe_open(str(real), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("snapshot", "null"))
    except Exception:   # safetensors raises its own error types for a damaged header
        return None
    if isinstance(meta, dict) and isinstance(meta.get("step"), int) and path == path_of(model_dir, meta["step"]):
        return {"step": meta["step"], "alpha": _alpha(meta.get("alpha")), "tokens_seen": meta.get("tokens_seen"),
                "path": path}
    return None


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a snapshot's tensors into `model` (a copy of the run's final model: the rest of it is what did not
    train). Refused, with the tensor named, when a name or shape does not belong to the model (checked from the
    header, before any tensor is read) or when the rule's parameters are not all there."""
    own = dict(model.named_parameters())
    name_of = Path(path).name
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            shape = tuple(f.get_slice(name).get_shape())
            if name not in own or tuple(own[name].shape) != shape:
                raise SnapshotError(f"{name_of}: tensor {name} {shape} is not one of this model's")
        missing = [n for n in own if ".pruning." in n and n not in names]
        if missing:
            raise SnapshotError(f"{name_of} lacks the rule's {', '.join(missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''}: not a snapshot of this run")
        for name in names:
            with torch.no_grad():
                own[name].copy_(f.get_tensor(name).to(own[name].dtype))


def snapshot_names(path: str | Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())
