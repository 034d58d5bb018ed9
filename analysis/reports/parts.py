"""A report's resumable parts: each (source, run, window) written as a Parquet file and then a line in its run's
windows.jsonl (a window is done when both are there), under a protocol.json that refuses parts of another protocol.
The corpus report and the held-out protocol write theirs alike, in one process or from Ray workers' results
(analysis.reports.cluster); a rerun redoes only what is missing."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd

from models.files import write_atomic


def done_windows(part_dir: Path) -> dict[int, dict]:
    log = part_dir / "windows.jsonl"
    if not log.is_file():
        return {}
    out = {}
    for line in log.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:   # a line cut short by a stop: that window runs again
            continue
        if (part_dir / f"{rec['window']:05d}.parquet").is_file():
            out[rec["window"]] = rec
    return out


def write_window(part_dir: Path, w: int, rows: pd.DataFrame, metrics: dict, commit: str | None = None) -> None:
    """The rows first (written whole, then renamed), then the line that says the window is done (and which code
    computed it: `commit`, a Ray worker's, or this process's)."""
    part_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(part_dir / f"{w:05d}.parquet", lambda p: rows.to_parquet(p, index=False))
    log = part_dir / "windows.jsonl"
    cut = log.is_file() and log.stat().st_size and not log.read_bytes().endswith(b"\n")   # a line a stop cut short
    with open(log, "a", encoding="utf-8") as f:
        f.write(("\n" if cut else "") + json.dumps({"window": w, **metrics, "commit": commit or commit_now()}) + "\n")


def commit_now() -> str:
    from analysis.export import code_version
    v = code_version()
    return f"{v['commit']}{'-dirty' if v['uncommitted_changes'] else ''}"


def check_protocol(parts: Path, protocol: dict, error=ValueError) -> None:
    """Parts of another protocol (other models' weights, other windows' tokens, window size, sources, device or
    dtype) are refused with error(message), not mixed in; the code that computed each window is on its line (the
    manifest lists them)."""
    path = parts / "protocol.json"
    if not path.is_file() and any(parts.glob("*/*/windows.jsonl")):
        raise error(f"{parts} holds parts with no protocol.json: give another --parts, or remove that directory")
    if path.is_file():
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            saved = {}
        differ = [k for k in protocol if k != "runs" and saved.get(k) != protocol[k]]
        if differ:
            raise error(f"{parts} holds parts of another protocol (it differs in {', '.join(differ)}): "
                              "give another --parts, or remove that directory")
    parts.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda p: p.write_text(json.dumps(protocol, indent=1), encoding="utf-8"))


def window_ids_sha256(windows: list[list[int]]) -> str:
    """The source's windows as tokens: parts computed on other text (an edited file, a re-prepared split) differ."""
    return hashlib.sha256(np.asarray(windows, dtype=np.int64).tobytes()).hexdigest()
