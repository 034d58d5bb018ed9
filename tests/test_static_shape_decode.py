"""Static-shape decode (models.fixed_shape.FixedDecodeCache.fix_shapes, models.backends.fixed.attend_static):
every step writes at a device-side cursor and attends over the whole preallocated buffers, so a CUDA graph can
replay it.
On the CPU the path itself is checked: it equals today's decode and the full forward, for every attention
variant and the learned step rule, on fresh random weights; the pool of captured entries hands out emptied
caches. The capture and replay are checked on a GPU (tests/test_gpu.py)."""
import pytest
import torch

import kernels
from models import graphs
from models.decode import Decoder
from tests.helpers import ATTENTION, EXTRACTORS, randomize, tiny_config
from models.transformer import DecoderLM

CONFIGS = [dict(mixer=m) for m in ATTENTION] + [
    dict(mixer="mha", positions="rope"), dict(mixer="gqa", n_kv_heads=2, positions="rope", attn_bias=True),
    dict(mixer="mha", prune=True, prune_beta=0.3), dict(mixer="mhe-mul", prune=True, prune_beta=0.3)]


def model_for(overrides: dict, seed: int) -> DecoderLM:
    model = DecoderLM(tiny_config(**overrides)).double().eval()
    randomize(model, std=0.3, seed=seed)
    return model


def decode(model, idx, n_prompt: int, fixed: bool):
    dec = Decoder(model, idx.shape[0], "static", fixed=fixed)
    with torch.inference_mode():
        out = [dec.prefill(idx[:, :n_prompt].tolist(), last_only=False)]
        out += [dec.step(idx[:, i])[:, None] for i in range(n_prompt, idx.shape[1])]
    return torch.cat(out, 1), dec


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
@pytest.mark.parametrize("n_prompt", [1, 7])
def test_static_shapes_equal_todays_decode_and_the_full_forward(overrides, n_prompt):
    seed = int(torch.randint(0, 10_000, ()))
    model = model_for(overrides, seed)
    idx = torch.randint(0, 61, (3, 20))
    got, fixed = decode(model, idx, n_prompt, fixed=True)
    want, plain = decode(model, idx, n_prompt, fixed=False)
    with torch.inference_mode():
        full = model(idx).logits
    assert torch.allclose(got, want, atol=1e-10, rtol=0), f"seed {seed}"
    assert torch.allclose(got, full, atol=1e-10, rtol=0), f"seed {seed}"
    assert fixed.state.length == plain.state.length == 20 and int(fixed.state.cursor) == 20
    assert fixed.live(1) == plain.live(1)
    if overrides.get("prune"):  # the step rule really dropped something, and both caches remember the same
        assert min(fixed.live(0)) < 20
        for a, b in zip(fixed.state.layers, plain.state.layers):
            assert torch.equal(a.alive[:, :20], b.alive[:, :20])


def test_a_step_reads_nothing_past_the_cursor():
    """What sits in the buffers after the cursor (a reused cache's old tokens) changes nothing."""
    model = model_for(dict(mixer="mha"), seed=3)
    idx = torch.randint(0, 61, (2, 12))
    want, _ = decode(model, idx, 4, fixed=True)
    dec = Decoder(model, 2, "static", fixed=True)
    for layer in dec.state.layers:
        for buf in layer.buffers.values():
            buf.normal_(0, 50.0)
    with torch.inference_mode():
        got = [dec.prefill(idx[:, :4].tolist(), last_only=False)] + [dec.step(idx[:, i])[:, None] for i in range(4, 12)]
    assert torch.allclose(torch.cat(got, 1), want, atol=1e-10, rtol=0)


def test_lengths_equal_a_bias_on_the_reference_and_the_decode_kernel(monkeypatch):
    """kernels.attention's `lengths` (row b reads slots [0, lengths[b])) against the same mask as a bias."""
    b, h, g, s, d = 3, 4, 2, 40, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    lengths = torch.tensor([1, 17, 40])
    bias = torch.zeros(b, 1, 1, s).masked_fill(torch.arange(s) >= lengths[:, None, None, None], float("-inf"))
    want = kernels.reference.attention(q, k, v, scale=0.25, bias=bias, causal=False)[0]
    for path in ("reference", "triton"):
        monkeypatch.setenv("MIXSCOPE_KERNELS", path)
        got, _ = kernels.attention(q, k, v, scale=0.25, causal=False, lengths=lengths)
        assert torch.allclose(got, want, atol=2e-5), path


@pytest.mark.parametrize("overrides", [dict(mixer="mha", pattern="local", pattern_k=4)] +
                         [dict(mixer=m) for m in EXTRACTORS])
def test_mixers_that_place_by_host_length_are_refused(overrides):
    model = DecoderLM(tiny_config(**overrides)).eval()
    assert graphs.refusal(model, "static")
    with pytest.raises(ValueError, match="static-shape decode"):
        Decoder(model, 1, "static", fixed=True)
    assert graphs.refusal(model_for(dict(mixer="mha"), 0), "compacted") is None


def test_graphs_are_refused_off_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        Decoder(model_for(dict(mixer="mha"), 0), 1, "static", graphs=True)


def test_capacity_buckets():
    assert graphs.capacity_bucket(10, 2048) == 256
    assert graphs.capacity_bucket(257, 2048) == 512
    assert graphs.capacity_bucket(300, 400) == 400
    assert graphs.capacity_bucket(3000, 2048) == 2048  # never past the context (new_cache stops there too)


def test_the_pool_hands_out_emptied_entries():
    model = model_for(dict(mixer="mha", prune=True, prune_beta=0.3), seed=1)
    entry = graphs.checkout(model, 2, 24)
    entry.state.layers[0].length = 5
    entry.state.fix_shapes()
    entry.state.layers[0].alive[:, 2] = False
    graphs.give_back(model, entry)
    again = graphs.checkout(model, 2, 24)
    assert again is entry
    assert again.state.length == 0 and int(again.state.cursor) == 0 and bool(again.state.layers[0].alive.all())
    assert graphs.checkout(model, 2, 24) is not entry      # checked out: a second decoder gets its own
    assert graphs.checkout(model, 1, 24) is not entry      # another batch, another entry
    graphs.release(model)


def test_a_full_static_shape_cache_refuses_the_next_step():
    model = model_for(dict(mixer="mha"), seed=2)
    dec = Decoder(model, 1, "static", capacity=6, fixed=True)
    with torch.inference_mode():
        dec.prefill([[1, 2, 3, 4, 5]])
        dec.step(torch.tensor([6]))
        with pytest.raises(ValueError, match="cache full"):
            dec.step(torch.tensor([7]))
    assert dec.state.length == 6


def test_a_pooled_cache_made_in_inference_mode_is_reset_outside_it():
    """The app decodes under inference mode and hands the entry back; the next checkout may come from anywhere."""
    model = model_for(dict(mixer="mha", prune=True, prune_beta=0.3), seed=4)
    entry = graphs.checkout(model, 1, 24)
    with torch.inference_mode():
        entry.state.layers[0].length = 3
        entry.state.fix_shapes()
    graphs.give_back(model, entry)
    again = graphs.checkout(model, 1, 24)   # reset() outside inference mode
    assert again is entry and int(again.state.cursor) == 0
    graphs.release(model)
