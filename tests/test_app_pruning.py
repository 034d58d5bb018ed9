"""The Pruning page on a pruned model fine-tuned from a dense base (tiny, made here)."""
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from analysis.zoo import models_root
from models.checkpoint import load_model_dir, save_model_dir
from models.config import ModelConfig
from models.transformer import DecoderLM

PAGE = str(Path(__file__).resolve().parent.parent / "app" / "pages" / "7_Pruning.py")


@pytest.fixture
def pruned_zoo(tmp_path, monkeypatch):
    tok = load_model_dir(models_root() / "mha").tokenizer
    base_cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    base = save_model_dir(tmp_path / "base", DecoderLM(ModelConfig(**base_cfg)), tok)
    pruned = DecoderLM(ModelConfig(**base_cfg, prune=True, prune_r=8))
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.0)  # random interactions around the threshold: some drops
    save_model_dir(tmp_path / "pruned", pruned, tok, {"train": {"init_from": str(base)}})
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path))
    return tmp_path


def test_pruning_page(pruned_zoo):
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "pruned"       # opens on a pruned model, not "base"
    at.sidebar.selectbox(key="model").select("base").run()
    assert any("not a pruned model" in i.value for i in at.info)
    at.sidebar.selectbox(key="model").select("pruned").run()
    assert not at.exception, at.exception
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert "mha: tokens dropped per layer" in titles and any("part of speech" in t for t in titles)
    labels = {m.label for m in at.metric}
    assert {"mean sparsity (all layers)", "perplexity (pruned)", "perplexity (dense base)"} <= labels
    first = at.markdown[0].value
    at.selectbox(key="prune_layer").select(1).run()
    assert at.markdown[0].value != first or "<s " not in first


def test_pruning_page_opens_on_the_largest_model_that_drops_most(pruned_zoo):
    tok = load_model_dir(pruned_zoo / "pruned").tokenizer
    cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4, prune=True, prune_r=8)
    for name, sparsity in (("a-drops-little", 0.1), ("b-drops-most", 0.6)):
        save_model_dir(pruned_zoo / name, DecoderLM(ModelConfig(**cfg)), tok, {"final_valid_sparsity": sparsity})
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "b-drops-most"
    save_model_dir(pruned_zoo / "c-larger", DecoderLM(ModelConfig(**dict(cfg, n_layers=3))), tok)
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "c-larger"   # size first
