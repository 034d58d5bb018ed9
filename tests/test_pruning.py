"""Context pruning (docs/methods.md#adaptively-sparse-attention) against brute force and literal loops."""
import math

import pytest
import torch

from models.config import ConfigError, ModelConfig
from models.mixers import build_mixer
from kernels.alpha_sigmoid import alpha_schedule, alpha_sigmoid
from models.pruning import sparsity
from models.transformer import DecoderLM
from tests.helpers import ATTENTION, cached_logits, randomize, tiny_config


def brute_force(x: float, alpha: float) -> float:
    """argmax over a fine grid of p of p x + H_alpha(p) (papers' Eq. 8-9)."""
    p = torch.linspace(0, 1, 200_001, dtype=torch.float64)
    if alpha == 1:
        h = -(p * p.clamp_min(1e-300).log() + (1 - p) * (1 - p).clamp_min(1e-300).log())
    else:
        h = (p - p**alpha + (1 - p) - (1 - p) ** alpha) / (alpha * (alpha - 1))
    return float(p[torch.argmax(p * x + h)])


@pytest.mark.parametrize("alpha", [1.0, 1.25, 1.5, 2.0, 3.0, 8.0])
def test_alpha_sigmoid_is_the_argmax(alpha):
    xs = torch.tensor([-3.0, -1.0, -0.4, -0.1, 0.0, 0.05, 0.3, 0.9, 2.5], dtype=torch.float64)
    got = alpha_sigmoid(xs, alpha)
    want = torch.tensor([brute_force(float(x), alpha) for x in xs], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("alpha", [1.5, 2.0, 4.0, 8.0])
def test_alpha_sigmoid_saturates_and_is_symmetric(alpha):
    lim = 1 / (alpha - 1)
    x = torch.linspace(-2 * lim, 2 * lim, 401, dtype=torch.float64)
    p = alpha_sigmoid(x, alpha)
    assert torch.all(p[x >= lim] == 1) and torch.all(p[x <= -lim] == 0)
    torch.testing.assert_close(alpha_sigmoid(-x, alpha), 1 - p, atol=1e-12, rtol=0)
    assert torch.all(p.diff() >= 0)
    if alpha == 2.0:
        torch.testing.assert_close(p, ((x + 1) / 2).clamp(0, 1))


def test_alpha_sigmoid_limits():
    x = torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(alpha_sigmoid(x, 1.0), torch.sigmoid(x))
    assert torch.equal(alpha_sigmoid(x, math.inf), (x > 0).double())
    torch.testing.assert_close(alpha_sigmoid(x, 1.0 + 1e-6), torch.sigmoid(x), atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        alpha_sigmoid(x, 0.5)


@pytest.mark.parametrize("alpha", [1.3, 1.5, 3.0])
def test_alpha_sigmoid_gradient(alpha):
    x = (torch.rand(20, dtype=torch.float64) - 0.5) * 1.6 / (alpha - 1)  # inside the unsaturated range
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: alpha_sigmoid(z, alpha), (x,), eps=1e-6, atol=1e-5)
    far = torch.tensor([5.0, -5.0], dtype=torch.float64, requires_grad=True)
    alpha_sigmoid(far, 3.0).sum().backward()
    assert torch.equal(far.grad, torch.zeros(2, dtype=torch.float64))


def test_alpha_schedule():
    assert alpha_schedule(0, 100) == pytest.approx(1.0) and alpha_schedule(100, 100) == pytest.approx(8.0)
    assert alpha_schedule(500, 100) == pytest.approx(8.0)
    assert alpha_schedule(50, 100) == pytest.approx(4.5)
    vals = [alpha_schedule(s, 100) for s in range(101)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))


def pruned_mixer(name="mha", beta=0.3, seed=0, **cfg):
    m = build_mixer(tiny_config(name, prune=True, prune_r=8, **cfg)).double()
    randomize(m, seed=seed)
    with torch.no_grad():
        m.pruning.beta.fill_(beta)
    return m


def literal_keep(p, x, alpha):
    """I_{k,j} = prod_{n=j+1..k} sigma(x_{n,j}), I_{k,k} = 1, 0 above: loops over k, j, n, for the ContextPruning p.
    With its deviations (interaction.py): x_{n,j} gains -lambda log(n - j), and sigma = 1 for j < sinks."""
    b, t, _ = x.shape
    qi, ki = x @ p.W_Qint, x @ p.W_Kint
    lam = 0.0 if p.lam is None else p.lam
    keep = torch.zeros(b, t, t, dtype=x.dtype)
    for bi in range(b):
        for k in range(t):
            keep[bi, k, k] = 1
            for j in range(k):
                prod = torch.ones((), dtype=x.dtype)
                for n in range(j + 1, k + 1):
                    xnj = qi[bi, n] @ ki[bi, j] / math.sqrt(p.r) + p.beta - lam * math.log(n - j)
                    prod = prod * (torch.ones((), dtype=x.dtype) if j < p.sinks else alpha_sigmoid(xnj, alpha))
                keep[bi, k, j] = prod
    return keep


@pytest.mark.parametrize("alpha", [1.0, 1.7, 4.0])
def test_keep_structure_matches_the_literal_product(alpha):
    m = pruned_mixer().train()
    m.pruning.alpha = alpha
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    log_i, keep = m.pruning.log_keep(x)
    torch.testing.assert_close(keep, literal_keep(m.pruning, x, alpha), atol=1e-10, rtol=1e-8)
    assert torch.all(keep.diagonal(dim1=1, dim2=2) == 1) and torch.all(keep.triu(1) == 0)
    assert not torch.isnan(log_i).any()


def test_pruned_attention_matches_naive_softmax_with_log_i():
    from tests.naive import attention as naive_attention
    m = pruned_mixer("mqa").train()
    m.pruning.alpha = 1.5
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    _, keep = m.pruning.log_keep(x)
    # naive: the dense literal attention of each head, re-weighted by I and renormalised
    with torch.no_grad():
        got = m(x)
    n, d_h = m.n_heads, m.d_head
    outs = []
    for b in range(2):
        heads = []
        for i in range(n):
            Q, K, V = x[b] @ m.W_Q[:, i], x[b] @ m.W_K[:, 0], x[b] @ m.W_V[:, 0]
            s = Q @ K.T / math.sqrt(d_h) + torch.log(keep[b] + 1e-40)
            heads.append(torch.softmax(s, -1) @ V)
        outs.append(torch.cat(heads, -1) @ m.W_O)
    torch.testing.assert_close(got, torch.stack(outs), atol=1e-9, rtol=1e-7)
    assert naive_attention  # the dense naive reference stays importable for the unpruned case


def test_no_nan_when_everything_is_dropped():
    m = pruned_mixer(beta=-50.0).train()
    m.pruning.alpha = 4.0
    x = torch.randn(2, 12, 16, dtype=torch.float64, requires_grad=True)
    y = m(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    _, keep = m.pruning.log_keep(x)
    assert torch.equal(keep, torch.eye(12, dtype=keep.dtype).expand(2, 12, 12))  # only itself remains


def test_a_dropped_token_stays_dropped_and_never_drops_itself():
    m = pruned_mixer(beta=0.0, seed=3).eval()
    x = torch.randn(3, 20, 16, dtype=torch.float64)
    _, keep = m.pruning.log_keep(x)
    assert set(keep.unique().tolist()) <= {0.0, 1.0}
    assert torch.all(keep.diagonal(dim1=1, dim2=2) == 1)
    below = keep.tril(-1)
    # once 0 in column j, 0 in every later row: below the diagonal a column never increases going down
    assert torch.all(keep[:, 1:, :].tril(-1) <= keep[:, :-1, :] + torch.eye(20, dtype=keep.dtype)[1:, :])
    assert 0 < (1 - below.sum() / (3 * 20 * 19 / 2)) < 1  # this seed drops some, keeps some


@pytest.mark.parametrize("chunks", [[1] * 14, [6, 1, 4, 3], [14]], ids=["per-token", "chunked", "one-shot"])
@pytest.mark.parametrize("mixer", ATTENTION)
def test_incremental_decode_equals_full_forward_with_the_step_mask(mixer, chunks):
    model = DecoderLM(tiny_config(mixer, prune=True, prune_r=8)).double().eval()
    randomize(model, std=0.2, seed=5)
    for b in model.blocks:  # near the threshold, so the step mask both keeps and drops
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.02)
    idx = torch.randint(0, 61, (3, 14))
    with torch.no_grad():
        full = model(idx, diagnostics=True)
        steps, cache = cached_logits(model, idx, chunks)
    torch.testing.assert_close(steps, full.logits, rtol=1e-6, atol=1e-6)
    keep = full.diagnostics[0].keep
    assert torch.equal(cache.layers[0].alive[:, :14], keep[:, -1].bool())
    assert 0 < keep.tril(-1).sum() < 3 * 14 * 13 / 2


@pytest.mark.parametrize("mixer", ["mha", "mhe-mul"])
def test_causality_with_pruning(mixer):
    model = DecoderLM(tiny_config(mixer, prune=True, prune_r=8)).double().eval()
    randomize(model, std=0.2, seed=2)
    idx = torch.randint(0, 61, (2, 16))
    other = idx.clone()
    other[:, 10:] = (other[:, 10:] + 7) % 61
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits[:, :10], model(other).logits[:, :10], rtol=0, atol=1e-12)


def test_training_reports_the_sparsity_mass_and_refuses_cached_training():
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=8)).train()
    model.set_alpha(1.0)
    out = model(torch.randint(0, 61, (2, 10)), targets=torch.randint(0, 61, (2, 10)))
    n = 10
    assert 0 < float(out.prune_mass.detach()) <= model.config.n_layers * n * (n - 1) / 2
    (out.loss + 0.3 * out.prune_mass / (model.config.n_layers * n * (n - 1))).backward()
    assert model.blocks[0].mixer.pruning.beta.grad is not None
    with pytest.raises(RuntimeError, match="inference only"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=model.new_cache())


def test_sparsity_per_position():
    keep = torch.tensor([[[1, 0, 0], [0, 1, 0], [1, 1, 1]]], dtype=torch.float32)
    torch.testing.assert_close(sparsity(keep), torch.tensor([[0.0, 1.0, 0.0]]))


def test_pruning_config():
    with pytest.raises(ConfigError, match="needs softmax attention"):
        ModelConfig(mixer="we", prune=True)
    cfg = ModelConfig(mixer="mhe-add", prune=True, prune_r=32)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    from models.params import count_parameters
    assert count_parameters(DecoderLM(cfg))["pruning"] == cfg.n_layers * (2 * cfg.d_model * 32 + 1)


@pytest.mark.parametrize("pattern,k", [("local", 3), ("strided", 4)])
def test_fixed_sparse_baselines(pattern, k):
    from models.pruning import pattern_mask
    m = pattern_mask(12, 12, pattern, k)
    for i in range(12):
        for j in range(12):
            want = (i - j < k) if pattern == "local" else (i // k == j // k or j % k == k - 1)
            assert bool(m[i, j]) == want
    model = DecoderLM(tiny_config("mha", pattern=pattern, pattern_k=k)).double().eval()
    randomize(model, std=0.2)
    idx = torch.randint(0, 61, (2, 13))
    with torch.no_grad():
        full = model(idx, diagnostics=True)
        steps, _ = cached_logits(model, idx)
    torch.testing.assert_close(steps, full.logits, rtol=1e-6, atol=1e-6)
    p = full.diagnostics[0].attn
    mask = pattern_mask(13, 13, pattern, k).tril()
    assert torch.count_nonzero(p[..., ~mask]) == 0


def test_drop_records():
    from models.pruning import drop_records
    keep = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]], dtype=torch.float32)
    step, dropped = drop_records(keep)
    assert step.tolist() == [[2, 3, -1, -1]] and dropped.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("alpha", [1.001, 1.02, 1.049, 1.05, 1.5, 1.85, 3.0, 8.0])
def test_alpha_sigmoid_float32_agrees_with_float64(alpha):
    # spread over the saturation range, and over the sigmoid's (alpha near 1 saturates far out, at 1/(alpha-1))
    x = torch.randn(2000, dtype=torch.float64) * torch.tensor([2 / (alpha - 1), 30.0], dtype=torch.float64).repeat(1000)
    exact = alpha_sigmoid(x, alpha)
    torch.testing.assert_close(alpha_sigmoid(x.float(), alpha).double(), exact, atol=3e-6, rtol=0)          # table
    torch.testing.assert_close(alpha_sigmoid(x.float(), alpha, exact=True).double(), exact, atol=2e-6, rtol=0)
    xf, xd = x.float().requires_grad_(True), x.clone().requires_grad_(True)
    alpha_sigmoid(xf, alpha).sum().backward()
    alpha_sigmoid(xd, alpha).sum().backward()
    assert torch.isfinite(xf.grad).all()
    torch.testing.assert_close(xf.grad.double(), xd.grad, atol=2e-3, rtol=2e-3)


def test_alpha_sigmoid_tails_centre_and_nan_against_independent_values():
    """Checks that do not go through the bisection: next to alpha = 1 the exact path's log sigma is the logistic's
    (log sigma(x) = -softplus(-x)) deep into the tail, where bisecting sigma itself stopped at 2^-55 (log -38);
    sigma(0) = 1/2 at any alpha, large ones included (where a difference of expm1 terms cancelled); a NaN score
    comes back NaN from both paths instead of indexing the table out of range."""
    x = torch.tensor([-90.0, -60.0, -20.0, -1.0, 0.0, 1.0, 20.0], dtype=torch.float64)
    # (1e-5 relative: the alpha-sigmoid leaves the logistic by about (alpha - 1) x^2 / 2 in log, 4e-4 at x = -90)
    want = torch.nn.functional.logsigmoid(x)
    torch.testing.assert_close(alpha_sigmoid(x, 1 + 1e-7).log(), want, atol=1e-7, rtol=1e-5)
    for alpha in (1.001, 3.0, 8.0, 20.0, 50.0):
        assert abs(float(alpha_sigmoid(torch.zeros(1, dtype=torch.float64), alpha)) - 0.5) < 1e-15
    nan = torch.tensor([float("nan"), 0.5])
    for alpha in (1.02, 1.5, 8.0):
        for got in (alpha_sigmoid(nan, alpha), alpha_sigmoid(nan.double(), alpha)):
            assert got[0].isnan() and got[1].isfinite()


@pytest.mark.parametrize("alpha", [1.001, 1.02, 1.049])
def test_alpha_sigmoid_table_near_one_keeps_log_i(alpha):
    """Near alpha = 1 the table ends where sigma falls under log I's floor (1e-40), far before sigma saturates at
    1/(alpha-1): inside, log sigma is within 1e-4 of the float64 value wherever sigma > 1e-12; past the ends both
    floor alike (the table holds sigma(-R) there, within 1 % of the floor, and exactly 1 at the top)."""
    from kernels.alpha_sigmoid import table_range
    from kernels.keep_rule import LOG_FLOOR
    r = table_range(alpha)
    assert r < 1 / (alpha - 1)
    x = torch.linspace(-2 * r, 2 * r, 40_001, dtype=torch.float32).double()
    exact = alpha_sigmoid(x, alpha)
    got = alpha_sigmoid(x.float(), alpha).double()
    above = exact > 1e-12
    torch.testing.assert_close(got[above].log(), exact[above].log(), atol=1e-4, rtol=0)
    out = x.abs() > r
    floored = [v[out].clamp_min(LOG_FLOOR).log() for v in (got, exact)]
    torch.testing.assert_close(floored[0], floored[1], atol=0.01, rtol=0)
    assert torch.all(got[x > r] == 1)


def test_tables_built_together_equal_tables_built_alone(monkeypatch):
    """A GPU trainer builds the next steps' alpha-sigmoid tables in one batched bisection (prepare_tables): each
    equals the table its alpha gets alone, bit for bit, across point counts and both sides of alpha 2; the kept
    tables are bounded, and the schedule's prefetch builds only when this step's table is missing, in one
    bisection a side of 2 whatever the point counts."""
    import importlib
    tab = importlib.import_module("kernels.alpha_sigmoid")
    alphas = [1.02, 1.0201, 1.3, 1.7, 2.5, 4.0, 8.0]
    tab.clear_tables()
    alone = {a: tab._table(a, "cpu") for a in alphas}
    tab.clear_tables()
    monkeypatch.setattr(tab, "BATCH_POINTS", 3 * 8193)  # three tables of 8193 points a bisection: chunks too
    tab.prepare_tables(alphas + [1.0, 2.0, math.inf, 4.0], "cpu")   # closed forms and repeats are skipped
    assert len(tab._TABLES) == len(alphas)
    for a in alphas:
        got = tab._table(a, "cpu")
        assert all(torch.equal(g, w) for g, w in zip(got, alone[a])), a  # (p, d and the params)
    tab.clear_tables()
    monkeypatch.setattr(tab, "BATCH_POINTS", 1 << 21)  # now the shorter grids share a bisection with the longest
    tab.prepare_tables(alphas, "cpu")
    for a in alphas:
        got = tab._table(a, "cpu")
        assert all(torch.equal(g, w) for g, w in zip(got, alone[a])), a  # (p, d and the params)
    monkeypatch.setattr(tab, "TABLES_KEPT", 4)
    tab.prepare_tables([3.0, 3.1], "cpu")
    assert len(tab._TABLES) == 4 and tab.has_table(3.1, "cpu") and not tab.has_table(1.02, "cpu")
    tab.clear_tables()
    monkeypatch.setattr(tab, "BATCH_POINTS", 1 << 21)
    built = []
    real = tab._build
    monkeypatch.setattr(tab, "_build", lambda chunk, device: built.append(chunk) or real(chunk, device))
    tab.prefetch_schedule(0, 100, 1.0, 8.0, "cpu", ahead=4)      # alpha 1 at step 0: a closed form, nothing built
    tab.prefetch_schedule(50, 100, 1.0, 8.0, "cpu", ahead=4)     # (past 1.05 every table has 8193 points)
    assert built == [[tab.alpha_schedule(s, 100, 1.0, 8.0) for s in range(50, 54)]]
    tab.prefetch_schedule(51, 100, 1.0, 8.0, "cpu", ahead=4)     # kept already
    assert len(built) == 1
    tab.prefetch_schedule(1, 100, 1.0, 8.0, "cpu", ahead=4)      # near 1 the point counts differ: one build still
    steps = [tab.alpha_schedule(s, 100, 1.0, 8.0) for s in range(1, 5)]
    assert len({tab._grid(a)[1] for a in steps}) == 4
    assert len(built) == 2 and sorted(built[1]) == steps
    assert tab._grid(1.02)[1] == tab._grid(1.0201)[1] == 2 * 9216 + 1
    built.clear()
    tab.clear_tables()
    tab.prefetch_schedule(46, 200, 1.0, 8.0, "cpu", ahead=8)      # alpha 1.875 to 2.143: one build a side of 2
    steps = [tab.alpha_schedule(s, 200, 1.0, 8.0) for s in range(46, 54)]
    assert [sorted(c) for c in built] == [[a for a in steps if a < 2], [a for a in steps if a > 2]]
    tab.clear_tables()


def test_calibration_gives_small_inputs_the_spread_the_paper_init_assumes():
    """With inputs of RMS 0.05 the paper's init leaves every score at beta (saturated alpha-sigmoid, no gradient);
    after calibrate() the scores spread as they do for unit-scale inputs."""
    from models.pruning import ContextPruning
    torch.manual_seed(0)
    x_unit = torch.randn(2, 64, 96)
    unit = ContextPruning(96, 16, 2.0)
    spread = (unit.scores(x_unit, unit.keys(x_unit)) - 2.0).std().item()
    small = ContextPruning(96, 16, 2.0)
    small.load_state_dict(unit.state_dict())
    x = x_unit * 0.05
    assert (small.scores(x, small.keys(x)) - 2.0).std().item() < 0.01 * spread
    rms = small.calibrate(x)
    assert rms == pytest.approx(0.05, rel=0.05)
    torch.testing.assert_close(small.scores(x, small.keys(x)), unit.scores(x_unit, unit.keys(x_unit)), rtol=0.12,
                               atol=0.12)
