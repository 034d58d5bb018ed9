"""Training's keep structure with its hand-written backward (models.pruning.interaction._LogKeep over
kernels.log_keep / log_keep_grad): equal to autograd through the plain chain (gates, then log_keep_from_gates, the
path an intervention takes), to finite differences, and the Triton kernels (interpreter) to the reference."""
from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels import reference
from kernels.keep_rule import below_diagonal
from models.pruning.interaction import ContextPruning

# numpy under Triton's interpreter warns of log(0) and 0/0 in lanes the kernels mask out
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ALPHAS = [1.0, 1.02, 1.7, 2.0, 4.0, 8.0]


def rule(dtype, alpha, sinks=0, distance=False, seed=0):
    torch.manual_seed(seed)
    p = ContextPruning(12, 6, 0.5, distance=distance, sinks=sinks).to(dtype).train()
    p.alpha = alpha
    if distance:
        p.lam.data.fill_(0.3)
    return p


def grads(p, x, edit, g_log, g_keep, g_mass=0.0):
    """(log I, I, mass, dL/dx, dL/dparams) for L = <log I, g_log> (on and below the diagonal) + <I, g_keep> +
    g_mass * mass (the sparsity loss's term)."""
    x = x.clone().requires_grad_(True)
    p.zero_grad()
    log_i, keep, mass = p.log_keep(x, edit, mass=True)
    _, causal = below_diagonal(x.shape[1], x.device)
    ((log_i.masked_fill(~causal, 0) * g_log + keep * g_keep).sum() + g_mass * mass).backward()
    return log_i.detach(), keep.detach(), mass.detach(), x.grad, [q.grad.clone() for q in p.parameters()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("sinks,distance", [(0, False), (2, True)])
def test_fused_backward_equals_autograd_through_the_chain(dtype, alpha, sinks, distance):
    p = rule(dtype, alpha, sinks, distance)
    torch.manual_seed(1)
    x = torch.randn(2, 19, 12, dtype=dtype) * 2
    g_log, g_keep = torch.randn(2, 19, 19, dtype=dtype), torch.randn(2, 19, 19, dtype=dtype)
    fused = grads(p, x, None, g_log, g_keep, 3.0)
    chain = grads(p, x, lambda s: s, g_log, g_keep, 3.0)  # an identity edit: autograd through every op
    assert torch.equal(fused[0], chain[0]) and torch.equal(fused[1], chain[1])  # the same forward values
    torch.testing.assert_close(fused[2], chain[2], rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b in zip([fused[3], *fused[4]], [chain[3], *chain[4]]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=tol * float(b.abs().max()), rtol=tol)


FROZEN = {"rule frozen": ("x",), "base frozen": ("W_Qint", "W_Kint", "beta", "lam"),
          "beta frozen": ("x", "W_Qint", "W_Kint", "lam"), "W_Qint": ("W_Qint",), "W_Kint": ("W_Kint",),
          "lambda": ("lam",), "beta": ("beta",)}


@pytest.mark.parametrize("trainable,distance", [(t, d) for t in FROZEN.values() for d in (False, True)
                                                if d or t != ("lam",)])  # (no lambda without the distance term)
def test_fused_backward_with_frozen_inputs(trainable, distance):
    """The hand-written backward hands each of q, k and the bias a gradient only where one is needed (a frozen base
    trains the rule alone; COMPACTER freezes more), and those it hands equal autograd's through the chain."""
    p = rule(torch.float64, 1.7, sinks=1, distance=distance, seed=4)
    for name, q in p.named_parameters():
        q.requires_grad_(name in trainable)
    torch.manual_seed(5)
    x0 = torch.randn(2, 9, 12, dtype=torch.float64)
    g_log, g_keep = torch.randn(2, 9, 9, dtype=torch.float64), torch.randn(2, 9, 9, dtype=torch.float64)
    _, causal = below_diagonal(9, "cpu")
    got = []
    for edit in (None, lambda s: s):
        x = x0.clone().requires_grad_("x" in trainable)
        for q in p.parameters():
            q.grad = None
        log_i, keep, mass = p.log_keep(x, edit, mass=True)
        ((log_i.masked_fill(~causal, 0) * g_log + keep * g_keep).sum() + 2.0 * mass).backward()
        got.append({"x": x.grad, **{n: q.grad for n, q in p.named_parameters()}})
    fused, chain = got
    for name in fused:
        assert (fused[name] is None) == (chain[name] is None) == (name not in trainable), name
        if fused[name] is not None:
            torch.testing.assert_close(fused[name], chain[name], atol=1e-10 * float(chain[name].abs().max()),
                                       rtol=1e-10)


@pytest.mark.parametrize("alpha,sinks,distance", [(1.0, 0, False), (1.7, 1, True), (2.5, 0, True)])
def test_fused_backward_against_finite_differences(alpha, sinks, distance):
    """Float64 (the exact bisection below alpha 2), every output position that is finite."""
    p = rule(torch.float64, alpha, sinks, distance, seed=2)
    torch.manual_seed(3)
    x = (torch.randn(2, 6, 12, dtype=torch.float64) * 0.7).requires_grad_(True)
    _, causal = below_diagonal(6, "cpu")

    def f(x):
        log_i, keep, mass = p.log_keep(x, mass=True)
        return log_i.masked_fill(~causal, 0), keep, mass
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_no_gradient_reaches_the_scores_through_positions_above_the_diagonal():
    """Whatever arrives at log I's -inf or I's 0 above the diagonal (even a NaN) is not passed on."""
    x = torch.randn(1, 9, 9, dtype=torch.float64)
    _, keep, ratio, _ = reference.log_keep(x, alpha=2.5)
    g = torch.randn(1, 9, 9, dtype=torch.float64)
    above = torch.ones(9, 9, dtype=torch.bool).triu(1)
    want = reference.log_keep_grad(g, g, keep, ratio)
    assert torch.equal(reference.log_keep_grad(g.masked_fill(above, float("nan")), g, keep, ratio), want)


def test_a_forward_without_gradient_takes_the_plain_chain():
    """Inference and analysis never build the backward's state (ratio): _LogKeep only when the scores need a
    gradient."""
    p = rule(torch.float32, 2.5)
    x = torch.randn(1, 7, 12)
    with kernels.record_paths() as paths, torch.no_grad():
        p.log_keep(x)
    assert "log_keep" not in paths
    with kernels.record_paths() as paths:
        p.log_keep(x)  # the rule's parameters need a gradient
    assert paths["log_keep"] == "reference"


def test_the_step_takes_the_plain_chain_and_gives_no_gradient():
    """At alpha = inf (the step) there is no gradient to hand-write: the plain chain, whose parameters get none."""
    p = rule(torch.float32, float("inf"))
    with kernels.record_paths() as paths:
        log_i, keep = p.log_keep(torch.randn(1, 7, 12))
    assert "log_keep" not in paths and not log_i.requires_grad and not keep.requires_grad


@pytest.fixture
def interpreter(monkeypatch):
    if "log_keep" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    from kernels import triton_keep
    from tests.test_kernels_triton import _Poisoned
    monkeypatch.setattr(triton_keep, "torch", _Poisoned())  # fresh outputs hold NaN: an unwritten one shows
    return triton_keep


@pytest.mark.parametrize("alpha", [1.0, 2.0, 1.02, 3.0])
@pytest.mark.parametrize("t,sinks", [(1, 0), (37, 0), (70, 3), (130, 140)])
def test_triton_keep_equals_the_reference(interpreter, alpha, t, sinks):
    torch.manual_seed(t)
    x = torch.randn(2, t, t) * 3
    x[0, t // 2, t // 3] = float("nan")    # a NaN score stays NaN in log I and I, and passes no gradient
    x[1, -1, 0] = -200.0                     # under log I's floor at every alpha
    x[1, t // 2:, t // 4] = 40.0             # saturated at 1
    x[0, -1, :t // 2] = -90.0                # under the float32 gradient floor at alpha 1 (sigma 8e-40)
    x[0, t // 3:, -1] = torch.where(torch.arange(t - t // 3) % 2 == 0, -1.0, 1.0)  # alpha 2's ends, x = -1, 1
    got = interpreter.log_keep(x, alpha=alpha, sinks=sinks)
    want = reference.log_keep(x, alpha=alpha, sinks=sinks)
    assert len(got) == len(want) == 4  # log I, I, ratio and the mass
    for g, w in zip(got, want):  # every position written: log I -inf above the diagonal, I and ratio 0
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())
        fin = w.isfinite()
        assert torch.equal(g[~fin & ~w.isnan()], w[~fin & ~w.isnan()])
        torch.testing.assert_close(g[fin], w[fin], atol=1e-6, rtol=1e-5)  # (log I: float32 sums of up to -92 a row)
    # a pair whose column saw a sigma of exactly 0 is exactly 0 in both (elsewhere a product of many small sigmas
    # may underflow to 0 a step earlier or later, the kernel multiplying in another order)
    from kernels.alpha_sigmoid import alpha_sigmoid_slope
    sig = alpha_sigmoid_slope(x, alpha)[0]
    sig[..., :sinks] = 1
    later, _ = below_diagonal(t, "cpu")
    dropped = (((sig == 0) & later).cumsum(1) > 0) & ~want[1].isnan()  # (0 times a NaN above stays NaN)
    assert bool((got[1][dropped] == 0).all()) and bool((want[1][dropped] == 0).all())
    _, keep, ratio, _ = want
    torch.manual_seed(0)
    g_log, g_keep, g_mass = torch.randn(2, t, t), torch.randn(2, t, t), torch.tensor(0.7)
    for a, b, c in ((g_log, g_keep, None), (g_log, None, None), (None, g_keep, None), (g_log, None, g_mass),
                    (None, None, g_mass), (g_log, g_keep, g_mass)):
        g = interpreter.log_keep_grad(a, b, keep, ratio, c)
        w = reference.log_keep_grad(a, b, keep, ratio, c)
        assert torch.equal(g.isnan(), w.isnan())
        g, w = g.nan_to_num(), w.nan_to_num()
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()), rtol=1e-4)


def test_a_training_step_through_the_triton_keep_equals_the_reference(interpreter, monkeypatch):
    """A pruned model's loss and every gradient with MIXSCOPE_KERNELS=triton (the keep structure on the
    kernels; attention, which needs a gradient, on SDPA) against the reference path."""
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    torch.manual_seed(0)
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=8, prune_sinks=1)).train()
    model.set_alpha(1.7)
    ids = torch.randint(0, model.config.vocab_size, (2, 21))

    def step():
        model.zero_grad()
        out = model(ids, targets=ids)
        loss = out.loss + out.prune_mass * 1e-3
        loss.backward()
        return loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    want_loss, want = step()
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    with kernels.record_paths() as paths:
        got_loss, got = step()
    assert paths["log_keep"] == "triton" and paths["log_keep_grad"] == "triton"
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5 * float(want[name].abs().max()) + 1e-9,
                                   rtol=1e-4, msg=name)


# alphas where float32(lim) * float32(half / lim) passes the table's half-width by an ulp (found by search over
# 1.01, 1.02, ..., 19.99); 1.14 is one where the grid ends above P_FLOOR rather than at 0
ULP_ALPHAS = [1.14, 2.7, 3.15, 3.91]


@pytest.mark.parametrize("alpha", ULP_ALPHAS + [4.0, 8.0])
def test_the_interpolated_sigma_stays_in_0_1_at_and_past_the_grids_ends(alpha):
    """At these alphas the interpolation weight left [0, 1] at the grid's ends: sigma was -7e-8 there (a negative
    I after a product) and 1 + 1e-7 at the other end."""
    from kernels.alpha_sigmoid import _table, alpha_sigmoid, alpha_sigmoid_slope, table_range
    lim = table_range(alpha)
    x = torch.tensor([-1e3, -lim, -lim * (1 - 1e-7), 0.0, lim * (1 - 1e-7), lim, 1e3])
    p_tab = _table(alpha, "cpu").p
    for s in (alpha_sigmoid(x, alpha), alpha_sigmoid_slope(x, alpha)[0]):
        assert bool(((s >= 0) & (s <= 1)).all()), s
        assert s[0] == s[1] == p_tab[0] and s[-1] == s[-2] == p_tab[-1]
    assert bool((alpha_sigmoid_slope(x, alpha)[1] >= 0).all())


@pytest.mark.parametrize("alpha", ULP_ALPHAS + [8.0])
def test_triton_keep_at_the_grids_ends(interpreter, alpha):
    """The kernel takes the table's scale from the host and clamps the index as the reference does: scores past
    both ends give the reference's log I, I and ratio, never NaN or a negative I (an H200's approximate float32
    division gave NaN log I at alpha 4 before)."""
    from kernels.alpha_sigmoid import table_range
    torch.manual_seed(1)
    t = 40
    lim = table_range(alpha)
    x = torch.randn(2, t, t) * lim
    x[0, t // 2:, :t // 2] = -lim        # exactly at the ends
    x[0, :t // 2, t // 2:] = lim
    x[1, t // 3:, :] = -50.0             # far past them
    x[1, :t // 3, :] = 50.0
    got = interpreter.log_keep(x, alpha=alpha, sinks=1)
    want = reference.log_keep(x, alpha=alpha, sinks=1)
    assert not any(bool(g.isnan().any()) for g in got) and bool((got[1] >= 0).all())
    for g, w in zip(got, want):
        fin = w.isfinite()
        assert torch.equal(g.isinf(), w.isinf())
        torch.testing.assert_close(g[fin], w[fin], atol=1e-6, rtol=1e-5)


def test_a_backward_on_another_thread_notes_its_path_where_its_forward_ran():
    """On CUDA autograd runs a backward on a device thread of its own, which does not inherit the context
    record_paths() set: log_keep_grad then went unrecorded (KeyError on an H200, 2026-11-27). Here the backward is
    run on a thread of this test's."""
    import threading
    p = rule(torch.float32, 1.7)
    x = torch.randn(1, 9, 12).requires_grad_(True)  # hidden states (the rule is 12 wide)
    with kernels.record_paths() as paths:
        log_i, keep = p.log_keep(x, None)
        loss = keep.sum() + log_i.masked_fill(~below_diagonal(9, "cpu")[1], 0).sum()
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    assert x.grad is not None and paths.get("log_keep_grad") == paths["log_keep"]
    # a forward outside any recorder, its backward inside one: noted where the backward runs
    log_i, keep = p.log_keep(x, None)
    with kernels.record_paths() as later:
        keep.sum().backward()
    assert later.get("log_keep_grad") == paths["log_keep"]
    # both: the forward's recorder and the backward's each see it
    with kernels.record_paths() as first:
        log_i, keep = p.log_keep(x, None)
    with kernels.record_paths() as second:
        keep.sum().backward()
    assert first.get("log_keep_grad") == second.get("log_keep_grad") == paths["log_keep"]


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_log_i_is_its_own_causal_mask_in_a_training_step(path, request, monkeypatch):
    """models.backends.full hands log I to attention with bias_is_causal: it is -inf above the diagonal from either
    keep kernel, so no path builds a causal mask over it, and the loss and every gradient are the same bits as with
    the mask filled in on top (bias_is_causal off), in training and at inference (there only the reference path builds
a mask to skip; the Triton prefill skips the blocks either way). (T = 21 is under one Triton block:
    the tiles wholly above the diagonal are test_triton_keep_equals_the_reference's.)"""
    from models.mixers.attention import Attention
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    if path == "triton":
        request.getfixturevalue("interpreter")
    monkeypatch.setenv("MIXSCOPE_KERNELS", path)
    rule = ContextPruning(12, 6, 0.5).train()
    rule.alpha = 1.7  # (at alpha = inf the plain chain runs, no keep kernel)
    with kernels.record_paths() as paths:
        log_i, _ = rule.log_keep(torch.randn(2, 9, 12))
    assert paths["log_keep"] == path
    _, causal = below_diagonal(9, log_i.device)
    assert bool((log_i[:, ~causal] == float("-inf")).all()) and bool(log_i[:, causal].isfinite().all())
    torch.manual_seed(0)
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, prune=True, prune_r=8, prune_sinks=1)).train()
    model.set_alpha(1.7)
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    asked = []
    attend = Attention.attend

    def spy(self, *a, causal=True, bias_is_causal=False, force=False, **kw):
        asked.append((causal, bias_is_causal))
        return attend(self, *a, causal=causal, bias_is_causal=bias_is_causal and not force, **kw)

    def step(force: bool):
        monkeypatch.setattr(Attention, "attend", lambda self, *a, **kw: spy(self, *a, force=force, **kw))
        model.zero_grad()
        with kernels.record_paths() as paths:
            out = model(ids, targets=ids)
            (out.loss + out.prune_mass * 1e-3).backward()
        assert paths["log_keep"] == path and paths["log_keep_grad"] == path and paths["attention"] == "reference"
        return out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    got_loss, got = step(False)
    assert asked and all(a == (True, True) for a in asked)  # causal, and the bias says so
    want_loss, want = step(True)
    assert torch.equal(got_loss, want_loss) and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    asked.clear()
    with torch.no_grad():
        model.eval()
        logits = [model(ids).logits]
        monkeypatch.setattr(Attention, "attend", lambda self, *a, **kw: spy(self, *a, force=False, **kw))
        logits.append(model(ids).logits)
    assert asked and all(a == (True, True) for a in asked)
    assert torch.equal(*logits)


def test_the_triton_keep_writes_log_i_in_attentions_dtype(interpreter):
    """Under autocast log I goes to attention in bf16: the kernel rounds it as it writes (on a GPU to nearest even;
    Triton's interpreter truncates, so within one bf16 unit here), and the backward reads a bf16 gradient of it
    as the float32 one it equals, exactly."""
    torch.manual_seed(5)
    x = torch.randn(2, 70, 70) * 3
    for alpha in (1.0, 2.0, 1.02):
        got = interpreter.log_keep(x, alpha=alpha, sinks=1, log_dtype=torch.bfloat16)
        want = reference.log_keep(x, alpha=alpha, sinks=1)
        assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
        assert torch.equal(got[0].isinf(), want[0].isinf())
        fin = want[0].isfinite()
        torch.testing.assert_close(got[0][fin].float(), want[0][fin], rtol=2 ** -7, atol=1e-5)
        for g, w in zip(got[1:], want[1:]):  # I, ratio and the mass stay as they were
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
        g_log = torch.randn(2, 70, 70).bfloat16()
        for mod in (interpreter, reference):
            assert torch.equal(mod.log_keep_grad(g_log, None, want[1], want[2], torch.tensor(0.5)),
                               mod.log_keep_grad(g_log.float(), None, want[1], want[2], torch.tensor(0.5)))
    assert reference.log_keep(x, alpha=1.7, log_dtype=torch.bfloat16)[0].dtype == torch.bfloat16


def test_a_bf16_training_step_hands_log_i_to_attention_in_bf16_with_the_same_bits(monkeypatch):
    """Under bf16 autocast the keep kernel writes log I in attention's dtype (models.backends.full passes q's):
    attention used to cast the float32 log I to bf16 itself, a [B,1,T,T] pass forward and one back. The loss and
    every gradient are the same bits as with that cast (both round to nearest even, and a bf16 gradient widens
    exactly), on the reference path; the Triton kernel's own rounding is checked above and on a GPU."""
    from models.mixers.attention import Attention
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    torch.manual_seed(0)
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=8, prune_sinks=1, prune_distance=True)).train()
    model.set_alpha(1.7)
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    orig_log_keep, attend = ContextPruning.log_keep, Attention.attend
    seen = []

    def spy(self, q, k, v, bias, *a, **kw):
        seen.append(bias.dtype)
        return attend(self, q, k, v, bias, *a, **kw)

    def step(cast_after: bool):
        if cast_after:  # what the step did before: log I in float32, cast by attention
            monkeypatch.setattr(ContextPruning, "log_keep", lambda self, x, edit=None, mass=False, log_dtype=None:
                                orig_log_keep(self, x, edit, mass))
        else:
            monkeypatch.setattr(ContextPruning, "log_keep", orig_log_keep)
        monkeypatch.setattr(Attention, "attend", spy)
        model.zero_grad()
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, targets=ids)
            loss = out.loss + out.prune_mass * 1e-3
        loss.backward()
        return set(seen), loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    dtypes, got_loss, got = step(False)
    assert dtypes == {torch.bfloat16}
    dtypes, want_loss, want = step(True)
    assert dtypes == {torch.float32}
    assert torch.equal(got_loss, want_loss) and got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
