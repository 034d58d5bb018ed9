"""The head-embedding identities of docs/methods.md#head-embeddings, checked numerically."""
import torch

from models.config import ModelConfig
from models.mixers import build_mixer
from tests import naive
from tests.helpers import randomize

CFG = dict(vocab_size=50, context=16, d_model=24, n_layers=1, n_heads=6)


def mixer(name, seed=0):
    m = build_mixer(ModelConfig(mixer=name, **CFG)).double()
    randomize(m, seed=seed)
    return m


def test_mhe_mul_is_multi_query_attention_with_per_head_diagonal_scaling():
    mhe = mixer("mhe-mul")
    mqa = mixer("mqa", seed=1)
    n, d_h = mhe.n_heads, mhe.d_head
    g = (1 + mhe.e_Q) * (1 + mhe.e_K)                   # [n, d_h] query scaling
    s = 1 + mhe.e_V                                     # [n, d_h] output scaling
    with torch.no_grad():
        mqa.W_Q.copy_(mhe.W_Q[:, 0, None, :] * g)       # W_i^Q = W^Q diag(g_i)
        mqa.W_K.copy_(mhe.W_K)
        mqa.W_V.copy_(mhe.W_V)
        mqa.W_O.copy_(mhe.W_O * s.reshape(n * d_h, 1))  # diag(1 + e_i^V) folded into W_O
    x = torch.randn(2, 10, CFG["d_model"], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mqa(x), mhe(x), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(naive.attention(mhe, x), mhe(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mhe.query_scale(), g)


def test_mhe_add_output_ignores_e_k():
    m = mixer("mhe-add")
    x = torch.randn(2, 9, CFG["d_model"], dtype=torch.float64)
    with torch.no_grad():
        before_naive, before = naive.attention(m, x), m(x)
        m.e_K.add_(torch.randn_like(m.e_K) * 3.0)
        after_naive, after = naive.attention(m, x), m(x)
    torch.testing.assert_close(after_naive, before_naive, rtol=1e-10, atol=1e-10)  # the identity itself
    torch.testing.assert_close(after, before_naive, rtol=1e-10, atol=1e-10)        # and our fast form
    assert torch.equal(before, after)


def test_mhe_add_gradient_of_e_k_vanishes_in_the_literal_definition():
    m = mixer("mhe-add")
    x = torch.randn(2, 9, CFG["d_model"], dtype=torch.float64)
    naive.attention(m, x).pow(2).sum().backward()
    assert m.e_K.grad.abs().max() < 1e-10
    assert m.e_Q.grad.abs().max() > 1e-3


def test_mhe_caches_a_single_key_value_head():
    for name in ("mhe-add", "mhe-mul", "mqa"):
        m = mixer(name)
        assert m.cache_spec() == {"k": (1, m.d_head), "v": (1, m.d_head)}
    assert mixer("mha").cache_spec()["k"] == (CFG["n_heads"], CFG["d_model"] // CFG["n_heads"])
    assert set(mixer("skv").cache_spec()) == {"k"}


def test_pca_through_the_gram_matrix_equals_the_svd():
    import numpy as np
    from analysis.heads import pca
    x = np.random.default_rng(0).normal(size=(27, 400)) * np.linspace(3, 0.1, 400)
    coords, var = pca(x, 3)
    c = x - x.mean(0)
    u, s, _ = np.linalg.svd(c, full_matrices=False)
    want = u[:, :3] * s[:3]
    assert np.allclose(np.abs(coords), np.abs(want), atol=1e-8)   # each axis up to its sign
    assert np.allclose(var, (s**2 / (s**2).sum())[:3])
