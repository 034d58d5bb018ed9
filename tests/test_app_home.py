"""The home page lists model directories, and shows a broken one's error without losing the rest."""
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from models.checkpoint import save_model_dir
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import tiny_config

APP = str(Path(__file__).resolve().parent.parent / "app" / "Home.py")


@pytest.fixture
def zoo(tmp_path, monkeypatch):
    tok = train_bpe(["a small corpus of words, a small corpus."] * 5, vocab_size=270, min_frequency=1)
    for mixer in ("mhe-mul", "we"):
        save_model_dir(tmp_path / mixer, DecoderLM(tiny_config(mixer, vocab_size=300)), tok)
    broken = save_model_dir(tmp_path / "broken", DecoderLM(tiny_config("mha", vocab_size=300)), tok)
    (broken / "model.safetensors").write_bytes(b"not a tensor file")
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path))
    return tmp_path


def test_lists_models_and_reports_the_broken_one(zoo):
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception
    assert "2 model(s) found" in at.subheader[0].value
    shown = at.dataframe[0].value
    assert sorted(shown["mixer"]) == ["mhe-mul", "we"]
    assert len(at.error) == 1 and "broken" in at.error[0].value and "model.safetensors" in at.error[0].value


def test_empty_zoo_and_added_path(tmp_path, monkeypatch, zoo):
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path / "empty"))
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert "No models found" in at.info[0].value
    at.text_input(key="extra_path").input(str(zoo / "we")).run()
    assert list(at.dataframe[0].value["mixer"]) == ["we"]
    at.text_input(key="extra_path").input(str(zoo / "missing")).run()
    assert "does not exist" in at.error[0].value
