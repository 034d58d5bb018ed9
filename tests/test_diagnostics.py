"""Diagnostics on request only: attention probabilities, Extractor mixing matrices."""
import pytest
import torch

from models.transformer import DecoderLM
from tests.helpers import ATTENTION, EXTRACTORS, randomize, tiny_config


def model_for(mixer):
    m = DecoderLM(tiny_config(mixer)).double().eval()
    randomize(m, std=0.2)
    return m


@pytest.mark.parametrize("mixer", ATTENTION + EXTRACTORS)
def test_off_by_default_and_output_unchanged_when_on(mixer):
    model = model_for(mixer)
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        plain, diag = model(idx), model(idx, diagnostics=True)
    assert plain.diagnostics is None
    assert len(diag.diagnostics) == model.config.n_layers
    torch.testing.assert_close(plain.logits, diag.logits, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", ATTENTION)
def test_attention_probabilities_are_causal_distributions(mixer):
    model = model_for(mixer)
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        layers = model(idx, diagnostics=True).diagnostics
    heads = model.blocks[0].mixer.n_heads
    for rec in layers:
        p = rec.attn
        assert p.shape == (2, heads, 12, 12)
        torch.testing.assert_close(p.sum(-1), torch.ones(2, heads, 12, dtype=p.dtype))
        assert torch.count_nonzero(torch.triu(p, diagonal=1)) == 0
        assert (torch.tril(p) > 0).sum() == 2 * heads * 12 * 13 // 2


@pytest.mark.parametrize("mixer", ATTENTION)
def test_incremental_probabilities_are_rows_of_the_full_map(mixer):
    model = model_for(mixer)
    idx = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        full = model(idx, diagnostics=True).diagnostics[1].attn
        cache = model.new_cache()
        model(idx[:, :7], cache=cache)
        step = model(idx[:, 7:], cache=cache, diagnostics=True).diagnostics[1].attn
    torch.testing.assert_close(step, full[:, :, 7:, :])


@pytest.mark.parametrize("mixer", EXTRACTORS)
def test_extractor_mixing_matrix_is_the_lag_toeplitz(mixer):
    model = model_for(mixer)
    with torch.no_grad():
        m = model(torch.randint(0, 61, (1, 9)), diagnostics=True).diagnostics[0].mixing
    mod = model.blocks[0].mixer
    w = mod.w_ext.reshape(mod.w_ext.shape[0], -1).mean(1)
    assert m.shape == (9, 9)
    for i in range(9):
        for j in range(9):
            assert m[i, j] == (w[i - j] if j <= i else 0)
    rms = mod.lag_profile()["rms"]
    torch.testing.assert_close(rms, mod.w_ext.reshape(mod.w_ext.shape[0], -1).pow(2).mean(1).sqrt())


def test_overview_pools_long_maps_and_keeps_short_ones():
    import warnings

    import numpy as np

    from analysis.maps import overview_figure, pooled
    m = np.tril(np.random.default_rng(0).random((130, 130)))
    m[np.triu_indices(130, 1)] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-future block must not warn
        p = pooled(m, 64)
    assert p.shape == (44, 44)
    assert np.isclose(p[0, 0], np.nanmean(m[:3, :3])) and np.isnan(p[0, 1])
    assert pooled(m[:40, :40], 64) is not None and pooled(m[:40, :40], 64).shape == (40, 40)
    fig = overview_figure(np.zeros((2, 3, 130, 130)), "attention")
    assert len(fig.data) == 6 and np.array(fig.data[0].z).shape == (44, 44)
