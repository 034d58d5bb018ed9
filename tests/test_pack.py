"""bench.pack: files cut into parts that travel over several calls and are joined with their sha256 checked."""
import os

import pytest

from bench import pack


def test_split_then_join_over_two_folders(tmp_path):
    data = os.urandom(2500)
    (tmp_path / "w.whl").write_bytes(data)
    man = pack.split(tmp_path / "w.whl", tmp_path / "a", 1000)
    assert [p["bytes"] for p in man["parts"]] == [1000, 1000, 500]
    (tmp_path / "b").mkdir()  # the last part arrives in a second call's folder
    (tmp_path / "a" / "w.whl.part002").rename(tmp_path / "b" / "w.whl.part002")
    with pytest.raises(FileNotFoundError, match="part002"):
        pack.join([tmp_path / "a"], tmp_path / "out")
    (out,) = pack.join([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert out.read_bytes() == data
    with pytest.raises(FileExistsError):
        pack.join([tmp_path / "a", tmp_path / "b"], tmp_path / "out")


def test_a_damaged_part_is_named_and_nothing_is_left(tmp_path):
    (tmp_path / "f").write_bytes(os.urandom(300))
    pack.split(tmp_path / "f", tmp_path / "p", 100)
    part = tmp_path / "p" / "f.part001"
    part.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="part001"):
        pack.join([tmp_path / "p"], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_manifest_cannot_name_a_path(tmp_path):
    import json
    (tmp_path / "f").write_bytes(b"abc")
    pack.split(tmp_path / "f", tmp_path / "p", 10)
    man = tmp_path / "p" / "f.manifest.json"
    m = json.loads(man.read_text())
    m["parts"][0]["file"] = "../f"
    man.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="plain file name"):
        pack.join([tmp_path / "p"], tmp_path / "out")
