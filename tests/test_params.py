"""Parameter counts: the papers' table and identities, and the per-component split."""
import pytest

from models.params import count_parameters
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, tiny_config

N, D_H = 8, 6
D_M = N * D_H
L = 20  # context = number of Extractor lags


def mixer_params(mixer, **cfg):
    return count_parameters(DecoderLM(tiny_config(mixer, d_model=D_M, n_heads=N, context=L, n_layers=1,
                                                  **cfg)))["mixer"]


def test_table_of_attention_parameters():
    expected = {
        "mha": 3 * N * D_M * D_H,
        "sha": 3 * D_M * D_H,
        "mqa": (N + 2) * D_M * D_H,
        "skv": 2 * N * D_M * D_H,
        "el-att": N * D_M * D_H,
        "mhe-add": 3 * D_M * D_H + 3 * N * D_H,
        "mhe-mul": 3 * D_M * D_H + 3 * N * D_H,
    }
    assert {m: mixer_params(m) for m in expected} == expected


def test_papers_identities():
    mha, sha, mhe = mixer_params("mha"), mixer_params("sha"), mixer_params("mhe-mul")
    assert mhe - sha == 3 * N * D_H
    assert mha - sha == (3 * N**2 - 3 * N) * D_H**2
    assert mha - mhe == (3 * N**2 - 3 * N) * D_H**2 - 3 * N * D_H
    assert 3 * mixer_params("skv") == 2 * mha
    assert 3 * mixer_params("el-att") == mha


def test_extractor_parameters():
    d = D_M
    assert mixer_params("she") == L * d * d + d * d          # W^ext_1..l + W^adj
    assert mixer_params("he") == d * d + L * d + d * d       # W^in_ext + w^ext + W^adj
    assert mixer_params("we") == L * d + d * d
    assert mixer_params("me") == L


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_components_add_up_and_output_projection_is_apart(mixer):
    cfg = tiny_config(mixer, d_model=D_M, n_heads=N, context=L, n_layers=3)
    model = DecoderLM(cfg)
    counts = count_parameters(model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embeddings"] == (cfg.vocab_size + cfg.context) * D_M   # head is tied: no extra matrix
    assert counts["feed_forward"] == 3 * (2 * D_M * cfg.d_ff + cfg.d_ff + D_M)
    assert counts["norms"] == (2 * 3 + 1) * 2 * D_M
    out = {"sha": D_H * D_M, "me": 0}.get(mixer, D_M * D_M)
    assert counts["mixer_out"] == 3 * out


def test_extractor_output_projection_is_optional():
    assert count_parameters(DecoderLM(tiny_config("we", extractor_out=False)))["mixer_out"] == 0


def test_trainable_only_counts_what_trains():
    model = DecoderLM(tiny_config("mha"))
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    counts = count_parameters(model, trainable_only=True)
    assert counts["mixer"] == counts["feed_forward"] == 0
    assert counts["total"] == counts["embeddings"] + 2 * 16  # embeddings + final LayerNorm
