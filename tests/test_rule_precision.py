"""Drop decisions in one precision (kernels.keep_rule.HALF): a bf16 / fp16 model keeps its learned rule's
parameters, the K_int its caches hold and its scores in float32, so every path decides on the same numbers.

What this cannot promise: a bf16 model's hidden states themselves differ between a whole-text forward and a
token-by-token decode (different blockings round to bf16 differently), so the two can still see different x and,
rarely, decide differently; the app therefore analyses in float32 by default, where they agree exactly
(tests/test_compact_cache.py). Here both sides score the states the decode itself saw."""
import pytest
import torch

from models.checkpoint import load_model_dir
from models.pruning.interaction import drop_records
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

MHA_PRUNED = "assets/models/mha-1024-pruned"


def fresh_gqa(seed=3):
    m = DecoderLM(tiny_config("gqa", prune=True, prune_r=6, prune_distance=True, prune_sinks=1, context=96,
                              n_kv_heads=2)).eval()
    randomize(m, std=0.25, seed=seed)
    for b in m.blocks:  # a rule that drops some and keeps some: beta near the spread of the content term
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.5)
            b.mixer.pruning.lam.fill_(0.3)
    return m


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_keeps_its_rule_unrounded(half):
    m = fresh_gqa()
    want = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.to(half)
    for n, p in m.named_parameters():
        if ".pruning." in n:
            assert p.dtype == torch.float32 and torch.equal(p, want[n]), n  # not rounded through bf16 and back
        else:
            assert p.dtype == half, n
    m.double()  # a float64 model keeps a float64 rule (the literal-equation tests run there)
    assert all(p.dtype == torch.float64 for p in m.parameters())


def test_decode_caches_keep_k_int_in_the_rules_precision():
    m = fresh_gqa().to(torch.bfloat16)
    static, compact = m.new_cache(batch=1, capacity=8), m.new_compact_cache(batch=1)
    for layer in (static.layers[0], compact.layers[0]):
        assert layer.buffers["k_int"].dtype == torch.float32 and layer.buffers["k"].dtype == torch.bfloat16
    assert compact.layers[0].rule_constants["qk"].dtype == torch.float32


def decode_with_states(model, ids):
    """Token-by-token compacted decode of ids [1, n]: (drop table per layer, each layer's mixer input [1, n, d])."""
    seen: dict[int, list] = {}
    hooks = [b.mixer.register_forward_pre_hook(lambda mod, args, i=i: seen.setdefault(i, []).append(args[0]))
             for i, b in enumerate(model.blocks)]
    try:
        cache = model.new_compact_cache(batch=1)
        with torch.no_grad():
            for t in range(ids.shape[1]):
                model(ids[:, t:t + 1], cache=cache, positions=torch.tensor([[t]]))
    finally:
        for h in hooks:
            h.remove()
    return [layer.drop_table() for layer in cache.layers], [torch.cat(seen[i], 1) for i in range(len(model.blocks))]


@pytest.mark.parametrize("which", ["mha-1024-pruned", "fresh-gqa"])
def test_bf16_decode_drops_what_the_full_forward_rule_drops_on_the_same_states(which):
    """The fused decode step (Q_int and K_int from one product, the kernel's score) against the full forward's
    log_keep, both on the bf16 states the decode saw. With the decode scoring in bf16 (before the rule kept
    float32) this failed on both models: 2 pairs differed at mha-1024-pruned's layer 1, 8 at the GQA model's
    layer 0 (whose states are the embeddings, the same on both sides)."""
    torch.manual_seed(0)
    if which == "fresh-gqa":
        model, n = fresh_gqa().to(torch.bfloat16), 90
    else:
        model, n = load_model_dir(MHA_PRUNED, dtype=torch.bfloat16).model, 240
    ids = torch.randint(0, model.config.vocab_size, (1, n))
    tables, states = decode_with_states(model, ids)
    total = 0
    for layer, (table, x) in enumerate(zip(tables, states)):
        with torch.no_grad():
            _, keep = model.blocks[layer].mixer.pruning.log_keep(x)
        trigger, _ = drop_records(keep)
        want = {(j, int(trigger[0, j])) for j in range(n) if trigger[0, j] >= 0}
        got = {(int(p), int(k)) for _, p, k in table.tolist()}
        assert got == want, f"layer {layer}: {len(got ^ want)} (position, trigger) pairs differ"
        total += len(want)
    assert total > n // 2  # the rule drops something here: the comparison is not between two empty tables


def test_the_app_analyses_in_float32_unless_told_and_says_so(monkeypatch):
    from app.loading import app_precision, load_for_app
    monkeypatch.delenv("MIXSCOPE_DTYPE", raising=False)
    monkeypatch.setenv("MIXSCOPE_DEVICE", "cpu")
    assert app_precision() == {"device": "cpu", "dtype": "float32"}
    assert load_for_app(MHA_PRUNED).model.wte.weight.dtype == torch.float32
    monkeypatch.setenv("MIXSCOPE_DTYPE", "bfloat16")
    assert app_precision()["dtype"] == "bfloat16"
    loaded = load_for_app(MHA_PRUNED)
    assert loaded.model.wte.weight.dtype == torch.bfloat16
    assert loaded.model.blocks[0].mixer.pruning.W_Qint.dtype == torch.float32


def test_a_sidecar_records_the_precision(monkeypatch):
    import json

    import plotly.graph_objects as go

    from app.common import sidecar_json
    monkeypatch.setenv("MIXSCOPE_DEVICE", "cpu")
    monkeypatch.setenv("MIXSCOPE_DTYPE", "bfloat16")
    meta = json.loads(sidecar_json(go.Figure(go.Scatter(y=[1, 2])), "x", MHA_PRUNED, "text", {}))
    assert meta["precision"] == {"device": "cpu", "dtype": "bfloat16"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_per_token_count_k_int_in_the_rules_precision(dtype):
    """The bytes a held token costs (Generate's 'cache held', the Pruning page, the zoo) are the bytes one slot of
    the compacted cache's buffers takes: a bf16 model's K_int is float32 there, and counted so."""
    from models.generate import layer_bytes_per_token
    from models.pruning.compact_cache import CompactCache
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, prune=True, prune_r=8)).to(dtype)
    own, dense = layer_bytes_per_token(model)
    for b, per, twin in zip(model.blocks, own, dense):
        cache = CompactCache(b.mixer.cache_spec(), 1, 64, dtype, "cpu")
        slot = sum(buf.nbytes for buf in cache.buffers.values()) // cache.capacity
        no_k_int = sum(buf.nbytes for n, buf in cache.buffers.items() if n != "k_int") // cache.capacity
        assert (per, twin) == (slot, no_k_int) and per > twin
    assert model.cache_bytes_per_token() == sum(own)
