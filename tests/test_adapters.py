"""COMPACTER and friends (docs/methods.md) against materialised Kronecker sums and the paper's counts."""
import pytest
import torch

from models.adapters import KINDS, Adapter, PHMLinear, adapter_parameter_formula, freeze_for_adapters, new_A
from models.config import ConfigError, ModelConfig
from models.params import count_parameters
from models.transformer import DecoderLM
from tests.helpers import cached_logits, randomize, tiny_config


@pytest.mark.parametrize("rank", [None, 1, 3])
@pytest.mark.parametrize("k,d,n", [(16, 8, 4), (12, 6, 2), (8, 8, 8)])
def test_phm_forward_equals_the_materialised_kronecker_sum(k, d, n, rank):
    layer = PHMLinear(k, d, n, rank).double()
    randomize(layer, std=0.5)
    x = torch.randn(3, 5, k, dtype=torch.float64)
    factors = layer.B if rank is None else torch.stack([layer.s[i] @ layer.t[i].T for i in range(n)])
    w = sum(torch.kron(layer.A[i], factors[i]) for i in range(n))
    torch.testing.assert_close(layer(x), x @ w + layer.bias)
    torch.testing.assert_close(layer.weight(), w)


def test_phm_needs_n_to_divide():
    with pytest.raises(ValueError, match="divide"):
        PHMLinear(10, 4, 4, 1)


def test_compacter_shares_one_A_tensor():
    model = DecoderLM(tiny_config("mha", adapter="compacter", adapter_reduction=4, phm_n=2))
    rules = {id(a.A_i) for b in model.blocks for a in (b.adapter_mixer, b.adapter_ffn) for a in (a.down, a.up)}
    assert rules == {id(model.adapter_A)}
    names = [n for n, _ in model.named_parameters() if n.endswith("adapter_A") or n.endswith(".A")]
    assert names == ["adapter_A"]
    phm = DecoderLM(tiny_config("mha", adapter="phm", adapter_reduction=4, phm_n=2))
    assert len({id(a.down.A_i) for b in phm.blocks for a in (b.adapter_mixer, b.adapter_ffn)}) == 4  # not shared


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_counts_follow_the_paper(kind):
    L, k, red, n = 3, 32, 4, 4
    d = k // red
    model = DecoderLM(ModelConfig(mixer="mha", vocab_size=50, context=16, d_model=k, n_layers=L, n_heads=4,
                                  adapter=kind, adapter_reduction=red, phm_n=n))
    adapters = {n_: p for n_, p in model.named_parameters() if "adapter" in n_}
    weights = sum(p.numel() for n_, p in adapters.items() if not n_.endswith("bias"))
    assert weights == adapter_parameter_formula(kind, L, k, d, n)
    per_adapter_bias = d + k
    n_adapters = L if kind == "compacter++" else 2 * L
    assert count_parameters(model)["adapters"] == weights + n_adapters * per_adapter_bias


@pytest.mark.parametrize("kind", ["adapter", "phm", "compacter"])
def test_merged_adapter_equals_unmerged(kind):
    shared = new_A(2).double() if kind == "compacter" else None
    a = Adapter(16, 4, kind, n=2, rank=1, shared_A=shared).double().eval()
    randomize(a, std=0.4)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    before = a(x)
    a.merge()
    torch.testing.assert_close(a(x), before)


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_decode_with_adapters(kind):
    model = DecoderLM(tiny_config("mqa", adapter=kind, adapter_reduction=4, phm_n=2)).double().eval()
    randomize(model, std=0.2)
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        full = model(idx).logits
        steps, _ = cached_logits(model, idx)
    torch.testing.assert_close(steps, full, rtol=1e-6, atol=1e-6)


def test_adapters_start_near_the_identity():
    torch.manual_seed(0)
    base = DecoderLM(tiny_config("mha"))
    with_adapters = DecoderLM(tiny_config("mha", adapter="compacter", adapter_reduction=4, phm_n=2))
    with_adapters.load_state_dict(base.state_dict(), strict=False)
    idx = torch.randint(0, 61, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(with_adapters(idx).logits, base(idx).logits, atol=1e-3, rtol=1e-3)


def test_one_step_changes_only_adapters_and_layer_norms():
    model = DecoderLM(tiny_config("mha", adapter="compacter", adapter_reduction=4, phm_n=2, prune=True, prune_r=4))
    names = freeze_for_adapters(model)
    assert any(".pruning." in n for n in names) and "wte.weight" not in names
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.set_alpha(1.0)
    idx = torch.randint(0, 61, (2, 10))
    model(idx, targets=idx).loss.backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(dict(model.named_parameters())[n].grad is None for n in frozen)
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= set(names)
    assert not any(n.startswith(("wte", "wpe")) or ".mixer.W_" in n or ".ffn." in n for n in changed)


def test_adapter_config_errors():
    with pytest.raises(ConfigError, match="adapter must be one of"):
        ModelConfig(adapter="lora")
    with pytest.raises(ConfigError, match="below 1"):
        ModelConfig(d_model=16, n_heads=4, adapter="adapter", adapter_reduction=32)
    with pytest.raises(ConfigError, match="phm_n=3 must divide"):
        ModelConfig(adapter="phm", phm_n=3)


def test_zoo_table_reports_the_trainable_share(tmp_path):
    from analysis.zoo import describe
    from models.checkpoint import save_model_dir
    from models.tokenizer import train_bpe
    tok = train_bpe(["a b c"] * 5, vocab_size=260, min_frequency=1)
    model = DecoderLM(tiny_config("mha", vocab_size=300, adapter="compacter", adapter_reduction=4, phm_n=2))
    row = describe(save_model_dir(tmp_path / "m", model, tok))
    c = count_parameters(model)
    assert row["adapter"] == "compacter"
    assert row["trainable %"] == pytest.approx(100 * (c["adapters"] + c["norms"]) / c["total"])


def test_adapter_table_is_built_from_the_run_cards(tmp_path):
    import json

    from analysis.reports import adapters as adapter_results
    base = tmp_path / "base"
    base.mkdir()
    (base / "card.json").write_text(json.dumps({"test_perplexity": 163.2}))
    runs = []
    for name, kind, trainable, ppl in [("full", None, 1000, 150.0), ("compacter", "compacter", 10, 158.5)]:
        run = tmp_path / name
        run.mkdir()
        (run / "card.json").write_text(json.dumps({
            "config": {"adapter": kind, "prune": True}, "params": 1000, "trainable_params": trainable,
            "test_perplexity": ppl, "final_valid_sparsity": 0.42, "wall_time_s": 90.0, "steps": 200,
            "train": {"lr": 3e-3, "init_from": str(base)}}))
        runs.append(str(run))
    from models.checkpoint import save_model_dir
    from models.tokenizer import train_bpe
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    model = DecoderLM(tiny_config("mha", adapter="compacter", prune=True, prune_r=4, d_model=32, adapter_reduction=8))
    save_model_dir(tmp_path / "weights", model, train_bpe(["a few words"] * 5, vocab_size=270, min_frequency=1))
    parts = adapter_results.parameter_parts(tmp_path / "weights")
    named = dict(model.named_parameters())
    assert parts["adapters"] == sum(p.numel() for n, p in named.items() if "adapter" in n) > 0
    assert parts["pruning"] == sum(p.numel() for n, p in named.items() if ".pruning." in n) > 0
    out = tmp_path / "t.md"
    assert adapter_results.main([*runs, "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert "| dense start" in lines[-3] and "163.20" in lines[-3]
    assert lines[-2].startswith("| full fine-tune | 1,000 | 100.00% | - | 150.00 | 42.0% | 200 |")
    assert lines[-1].startswith("| COMPACTER | 10 | 1.00% | - | 158.50 |")   # no weight file here: no parts
    assert adapter_results.main([str(tmp_path / "missing")]) == 2
