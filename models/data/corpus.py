"""What a prepared data directory holds and how training and evaluation read it: documents split whole into
train/valid/test by a stable hash, {split}.txt (documents separated by a blank line), {split}.npy (token ids,
each document followed by <|endoftext|>), tokenizer.json and manifest.json."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

SPLITS = ("train", "valid", "test")
HELD_OUT_FRACTION = 0.02          # of each source's documents, for valid and for test each

Doc = tuple[str, str]  # (document id, text)


class DataError(RuntimeError):
    """prepare cannot produce a usable corpus, or a data directory is incomplete; the message says why."""


def normalize(text: str) -> str:
    """One paragraph per line: blank lines separate paragraphs, any other whitespace run is one space."""
    paragraphs = re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return "\n".join(p for p in (" ".join(par.split()) for par in paragraphs) if p)


def split_documents(name: str, docs: list[Doc]) -> dict[str, list[str]]:
    """Whole documents go to one split each, chosen by a hash of their id: stable across machines."""
    keyed = sorted(docs, key=lambda d: hashlib.sha256(f"{name}/{d[0]}".encode()).hexdigest())
    n = len(keyed)
    held = max(1, round(HELD_OUT_FRACTION * n)) if n >= 3 else 0
    order = {"test": keyed[:held], "valid": keyed[held:2 * held], "train": keyed[2 * held:]}
    return {split: [t for _, t in sorted(order[split])] for split in SPLITS}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()



# --- what training and evaluation read ---------------------------------------------------------

def load_tokens(data_dir: str | Path, split: str) -> np.ndarray:
    path = Path(data_dir) / f"{split}.npy"
    if not path.is_file():
        raise DataError(f"{path} not found: run `python -m models.data prepare --out {data_dir}` first")
    return np.load(path, mmap_mode="r", allow_pickle=False)


def load_documents(data_dir: str | Path, split: str) -> list[str]:
    path = Path(data_dir) / f"{split}.txt"
    if not path.is_file():
        raise DataError(f"{path} not found: run `python -m models.data prepare --out {data_dir}` first")
    return [d for d in path.read_text(encoding="utf-8").split("\n\n") if d]


def manifest_sha256(data_dir: str | Path) -> str | None:
    path = Path(data_dir) / "manifest.json"
    return sha256_bytes(path.read_bytes()) if path.is_file() else None
