"""The Heads, Attention and Pruning pages on an imported Llama-family model (grouped K/V heads, RoPE)."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from models.checkpoint import load_model_dir, save_model_dir
from models.import_hf import import_hf
from models.transformer import DecoderLM
from tests.test_import_hf import llama, save_hf

PAGES = Path(__file__).resolve().parent.parent / "app" / "views"


@pytest.fixture
def imported_zoo(tmp_path, monkeypatch):
    root = tmp_path / "zoo"
    base = import_hf(save_hf(llama(kv=2), tmp_path, "src"), root / "llama-gqa")
    loaded = load_model_dir(base)
    pruned = DecoderLM(dataclasses.replace(loaded.config, prune=True, prune_r=8))
    pruned.load_state_dict(loaded.model.state_dict(), strict=False)   # pruning weights stay fresh
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.0)
    save_model_dir(root / "llama-gqa-pruned", pruned, loaded.tokenizer, {"train": {"init_from": str(base)}})
    monkeypatch.setenv("MIXSCOPE_MODELS", str(root))
    return root


def titles(at):
    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text") for c in at.get("plotly_chart")]


def test_heads_page_on_grouped_kv_heads(imported_zoo):
    at = AppTest.from_file(str(PAGES / "3_Heads.py"), default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("llama-gqa").run()
    assert not at.exception, at.exception
    assert any((t or "").startswith("gqa: QK circuits") for t in titles(at))
    at.selectbox(key="a_kind").set_value("OV").run()             # two K/V groups shared by four query heads
    assert not at.exception, at.exception
    assert any((t or "").startswith("gqa: OV circuits") for t in titles(at))


def test_attention_page_on_grouped_kv_heads(imported_zoo):
    at = AppTest.from_file(str(PAGES / "2_Attention.py"), default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("llama-gqa").run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert len(at.get("plotly_chart")) >= 1


def test_pruning_page_on_a_pruned_import(imported_zoo):
    at = AppTest.from_file(str(PAGES / "7_Pruning.py"), default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("llama-gqa-pruned").run()
    assert not at.exception, at.exception
    assert any("tokens dropped per layer" in (t or "") for t in titles(at))
    labels = {m.label for m in at.metric}
    assert {"perplexity (pruned)", "perplexity (dense base)"} <= labels


def test_every_policy_runs_on_an_imported_model_with_no_training(imported_zoo):
    """Eviction policies on the imported Llama (grouped K/V, rotary): each rule's views, then every policy at once."""
    at = AppTest.from_file(str(PAGES / "7_Pruning.py"), default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("llama-gqa").run()
    assert not at.exception, at.exception
    for method in ("streamingllm", "tova", "h2o", "snapkv"):
        at.selectbox(key="prune_method").select(method).run()
        assert not at.exception, (method, at.exception)
        assert any(f"gqa, {method} at " in (t or "") for t in titles(at))
    at.selectbox(key="prune_compare").select("tova").run()
    at.toggle(key="prune_all").set_value(True).run()
    assert not at.exception, at.exception
    assert list(at.dataframe[-1].value["method"])[1:] == ["streamingllm", "tova", "tova-group", "h2o", "h2o-layer",
                                                          "snapkv-layer", "oracle"]
