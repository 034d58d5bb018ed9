"""Incremental decoding equals the full forward; future tokens never change past outputs."""
import pytest
import torch

from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, cached_logits, randomize, tiny_config


def model_for(mixer, dtype=torch.float64, **cfg):
    m = DecoderLM(tiny_config(mixer, **cfg)).to(dtype).eval()
    randomize(m, std=0.2)
    return m


@pytest.mark.parametrize("chunks", [[1] * 13, [5, 1, 4, 3], [13]], ids=["per-token", "chunked", "one-shot"])
@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_incremental_equals_full_forward(mixer, chunks):
    model = model_for(mixer)
    idx = torch.randint(0, model.config.vocab_size, (3, sum(chunks)))
    with torch.no_grad():
        full = model(idx).logits
        steps, cache = cached_logits(model, idx, chunks)
    assert cache.length == idx.shape[1]
    torch.testing.assert_close(steps, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_incremental_float32(mixer):
    model = model_for(mixer, dtype=torch.float32)
    idx = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        full = model(idx).logits
        steps, _ = cached_logits(model, idx)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_future_tokens_never_change_the_past(mixer):
    model = model_for(mixer)
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    other = idx.clone()
    other[:, 9:] = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        a, b = model(idx).logits, model(other).logits
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 9:], b[:, 9:])  # the perturbation did reach the later outputs


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_gradient_of_past_output_wrt_future_input_is_exactly_zero(mixer):
    model = model_for(mixer)
    mixer_mod = model.blocks[0].mixer
    x = torch.randn(2, 11, model.config.d_model, dtype=torch.float64, requires_grad=True)
    y = mixer_mod(x)
    (g,) = torch.autograd.grad(y[:, :6].sum(), x)
    assert torch.count_nonzero(g[:, 6:]) == 0
    assert torch.count_nonzero(g[:, :6]) > 0


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_cache_overflow_and_context_are_refused(mixer):
    model = model_for(mixer)
    cache = model.new_cache(batch=1, capacity=4)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="cache full"):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="context window"):
            model(torch.zeros(1, model.config.context + 1, dtype=torch.long))
