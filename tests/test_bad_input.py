"""Bad input, one table of cases, through every entry point it can reach: pasted and uploaded text in the app,
add-by-path, `analysis.export`, `models.evaluate`, `models.generate`. Each case gets a clear message naming the
problem (CLIs: exit 2, no traceback) and the app goes on serving the next request."""
import pickle
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from streamlit.testing.v1 import AppTest

from analysis import export
from analysis.text import MAX_CHARS, TextError, check_text, decode_upload
from models import evaluate, generate
from models.checkpoint import CheckpointError, load_model_dir, save_model_dir
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import tiny_config

APP = Path(__file__).resolve().parent.parent / "app"
MIXED = ("Emoji 🙂🚀, right-to-left שלום עולם مرحبا, CJK 漢字かなカナ, "
         "combining e\u0301 a\u0308 Z\u0336, zero-width\u200b.")
CONTROL = "bell\x07 escape\x1b[31m tab\t vertical\x0b form\x0c and a DEL\x7f in the middle"

# (case, uploaded bytes, pasted text or None when pasting cannot produce it, refusal message or None if accepted)
TEXTS = [
    ("empty", b"", "", "is empty"),
    ("whitespace only", b" \n\t \r\n", " \n\t ", "is empty"),
    ("one over the limit", b"a" * (MAX_CHARS + 1), "a" * (MAX_CHARS + 1),
     f"{MAX_CHARS + 1:,} characters; the limit is"),
    ("more bytes than the limit's characters can take", b"a" * (4 * MAX_CHARS + 4), None, "bytes, more than"),
    ("binary", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None, "binary file"),
    ("UTF-16", "UTF-16 text".encode("utf-16"), None, "UTF-16 text; save it as UTF-8"),
    ("Latin-1", "café crème".encode("latin-1"), None, "not UTF-8 text"),
    ("emoji, RTL, CJK, combining", MIXED.encode(), MIXED, None),
    ("control characters", CONTROL.encode(), CONTROL, None),
    ("longer than the context", ("word " * 400).encode(), "word " * 400, None),
]
IDS = [t[0] for t in TEXTS]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["The quick brown fox jumps over the lazy dog. " + MIXED] * 20, vocab_size=290, min_frequency=1)


@pytest.fixture
def good(tmp_path, tok):
    return save_model_dir(tmp_path / "good", DecoderLM(tiny_config("mha", vocab_size=300, context=128)), tok,
                          {"test_perplexity": 50.0})


def _nan(d):
    t = load_file(str(d / "model.safetensors"))
    t["blocks.0.mixer.W_Q"][0, 0, 0] = float("nan")
    save_file(t, str(d / "model.safetensors"))


def _config(d, edit):
    import json
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


MODELS = {  # damage -> (how, what the message must say)
    "empty weight file": (lambda d: (d / "model.safetensors").write_bytes(b""), "not a readable safetensors file"),
    "truncated weights": (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:500]),
                          "not a readable safetensors file"),
    "pickle, not safetensors": (lambda d: (d / "model.safetensors").write_bytes(pickle.dumps({"w": [1.0]})),
                                "not a readable safetensors file"),
    "NaN weights": (_nan, "NaN or infinite values in blocks.0.mixer.W_Q"),
    "config does not match the weights": (lambda d: _config(d, lambda c: c.update(d_model=32)),
                                          "does not match config.json"),
    "unknown mixer": (lambda d: _config(d, lambda c: c.update(mixer="flash")), "unknown mixer 'flash'"),
    "missing tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "a file where a directory should be": (None, "is not a directory"),
}


def broken(good, case) -> Path:
    how, _ = MODELS[case]
    if how is None:
        f = good.parent / "model.txt"
        f.write_text("not a directory")
        return f
    how(good)
    return good


# --- text ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, data, pasted, refusal", TEXTS, ids=IDS)
def test_text_upload_and_paste(case, data, pasted, refusal):
    for check in [lambda: decode_upload("in.txt", data)] + ([lambda: check_text(pasted)] if pasted is not None else []):
        if refusal is None:
            assert check()
        else:
            with pytest.raises(TextError, match=refusal):
                check()


EXPORTED = [t for t in TEXTS if t[3] is not None or t[0] == "longer than the context"]  # accepted text: test_export


@pytest.mark.parametrize("case, data, pasted, refusal", EXPORTED, ids=[t[0] for t in EXPORTED])
def test_text_through_the_export_cli(case, data, pasted, refusal, good, tmp_path, capsys):
    text = tmp_path / "in.txt"
    text.write_bytes(data)
    code = export.main([str(good), "--text", str(text), "--out", str(tmp_path / "figs")])
    err = capsys.readouterr().err
    if refusal is None:
        assert code == 0 and any((tmp_path / "figs").iterdir())
    else:
        assert code == 2 and refusal.split(";")[0] in err and "Traceback" not in err


@pytest.mark.parametrize("case, data, pasted, refusal", [t for t in TEXTS if t[2] is not None],
                         ids=[t[0] for t in TEXTS if t[2] is not None])
def test_text_as_a_generate_prompt(case, data, pasted, refusal, good, capsys):
    code = generate.main([str(good), "--prompt", pasted, "--max-new-tokens", "3", "--json"])
    out, err = capsys.readouterr()
    if case in ("empty", "whitespace only"):
        assert code == 2 and "empty prompt" in err
    elif case in ("one over the limit", "longer than the context"):
        assert code == 2 and "context window is 128" in err and "shorten it" in err
    else:
        assert code == 0 and '"new_tokens": 3' in out
    assert "Traceback" not in err


@pytest.mark.parametrize("case, data, pasted, refusal", [t for t in TEXTS if t[2] is not None],
                         ids=[t[0] for t in TEXTS if t[2] is not None])
def test_text_pasted_in_the_app(case, data, pasted, refusal, good, monkeypatch):
    monkeypatch.setenv("MIXSCOPE_MODELS", str(good.parent))
    at = AppTest.from_file(str(APP / "views" / "2_Attention.py"), default_timeout=120).run()
    at.text_area(key="text_area").set_value(pasted).run()
    assert not at.exception, at.exception
    if case == "one over the limit":  # the text box keeps the first MAX_CHARS characters, and says it cut the rest
        assert len(at.text_area(key="text_area").value) == MAX_CHARS
        assert any("was cut off" in w.value for w in at.warning) and at.get("plotly_chart")
    elif refusal is None:
        assert at.get("plotly_chart")
    else:
        assert any(refusal in w.value for w in at.warning)
        at.text_area(key="text_area").set_value("The fox is quick.").run()   # and the next request is served
        assert not at.exception and at.get("plotly_chart")


# --- model directories ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", MODELS)
def test_damaged_model_directories_through_every_entry_point(case, good, tmp_path, capsys):
    path = broken(good, case)
    why = MODELS[case][1]
    with pytest.raises(CheckpointError, match=why):
        load_model_dir(path)
    text = tmp_path / "in.txt"
    text.write_text("The quick brown fox.")
    for cli in (lambda: export.main([str(path), "--text", str(text), "--out", str(tmp_path / "o")]),
                lambda: evaluate.main([str(path), "--data", str(tmp_path)]),
                lambda: generate.main([str(path), "--prompt", "The fox"])):
        assert cli() == 2
        err = capsys.readouterr().err
        assert why in err and err.startswith("error: ") and "Traceback" not in err


@pytest.mark.parametrize("case", MODELS)
def test_damaged_model_added_by_path_in_the_app(case, good, tmp_path, tok, monkeypatch):
    zoo = tmp_path / "zoo"
    save_model_dir(zoo / "fine", DecoderLM(tiny_config("mha", vocab_size=300, context=24)), tok)
    monkeypatch.setenv("MIXSCOPE_MODELS", str(zoo))
    path = broken(good, case)
    at = AppTest.from_file(str(APP / "Models.py"), default_timeout=120)
    at.session_state["added_paths"] = [str(path)]
    at.run()
    assert not at.exception, at.exception
    if case == "NaN weights":  # the Models page reads headers, not values: the NaN is caught when a page opens it
        assert any(c.value.startswith("2 model(s) found") for c in at.caption)
    else:
        assert any(MODELS[case][1] in e.value for e in at.error)
        assert any(c.value.startswith("1 model(s) found") for c in at.caption)   # the good one is still listed
    at = AppTest.from_file(str(APP / "views" / "2_Attention.py"), default_timeout=120)
    at.session_state["added_paths"] = [str(path)]
    at.run()
    at.sidebar.selectbox(key="model").select(f"path:{path}").run()   # an added model's id: "path:" + its path
    assert not at.exception and any(MODELS[case][1] in e.value for e in at.sidebar.error)
    at.sidebar.selectbox(key="model").select("fine").run()     # the next request is served
    assert not at.exception and at.get("plotly_chart")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_caught_at_load_not_as_nan_logits(value, good):
    t = load_file(str(good / "model.safetensors"))
    t["ln_f.weight"][3] = value
    save_file(t, str(good / "model.safetensors"))
    with pytest.raises(CheckpointError, match="NaN or infinite values in ln_f.weight"):
        load_model_dir(good)
