"""Head circuits (analysis/heads.py) and Extractor lag norms (analysis/lags.py) against naive computations: circuits
formed in full from each variant's parameters, flattened and dotted; a PCA by SVD; Jacobians by autograd."""
import math

import numpy as np
import pytest
import torch

from analysis import heads, lags
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

VARIANTS = {"mha": {}, "sha": {}, "mqa": {}, "skv": {}, "el-att": {}, "gqa": {"n_kv_heads": 2}}


def model_for(mixer: str, seed: int = 0, **overrides) -> DecoderLM:
    model = DecoderLM(tiny_config(mixer, n_layers=3, **{**VARIANTS.get(mixer, {}), **overrides})).double().eval()
    randomize(model, seed=seed)
    return model


def naive_circuits(mixer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each head's QK circuit W_Q^i W_K^iT and OV circuit W_V^i W_O^i [d_m, d_m], read from docs/methods.md."""
    n, d_h, name = mixer.n_heads, mixer.d_head, mixer.name
    d_m = mixer.W_Q.shape[0]
    qk, ov = [], []
    for i in range(n):
        if name in ("mha", "sha"):
            W_K, W_V = mixer.W_K[:, i], mixer.W_V[:, i]
        elif name == "gqa":     # query head i reads key/value head i // (n / n_kv)
            g = i // (n // mixer.kv_heads)
            W_K, W_V = mixer.W_K[:, g], mixer.W_V[:, g]
        elif name == "mqa":
            W_K, W_V = mixer.W_K[:, 0], mixer.W_V[:, 0]
        elif name == "skv":
            W_K = W_V = mixer.W_KV[:, i]
        elif name == "el-att":  # K_i = V_i = X_i: the selection of columns i*d_h..(i+1)*d_h
            W_K = W_V = torch.eye(d_m, dtype=mixer.W_Q.dtype)[:, i * d_h:(i + 1) * d_h]
        else:
            raise ValueError(name)
        qk.append(mixer.W_Q[:, i] @ W_K.T)
        ov.append(W_V @ mixer.W_O[i * d_h:(i + 1) * d_h])
    return qk, ov


def flat_circuits(model) -> dict[str, np.ndarray]:
    """kind -> [layers * heads, d_m * d_m], layer-major."""
    out = {"QK": [], "OV": []}
    for b in model.blocks:
        qk, ov = naive_circuits(b.mixer)
        out["QK"] += [c.detach().flatten().numpy() for c in qk]
        out["OV"] += [c.detach().flatten().numpy() for c in ov]
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("mixer", VARIANTS)
def test_the_naive_circuits_are_what_the_mixer_computes(mixer):
    """Attention output = sum_i softmax(x C_QK^i x^T / sqrt(d_h) + causal) x C_OV^i: the circuits used below are
    the heads themselves (and GQA's group mapping is right)."""
    m = model_for(mixer).blocks[0].mixer
    x = torch.randn(2, 7, m.W_Q.shape[0], dtype=torch.float64)
    qk, ov = naive_circuits(m)
    future = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)
    want = 0
    for c_qk, c_ov in zip(qk, ov):
        scores = (x @ c_qk @ x.transpose(1, 2) / math.sqrt(m.d_head)).masked_fill(future, float("-inf"))
        want = want + torch.softmax(scores, -1) @ x @ c_ov
    with torch.no_grad():
        torch.testing.assert_close(m(x), want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mixer", VARIANTS)
def test_gram_form_equals_inner_products_of_flattened_circuits(mixer):
    model = model_for(mixer, seed=3)
    flat = flat_circuits(model)
    grams = heads.circuit_grams(model, dtype=torch.float64)
    assert set(grams) == {"QK", "OV"}
    factors = [heads.circuit_factors(b.mixer) for b in model.blocks]
    for kind, f in flat.items():
        want = f @ f.T
        np.testing.assert_allclose(grams[kind], want, rtol=1e-10, atol=1e-10)
        # one head per block, and blocks that straddle layers: the blocking and index offsets change nothing
        small = heads.circuit_gram([fs[kind].to(torch.float64) for fs in factors], budget=1, method="gram")
        np.testing.assert_allclose(small, want, rtol=1e-10, atol=1e-10)
        flat_form = heads.circuit_gram([fs[kind].to(torch.float64) for fs in factors], method="flat")
        np.testing.assert_allclose(flat_form, want, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(heads.gram_cosine(grams[kind]), heads.cosine(f), rtol=1e-9, atol=1e-12)
    # float32 (what the app uses) agrees to float32 precision
    g32 = heads.circuit_grams(model)
    np.testing.assert_allclose(g32["QK"], grams["QK"], rtol=1e-4, atol=1e-4 * np.abs(grams["QK"]).max())


def test_no_circuits_for_head_embeddings_or_extractors():
    assert heads.circuit_grams(model_for("mhe-mul")) == {}
    assert heads.circuit_grams(model_for("we")) == {}
    assert set(heads.head_vectors(model_for("mhe-mul"))) == {"e_Q", "e_K", "e_V", "g"}
    assert heads.head_vectors(model_for("mha")) == {}   # flattened projections are no longer offered


def random_orthogonal(d: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rope_commuting_rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    """A rotation by its own angle in each rotary plane (coordinates k, k + d/2 in the half split): it commutes with
    every R_D of rotary positions, so it is a symmetry of a rotary head."""
    a = torch.rand(d // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    r = torch.zeros(d, d, dtype=torch.float64)
    k = torch.arange(d // 2)
    r[k, k], r[k + d // 2, k + d // 2] = a.cos(), a.cos()
    r[k, k + d // 2], r[k + d // 2, k] = -a.sin(), a.sin()
    return r


def rotate_heads(model, rotation) -> None:
    """In every head (GQA: every K/V group with its query heads) W_Q -> W_Q R, W_K -> W_K R, and with another
    rotation S, W_V -> W_V S, W_O^i -> S^T W_O^i: the same heads in another basis."""
    with torch.no_grad():
        for b in model.blocks:
            m = b.mixer
            per_group = m.n_heads // m.W_K.shape[1]
            for g in range(m.W_K.shape[1]):
                r, s = rotation(), rotation()
                m.W_K[:, g] = m.W_K[:, g] @ r
                m.W_V[:, g] = m.W_V[:, g] @ s
                for i in range(g * per_group, (g + 1) * per_group):
                    m.W_Q[:, i] = m.W_Q[:, i] @ r
                    rows = slice(i * m.d_head, (i + 1) * m.d_head)
                    m.W_O[rows] = s.T @ m.W_O[rows]


def flat_query_cosine(model) -> np.ndarray:
    """The old, basis-dependent view: cosine of each head's flattened W_Q^i, all layers."""
    return heads.cosine(np.concatenate([b.mixer.W_Q.detach().permute(1, 0, 2).flatten(1).numpy()
                                        for b in model.blocks]))


@pytest.mark.parametrize("mixer, positions", [("mha", "learned"), ("gqa", "learned"), ("gqa", "rope")])
def test_circuits_do_not_see_a_rotation_inside_a_head_but_flattened_weights_do(mixer, positions):
    model = model_for(mixer, seed=5, positions=positions)
    idx = torch.randint(0, 61, (2, 12))
    d_h = model.blocks[0].mixer.d_head
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        before_logits = model(idx).logits
    before, before_flat = heads.circuit_grams(model, torch.float64), flat_query_cosine(model)
    if positions == "rope":
        rotate_heads(model, lambda: rope_commuting_rotation(d_h, gen))
    else:
        rotate_heads(model, lambda: random_orthogonal(d_h, gen))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, before_logits, rtol=1e-9, atol=1e-9)   # the same model
    after = heads.circuit_grams(model, torch.float64)
    for kind in ("QK", "OV"):
        np.testing.assert_allclose(after[kind], before[kind], rtol=1e-9, atol=1e-9)
        a, b = heads.circuit_table(after[kind], model.blocks[0].mixer.n_heads), heads.circuit_table(before[kind], 4)
        np.testing.assert_allclose(np.abs(a[0][["pc1", "pc2"]]), np.abs(b[0][["pc1", "pc2"]]), atol=1e-7)
    assert np.abs(flat_query_cosine(model) - before_flat).max() > 0.1   # what the old view measured changed


def test_under_rope_a_generic_rotation_changes_the_model_but_not_the_position_free_circuit():
    """What the docstring says: W_Q^i W_K^iT is the D = 0 slice, invariant to more than the model is."""
    model = model_for("mha", seed=2, positions="rope")
    idx = torch.randint(0, 61, (1, 10))
    with torch.no_grad():
        before_logits = model(idx).logits
    before = heads.circuit_grams(model, torch.float64)
    gen = torch.Generator().manual_seed(1)
    rotate_heads(model, lambda: random_orthogonal(model.blocks[0].mixer.d_head, gen))
    with torch.no_grad():
        assert (model(idx).logits - before_logits).abs().max() > 1e-3
    np.testing.assert_allclose(heads.circuit_grams(model, torch.float64)["QK"], before["QK"], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mixer", ["gqa", "el-att"])
def test_kernel_pca_equals_pca_of_the_flattened_circuits(mixer):
    model = model_for(mixer, seed=11)
    grams = heads.circuit_grams(model, torch.float64)
    n_heads = model.blocks[0].mixer.n_heads
    for kind, f in flat_circuits(model).items():
        df, var = heads.circuit_table(grams[kind], n_heads, dims=3)
        c = f - f.mean(0)
        u, s, _ = np.linalg.svd(c, full_matrices=False)
        want = u[:, :3] * s[:3]
        got = df[["pc1", "pc2", "pc3"]].to_numpy()
        for k in range(3):   # each axis up to its sign
            sign = np.sign(got[:, k] @ want[:, k])
            np.testing.assert_allclose(got[:, k] * sign, want[:, k], atol=1e-8 * s[0])
        np.testing.assert_allclose(var, (s**2 / (s**2).sum())[:3], rtol=1e-8)
        np.testing.assert_allclose(df["norm"], np.linalg.norm(f, axis=1), rtol=1e-10)
        unit, _ = heads.circuit_table(grams[kind], n_heads, dims=2, unit=True)   # PCA of the directions
        d = f / np.linalg.norm(f, axis=1, keepdims=True)
        u, s, _ = np.linalg.svd(d - d.mean(0), full_matrices=False)
        np.testing.assert_allclose(np.abs(unit[["pc1", "pc2"]].to_numpy()), np.abs(u[:, :2] * s[:2]), atol=1e-8)
        np.testing.assert_allclose(unit["norm"], df["norm"])
        assert list(df["layer"]) == [i // n_heads for i in range(len(f))]
        assert list(df["head"]) == [i % n_heads for i in range(len(f))]


def test_similarity_figure_and_table_label_layers_and_heads():
    sim = heads.gram_cosine(heads.circuit_grams(model_for("gqa"))["OV"])
    fig = heads.similarity_figure(sim, 4, "all")
    assert list(fig.data[0].x[:5]) == ["L0 H0", "L0 H1", "L0 H2", "L0 H3", "L1 H0"]
    assert list(fig.layout.xaxis.ticktext) == ["L0", "L1", "L2"]
    t = heads.similarity_table(sim[4:8, 4:8], 4, layer=1)
    assert set(t["layer_a"]) == {1} and t.loc[(t.head_a == 2) & (t.head_b == 3), "cosine"].item() == sim[6, 7]


def naive_lag_sum(w_ext: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x_ext_i = sum_{j<=i} x_j W^ext_{i-j+1} (SHE), x_j * w^ext (WE), x_j w^ext (ME), one term at a time."""
    out = []
    for i in range(len(x)):
        terms = []
        for j in range(i + 1):
            w = w_ext[i - j]
            terms.append(x[j] @ w if w.dim() == 2 else x[j] * w)
        out.append(torch.stack(terms).sum(0))
    return torch.stack(out)


@pytest.mark.parametrize("mixer", ["she", "we", "me"])
def test_lag_norms_are_the_norms_of_the_lag_jacobian(mixer):
    model = model_for(mixer, seed=4)
    table = lags.lag_table(model)
    t = 9
    fro = lags.lag_maps(model, t, "fro")
    assert fro.shape == (3, 1, t, t)
    for layer, m in enumerate(lags.extractor_layers(model)):
        w = m.w_ext.detach()
        per_lag = [float(torch.sqrt((w[k] ** 2).sum())) for k in range(len(w))]
        np.testing.assert_allclose(table[table.layer == layer].sort_values("lag")["fro"], per_lag, rtol=1e-6)
        x = torch.randn(t, m.d_model, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(lambda x: naive_lag_sum(w, x), x)   # [t, d, t, d]
        scale = math.sqrt(m.d_model) if mixer == "me" else 1.0   # ME's Jacobian is w I: |w| sqrt(d)
        np.testing.assert_allclose(fro[layer, 0] * scale, jac.pow(2).sum((1, 3)).sqrt().numpy(), rtol=1e-6,
                                   atol=1e-12)


def test_lag_maps_rms_and_mean_equal_their_definitions_and_the_recorded_mixing():
    model = model_for("we", seed=6)
    t = 8
    table = lags.lag_table(model)
    with torch.no_grad():
        records = model(torch.randint(0, 61, (1, t)), diagnostics=True).diagnostics
    for layer, m in enumerate(lags.extractor_layers(model)):
        w = m.w_ext.detach().numpy()
        mean = np.array([[w[i - j].mean() if j <= i else 0 for j in range(t)] for i in range(t)])
        rms = np.array([[np.sqrt((w[i - j] ** 2).mean()) if j <= i else 0 for j in range(t)] for i in range(t)])
        np.testing.assert_allclose(lags.lag_maps(model, t, "mean")[layer, 0], mean, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(lags.lag_maps(model, t, "rms")[layer, 0], rms, rtol=1e-6)
        np.testing.assert_allclose(lags.lag_maps(model, t, "mean")[layer, 0], records[layer].mixing.numpy(),
                                   rtol=1e-6, atol=1e-12)
    fig = lags.mean_rms_figure(table, "we")
    assert {a.text for a in fig.layout.annotations} == {"signed mean", "RMS"}
