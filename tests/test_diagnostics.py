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
    maps = np.random.default_rng(1).random((2, 3, 130, 130))
    fig = overview_figure(maps, "attention")
    z = np.array(fig.data[0].z, dtype=float)
    assert len(fig.data) == 1 and z.shape == (2 * 45 - 1, 3 * 45 - 1)   # 44 x 44 tiles, one blank line apart
    for i, j in ((0, 0), (1, 2)):
        tile = z[i * 45:i * 45 + 44, j * 45:j * 45 + 44]
        assert np.allclose(tile, pooled(np.where(np.tri(130, dtype=bool), maps[i, j], np.nan), 64), equal_nan=True)
    assert np.isnan(z[44]).all() and np.isnan(z[:, 44]).all()
    assert fig.data[0].y[45] == "layer 1, queries 0-2" and fig.data[0].x[-1] == "head 2, keys 129-129"
    assert list(fig.layout.yaxis.ticktext) == ["L0", "L1"]


def test_the_overview_of_a_30_layer_model_stays_one_light_image():
    import numpy as np

    from analysis.maps import OVERVIEW_CELLS, overview_figure
    one = np.tril(np.ones((1024, 1024), dtype=np.float32)) / np.arange(1, 1025, dtype=np.float32)[:, None]
    maps = np.broadcast_to(one, (30, 9, 1024, 1024))   # read only: 4 MB, not 1 GB
    fig = overview_figure(maps, "attention")
    z = np.array(fig.data[0].z, dtype=float)
    assert len(fig.data) == 1 and np.isfinite(z).sum() <= OVERVIEW_CELLS
    assert len(set(fig.data[0].y)) == len(fig.data[0].y) == z.shape[0]   # every row its own category
    assert len(fig.layout.yaxis.ticktext) == 30 and fig.layout.yaxis.ticktext[-1] == "L29"
    assert len(fig.to_json()) < 2_000_000   # what the browser gets: 270 panels came to 8 MB
