"""Packed projections of a fixed-shape decode step (models.packing): q|k|v as one product, gate|up as one, and
the residual sum left to the next block's norm. Checked against the separate products and the full forward on
fresh random weights, for every attention variant, SwiGLU with and without biases, adapters and the learned rule
over both caches; the copies keep their addresses (a captured graph holds them) and follow weights changed
between decoders."""
import pytest
import torch

from models import packing
from models.decode import Decoder
from models.mixers.attention import split_heads
from models.transformer import DecoderLM
from tests.helpers import ATTENTION, randomize, tiny_config

SWIGLU = dict(norm="rmsnorm", positions="rope", ffn="swiglu")


def model_for(seed: int, **overrides) -> DecoderLM:
    model = DecoderLM(tiny_config(**overrides)).double().eval()
    randomize(model, std=0.3, seed=seed)
    return model


@pytest.mark.parametrize("overrides", [dict(mixer=m) for m in ATTENTION]
                         + [dict(mixer="gqa", n_kv_heads=2, attn_bias=True, ffn="swiglu", ffn_bias=True)],
                         ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_packed_products_equal_the_separate_ones(overrides):
    seed = int(torch.randint(0, 10_000, ()))
    model = model_for(seed, **overrides)
    state = model.new_cache(batch=3, capacity=8)
    packing.attach(model, state)
    x = torch.randn(3, 1, model.config.d_model, dtype=torch.float64)
    for block, layer in zip(model.blocks, state.layers):
        src = block.mixer.projections()
        if src is None or len(src) < 2:  # EL-ATT: W_Q alone, nothing to pack
            assert "qkv" not in layer.packed
        else:
            got = packing.project(x, *layer.packed["qkv"])
            want = [split_heads(x, w, b) for w, b in src]
            assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, want)), f"seed {seed}"
        if block.ffn.gate is None:
            assert "gate_up" not in layer.packed
        else:
            g, u = packing.gate_up(x, *layer.packed["gate_up"])
            assert torch.allclose(g, block.ffn.gate(x), atol=1e-12) and torch.allclose(u, block.ffn.up(x), atol=1e-12)


def greedy_logits(model, idx, n_prompt, state="static", fixed=True):
    dec = Decoder(model, idx.shape[0], state, fixed=fixed)
    with torch.inference_mode():
        out = [dec.prefill(idx[:, :n_prompt].tolist(), last_only=False)]
        out += [dec.step(idx[:, i])[:, None] for i in range(n_prompt, idx.shape[1])]
    return torch.cat(out, 1), dec


@pytest.mark.parametrize("overrides", [
    dict(mixer="gqa", n_kv_heads=2, **SWIGLU),
    dict(mixer="mha", **SWIGLU, ffn_bias=True, attn_bias=True, adapter="compacter",
         adapter_reduction=4, phm_n=2),
    dict(mixer="mqa", **SWIGLU, adapter="adapter", adapter_reduction=4),
    dict(mixer="skv", ffn="swiglu"),
    dict(mixer="gqa", n_kv_heads=2, **SWIGLU, prune=True, prune_beta=0.3, state="compacted"),
    dict(mixer="mhe-add", ffn="swiglu", prune=True, prune_beta=0.3, adapter="compacter++", adapter_reduction=4,
         phm_n=2, state="compacted"),
], ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_fixed_steps_with_packed_products_equal_the_full_forward(overrides, monkeypatch):
    overrides = dict(overrides)
    state = overrides.pop("state", "static")
    seed = int(torch.randint(0, 10_000, ()))
    model = model_for(seed, **overrides)
    idx = torch.randint(0, 61, (2, 18))
    calls = {"project": 0, "gate_up": 0}
    for name in calls:
        real = getattr(packing, name)
        monkeypatch.setattr(packing, name, lambda *a, real=real, name=name: calls.__setitem__(name, calls[name] + 1)
                            or real(*a))
    got, dec = greedy_logits(model, idx, 5, state)
    assert all(layer.packed for layer in dec.state.layers)
    steps = (idx.shape[1] - 5) * model.config.n_layers
    assert calls == {"project": steps, "gate_up": steps}  # every layer of every step took both packed products
    with torch.inference_mode():
        full = model(idx).logits
    assert torch.allclose(got, full, atol=1e-10, rtol=0), f"seed {seed}"


def test_the_copies_keep_their_addresses_and_follow_changed_weights():
    """A decoder's start refills the same tensors (a captured graph reads them there) from the weights as they
    are then: a model trained between two generations decodes with its new weights."""
    model = model_for(4, mixer="gqa", n_kv_heads=2, **SWIGLU)
    idx = torch.randint(0, 61, (1, 12))
    _, first = greedy_logits(model, idx, 4)
    where = [(p["qkv"][0].data_ptr(), p["gate_up"][0].data_ptr()) for p in (lay.packed for lay in first.state.layers)]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)
    got, second = greedy_logits(model, idx, 4)
    assert [(p["qkv"][0].data_ptr(), p["gate_up"][0].data_ptr())
            for p in (lay.packed for lay in second.state.layers)] == where
    with torch.inference_mode():
        assert torch.allclose(got, model(idx).logits, atol=1e-10, rtol=0)
    assert not any("packed" in name for name in model.state_dict())  # nothing was put on the model


def test_only_one_token_steps_at_inference_take_the_packed_products():
    model = model_for(5, mixer="mha", **SWIGLU)
    state = model.new_cache(batch=1, capacity=8)
    layer = state.layers[0]
    assert packing.step_weights(layer, torch.zeros(1, 1, 16), None) == {}  # not attached: a plain decoder
    packing.attach(model, state)
    one, two = torch.zeros(1, 1, 16), torch.zeros(1, 2, 16)
    with torch.no_grad():
        assert set(packing.step_weights(layer, one, None)) == {"qkv", "gate_up"}
        assert packing.step_weights(layer, two, None) == {}           # a prompt: the separate products
        assert packing.step_weights(layer, one, object()) == {}       # diagnostics
    assert packing.step_weights(layer, one, None) == {}               # gradients on: the copies carry none
    assert packing.step_weights(None, one, None) == {}                # no cache: the full forward
    assert Decoder(model, 1, "static").state.layers[0].packed is None  # only fixed-shape decoders pack


def test_a_pooled_state_keeps_its_copies_addresses():
    """A state that holds copies (a pooled graph entry, whose captured graph reads them) gets them refilled in
    place, whatever the model's kept set became meanwhile (released, or another state attached first)."""
    from models import graphs
    model = model_for(6, mixer="gqa", n_kv_heads=2, **SWIGLU)
    entry = graphs.checkout(model, batch=1, capacity=8)
    packing.attach(model, entry.state)
    where = [p["qkv"][0].data_ptr() for p in (lay.packed for lay in entry.state.layers)]
    packing.release(model)
    other = model.new_cache(batch=1, capacity=8)
    packing.attach(model, other)
    with torch.no_grad():
        model.blocks[0].mixer.W_K.mul_(2.0)
    packing.attach(model, entry.state)
    assert [p["qkv"][0].data_ptr() for p in (lay.packed for lay in entry.state.layers)] == where
    w = model.blocks[0].mixer.W_K
    packed = entry.state.layers[0].packed["qkv"][0]
    assert torch.equal(packed[:, model.blocks[0].mixer.W_Q[0].numel():][:, :w[0].numel()], w.flatten(1))
    graphs.release(model)


def test_a_pooled_entry_follows_the_rule_trained_since_it_was_captured():
    """A pooled compacted entry holds the learned rule's constants from when it was made. After a training step
    (a fused AdamW step, which does not move the tensors' versions) the checkout refills [W^Qint | W^Kint] in
    place, where the captured graph reads it, and retires an entry whose beta moved (a number the captured
    kernels hold)."""
    from models import graphs
    model = model_for(7, mixer="mha", prune=True, prune_beta=0.3).float()
    first = graphs.checkout(model, batch=1, capacity=8, kind="compacted")
    held = first.state.layers[0].rule_constants
    where = held["qk"].data_ptr()
    graphs.give_back(model, first)
    rule = [p for name, p in model.named_parameters() if ".pruning.W_" in name]
    opt = torch.optim.AdamW(rule, lr=0.1, fused=True)
    sum((p * p).sum() for p in rule).backward()
    opt.step()
    again = graphs.checkout(model, batch=1, capacity=8, kind="compacted")
    assert again is first and held["qk"].data_ptr() == where
    for block, layer in zip(model.blocks, again.state.layers):
        assert torch.equal(layer.rule_constants["qk"], block.mixer.pruning.decode_constants()["qk"])
    graphs.give_back(model, again)
    with torch.no_grad():
        model.blocks[1].mixer.pruning.beta.add_(0.5)
    assert graphs.checkout(model, batch=1, capacity=8, kind="compacted") is not first
    graphs.release(model)


def test_a_state_whose_copies_no_longer_fit_is_refused():
    """A state's own copies are never replaced (a captured graph holds their addresses): when the model's
    projections no longer fit them, attaching it again is refused."""
    model = model_for(10, mixer="mha", **SWIGLU)
    state = model.new_cache(batch=1, capacity=8)
    packing.attach(model, state)
    model.blocks[0].ffn.gate = None  # (SwiGLU's gate gone: nothing to pack there)
    with pytest.raises(ValueError, match="no longer fit"):
        packing.attach(model, state)


def test_a_variant_with_a_projection_of_its_own_is_not_packed():
    from models.mixers.attention import MHA

    class Scaled(MHA):
        def project(self, x):
            q, k, v = super().project(x)
            return 2 * q, k, v

    model = model_for(8, mixer="mha", **SWIGLU)
    for block in model.blocks:
        block.mixer.__class__ = Scaled
    state = model.new_cache(batch=1, capacity=8)
    packing.attach(model, state)
    assert all("qkv" not in layer.packed and "gate_up" in layer.packed for layer in state.layers)


def test_the_size_is_what_the_copies_take():
    model = model_for(9, mixer="gqa", n_kv_heads=2, attn_bias=True, ffn="swiglu", ffn_bias=True)
    state = model.new_cache(batch=1, capacity=8)
    packing.attach(model, state)
    held = sum(t.numel() * t.element_size() for layer in state.layers for w, b, _ in layer.packed.values()
               for t in (w, b) if t is not None)
    assert packing.size(model) == held > 0
