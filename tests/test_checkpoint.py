"""Model directories: bit-exact round trip, and one clear error per kind of damage."""
import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import CheckpointError, inspect_model_dir, load_model_dir, save_model_dir
from models.files import file_sha256
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, tiny_config

TEXT = ["The quick brown fox jumps over the lazy dog.", "A stitch in time saves nine!"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TEXT, vocab_size=280, min_frequency=1)


@pytest.fixture
def model_dir(tmp_path, tokenizer):
    model = DecoderLM(tiny_config("mha", vocab_size=300))
    return save_model_dir(tmp_path / "m", model, tokenizer, {"steps": 0})


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_round_trip_is_bit_exact(mixer, tmp_path, tokenizer):
    model = DecoderLM(tiny_config(mixer, vocab_size=300))
    save_model_dir(tmp_path / mixer, model, tokenizer, {"steps": 7, "seed": 3})
    loaded = load_model_dir(tmp_path / mixer)
    assert loaded.config == model.config
    a, b = model.state_dict(), loaded.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.card["steps"] == 7 and loaded.card["mixer"] == mixer and "code_version" in loaded.card
    ids = tokenizer.encode("The quick fox").ids
    assert loaded.tokenizer.encode("The quick fox").ids == ids
    with torch.no_grad():
        assert torch.equal(model.eval()(torch.tensor([ids])).logits, loaded.model(torch.tensor([ids])).logits)


def test_a_directory_written_under_an_older_tensor_name_loads(tmp_path, tokenizer):
    """COMPACTER's shared A_i were stored as 'adapter_rule' before the rename: such a directory still loads,
    same A_i."""
    model = DecoderLM(tiny_config("mha", vocab_size=300, adapter="compacter", adapter_reduction=4, phm_n=2))
    path = save_model_dir(tmp_path / "old", model, tokenizer, {"steps": 1}) / "model.safetensors"
    tensors = load_file(str(path))
    tensors["adapter_rule"] = tensors.pop("adapter_A")
    save_file(tensors, str(path))
    loaded = load_model_dir(tmp_path / "old")
    assert torch.equal(loaded.model.adapter_A, model.adapter_A)
    assert inspect_model_dir(tmp_path / "old").config == model.config   # the Models page reads the header alone
    tensors["adapter_A"] = tensors["adapter_rule"] + 1                   # both names: which is meant? refused
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="both 'adapter_rule' and 'adapter_A'"):
        load_model_dir(tmp_path / "old")


def test_wrong_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_dir(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_model_dir(tmp_path / "file")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "card.json"])
def test_missing_file_is_named(model_dir, name):
    (model_dir / name).unlink()
    with pytest.raises(CheckpointError, match=f"{name} is missing"):
        load_model_dir(model_dir)


def test_truncated_weights(model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_model_dir(model_dir)


def test_garbage_weights(model_dir):
    (model_dir / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_model_dir(model_dir)


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_is_never_unpickled(model_dir, tmp_path):
    marker = tmp_path / "unpickled"
    (model_dir / "model.safetensors").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model_dir(model_dir)
    assert not marker.exists()


def test_weights_that_do_not_match_the_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["d_model"], cfg["n_heads"] = 32, 4
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model.safetensors does not match config.json: shape mismatch "
                                              r"blocks.0.ffn.down.bias: file \(16,\) vs config \(32,\)"):
        load_model_dir(model_dir)


def test_missing_and_unexpected_tensors(model_dir):
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["extra.bias"] = tensors.pop("blocks.1.mixer.W_Q")
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(CheckpointError,
                       match=r"missing tensors \['blocks.1.mixer.W_Q'\]; unexpected tensors \['extra.bias'\]"):
        load_model_dir(model_dir)


def test_config_of_another_variant_is_a_mismatch(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["mixer"] = "mqa"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatch blocks.0.mixer.W_K"):
        load_model_dir(model_dir)


@pytest.mark.parametrize("content,message", [
    ("{broken", "config.json is not valid JSON"),
    ('{"mixer": "nope"}', "config.json: unknown mixer 'nope'"),
    ('{"colour": 1}', "config.json: unknown config field"),
    ("[1, 2]", "config.json must hold a JSON object"),
])
def test_bad_config(model_dir, content, message):
    (model_dir / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_model_dir(model_dir)


def test_bad_card_and_tokenizer(model_dir):
    (model_dir / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(CheckpointError, match="tokenizer.json could not be loaded"):
        load_model_dir(model_dir)
    (model_dir / "card.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match="card.json is not valid JSON"):
        load_model_dir(model_dir)


def test_tokenizer_larger_than_vocabulary(tmp_path, tokenizer):
    save_model_dir(tmp_path / "m", DecoderLM(tiny_config("me", vocab_size=100)), tokenizer)
    with pytest.raises(CheckpointError, match="tokenizer.json has 280 tokens but config.json sets vocab_size=100"):
        load_model_dir(tmp_path / "m")


def test_save_leaves_no_temporary_files_and_hash_is_stable(model_dir):
    assert sorted(p.name for p in model_dir.iterdir()) == ["card.json", "config.json", "model.safetensors",
                                                           "tokenizer.json"]
    assert file_sha256(model_dir / "model.safetensors") == file_sha256(model_dir / "model.safetensors")


def test_bfloat16_storage_loads_the_rounded_weights_in_float32(model_dir, tmp_path, tokenizer):
    model = load_model_dir(model_dir).model
    out = save_model_dir(tmp_path / "bf16", model, tokenizer, {"steps": 0}, weights_dtype="bfloat16")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    loaded = load_model_dir(out)
    assert loaded.card["weights_dtype"] == "bfloat16"
    for (name, a), b in zip(model.state_dict().items(), loaded.model.state_dict().values()):
        assert b.dtype == torch.float32 and torch.equal(b, a.to(torch.bfloat16).float()), name
    assert (out / "model.safetensors").stat().st_size < 0.6 * (model_dir / "model.safetensors").stat().st_size


def test_bfloat16_storage_keeps_the_pruning_rule_exact(tmp_path, tokenizer):
    """The rule's parameters (W^Qint, W^Kint, beta, lambda) stay float32 in a bf16 file: its drop decisions are not
    rounded with the other weights (issue: one precision for drop decisions)."""
    from models.checkpoint import rule_tensors
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=4, prune_distance=True,
                                  vocab_size=tokenizer.get_vocab_size()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    exact = rule_tensors(model)
    assert exact and all(".pruning." in k for k in exact)
    out = save_model_dir(tmp_path / "bf16", model, tokenizer, {}, weights_dtype="bfloat16")
    stored = load_file(str(out / "model.safetensors"))
    assert {k for k, v in stored.items() if v.dtype == torch.float32} == exact
    loaded = load_model_dir(out).model.state_dict()
    for name, a in model.state_dict().items():
        want = a if name in exact else a.to(torch.bfloat16).float()
        assert torch.equal(loaded[name], want), name


def test_shrink_records_the_perplexity_price(model_dir, tmp_path):
    from models.shrink import main, shrink
    from models.data import prepare
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(6):
        (texts / f"{i}.txt").write_text(" ".join(TEXT[:10]) + f" {i}")
    prepare(tmp_path / "data", [], [str(texts)], vocab_size=280, cache=None, min_frequency=1)
    card = shrink(model_dir, tmp_path / "small", data_dir=tmp_path / "data")
    assert card["test_perplexity"] > 0 and card["weights_dtype"] == "bfloat16"
    assert load_model_dir(tmp_path / "small").card["test_perplexity"] == card["test_perplexity"]
    assert main([str(model_dir), str(tmp_path / "small")]) == 2   # never over what is there




def test_loading_reaches_neither_the_converter_nor_the_fetcher():
    """models.files is a leaf; loading (checkpoint, delta) never imports the converter or the fetcher (the floors
    and circles themselves: tests/test_layers.py)."""
    from tests.test_layers import import_graph
    graph = import_graph()
    assert graph["models.files"] == set()
    assert not graph["models.checkpoint"] & {"models.import_hf", "models.fetch", "models.evaluate", "models.shrink"}
    assert not graph["models.delta"] & {"models.checkpoint", "models.import_hf", "models.fetch"}
    assert "analysis.budgets" not in graph["analysis.text"]


@pytest.mark.parametrize("module", ["models.shrink", "models.fetch", "models.checkpoint"])
def test_the_loading_commands_start(module):
    import subprocess
    import sys
    from pathlib import Path
    res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "usage:" in res.stdout, res.stderr
