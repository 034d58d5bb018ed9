"""A pruned training step's attention in our own Triton kernels (kernels.triton_causal_bias), in the CPU interpreter
(float32: its bf16 tl.dot is broken; tests/test_gpu.py runs the half types on a GPU, and tests/test_kernels_compile.py
compiles every launch for sm_90): forward and backward against the equation in float64, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import triton_causal_bias as cb
from models.pruning import pair_count, sparsity_loss
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Every buffer the kernels fill starts as NaN: an element left unwritten shows."""
    from tests.test_kernels_triton import _Poisoned
    monkeypatch.setattr(cb, "torch", _Poisoned())


def naive(q, k, v, bias, scale):
    """softmax(q k^T * scale + bias) v over keys j <= i, head h reading K/V group h // (H/G): the equation, nothing
    fused."""
    h, g, t = q.shape[1], k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = q @ k.transpose(-1, -2) * scale + bias
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def inputs(b, h, g, t, d, *, gen, dropped=0.2):
    """q, k, v and a log I-like bias: at most 0, -inf for some dropped pairs and above the diagonal, 0 on it."""
    q = torch.randn(b, h, t, d, generator=gen)
    k, v = (torch.randn(b, g, t, d, generator=gen) for _ in range(2))
    bias = -torch.rand(b, 1, t, t, generator=gen) * 6
    bias = bias.masked_fill(torch.rand(b, 1, t, t, generator=gen) < dropped, float("-inf"))
    bias = bias.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    bias.diagonal(dim1=-2, dim2=-1).zero_()
    return q, k, v, bias


def grads(fn, ins, grad_out, dtype=None):
    ins = [x.detach().to(dtype or x.dtype).requires_grad_(x.requires_grad) for x in ins]
    out = fn(*ins)
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [x.grad for x in ins]


@pytest.mark.parametrize("b,h,g,t,d", [(2, 4, 2, 37, 24), (1, 3, 1, 70, 16), (1, 2, 2, 64, 64), (2, 1, 1, 9, 8),
                                       (1, 4, 4, 130, 32), (1, 2, 1, 40, 96)])
def test_forward_and_every_gradient_equal_the_equation(b, h, g, t, d):
    """MHA, GQA and MQA; lengths that fill no block, one and several; head widths under a block's, and one past 64
    (the wide launch shapes). The bias's gradient sums its heads, and above the diagonal it is an exact zero."""
    gen = torch.Generator().manual_seed(t * 7 + d)
    q, k, v, bias = inputs(b, h, g, t, d, gen=gen)
    grad_out = torch.randn(b, h, t, d, generator=gen)
    ins = [x.requires_grad_(True) for x in (q, k, v, bias)]
    scale = d ** -0.5
    got = grads(lambda *a: cb.attention(*a, scale), ins, grad_out)
    want = grads(lambda *a: naive(*a, scale), ins, grad_out, torch.float64)
    for name, a, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert a.dtype == torch.float32 and a.shape == w.shape, name
        torch.testing.assert_close(a.double(), w.nan_to_num(), atol=2e-5, rtol=1e-4, msg=name)
    assert torch.count_nonzero(got[4].triu(1)) == 0 and not got[4].isnan().any()


@pytest.mark.parametrize("shapes", [
    {"forward": (16, 32, 4, 2), "kv": (64, 16, 4, 2), "q": (16, 64, 4, 2)},   # query blocks shorter, then longer
    {"forward": (64, 16, 4, 2), "kv": (16, 64, 4, 2), "q": (64, 16, 4, 2)}])  # than key blocks, and the reverse
def test_any_pair_of_block_sizes_gives_the_same_gradients(monkeypatch, shapes):
    """The kv kernel starts at the query block holding its first key, whatever the two block sizes: the launch
    tables with block_m and block_n unequal either way (the interpreter runs float32's table)."""
    monkeypatch.setitem(cb.LAUNCH, "float32", shapes)
    gen = torch.Generator().manual_seed(8)
    q, k, v, bias = inputs(1, 4, 2, 100, 16, gen=gen)
    grad_out = torch.randn(1, 4, 100, 16, generator=gen)
    ins = [x.requires_grad_(True) for x in (q, k, v, bias)]
    got = grads(lambda *a: cb.attention(*a, 0.25), ins, grad_out)
    want = grads(lambda *a: naive(*a, 0.25), ins, grad_out, torch.float64)
    for name, a, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        torch.testing.assert_close(a.double(), w.nan_to_num(), atol=2e-5, rtol=1e-4, msg=name)


def test_half_precision_inputs():
    """float16 (the interpreter's bf16 tl.dot is broken; tests/test_gpu.py runs bf16 on a GPU): the products in
    half, softmax and accumulators in float32, the gradients back in float16, within half precision of the
    equation in float64."""
    gen = torch.Generator().manual_seed(9)
    q, k, v, bias = (x.half() for x in inputs(1, 4, 2, 48, 32, gen=gen))
    grad_out = torch.randn(1, 4, 48, 32, generator=gen).half()
    ins = [x.requires_grad_(True) for x in (q, k, v, bias)]
    got = grads(lambda *a: cb.attention(*a, 32 ** -0.5), ins, grad_out)
    want = grads(lambda *a: naive(*a, 32 ** -0.5), ins, grad_out, torch.float64)
    for name, a, w in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        assert a.dtype == torch.float16, name
        w = w.nan_to_num()
        assert float((a.double() - w).norm() / w.norm()) < 3e-3, name


def test_keys_and_values_without_a_gradient_skip_their_kernel(monkeypatch):
    """A layer whose K and V need no gradient (the first under freeze_base): their kernel is not launched, and
    the gradients of q and the bias are unchanged."""
    gen = torch.Generator().manual_seed(10)
    q, k, v, bias = inputs(1, 2, 2, 30, 16, gen=gen)
    grad_out = torch.randn(1, 2, 30, 16, generator=gen)
    full = grads(lambda *a: cb.attention(*a, 0.25), [x.requires_grad_(True) for x in (q, k, v, bias)], grad_out)
    launched = []
    real = cb._causal_bias_kv_kernel
    monkeypatch.setattr(cb, "_causal_bias_kv_kernel", type("Launch", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    part = grads(lambda *a: cb.attention(*a, 0.25), [q, k.detach(), v.detach(), bias], grad_out)
    assert part[2] is None and part[3] is None and not launched
    for i in (0, 1, 4):
        torch.testing.assert_close(part[i], full[i], atol=1e-6, rtol=1e-5)
    grads(lambda *a: cb.attention(*a, 0.25), [q, k.detach(), v.detach().requires_grad_(True), bias], grad_out)
    assert len(launched) == 1  # (V alone asks for it)


@pytest.mark.parametrize("needs", [(True, False, False, False), (False, True, False, False),
                                   (False, False, True, False), (False, False, False, True),
                                   (True, True, True, False)], ids=["q", "k", "v", "bias", "qkv"])
def test_each_input_gets_a_gradient_exactly_when_it_asks(needs):
    """Any one of q, K, V and the bias needing a gradient (a frozen first layer under freeze_base has the bias
    alone), and q, K, V without the bias: the gradients asked for equal the equation's, the others are None."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, bias = inputs(1, 4, 2, 40, 16, gen=gen)
    grad_out = torch.randn(1, 4, 40, 16, generator=gen)
    ins = [x.requires_grad_(n) for x, n in zip((q, k, v, bias), needs)]
    got = grads(lambda *a: cb.attention(*a, 0.25), ins, grad_out)
    want = grads(lambda *a: naive(*a, 0.25), ins, grad_out, torch.float64)
    for name, a, w, asked in zip(("dq", "dk", "dv", "dbias"), got[1:], want[1:], needs):
        assert (a is not None) == asked, name
        if asked:
            torch.testing.assert_close(a.double(), w.nan_to_num(), atol=2e-5, rtol=1e-4, msg=name)


def test_views_of_one_packed_projection_and_rows_with_gaps():
    """q, K and V as slices of one packed [B,T,H+2G,2D] projection (neither dense nor alike), q reading every other
    element of its rows: each gradient is written through its own layout, and lands in the right slots of the
    packed tensor's gradient."""
    gen = torch.Generator().manual_seed(12)
    b, h, g, t, d = 2, 4, 2, 33, 16
    packed = torch.randn(b, t, h + 2 * g, 2 * d, generator=gen)
    bias = inputs(b, h, g, t, d, gen=gen)[3]
    grad_out = torch.randn(b, h, t, d, generator=gen)

    def heads(p):
        return (p[:, :, :h, ::2].transpose(1, 2), p[:, :, h:h + g, :d].transpose(1, 2),
                p[:, :, h + g:, d:].transpose(1, 2))
    got = packed.clone().requires_grad_(True)
    assert heads(got)[0].stride(-1) == 2
    cb.attention(*heads(got), bias, 0.25).backward(grad_out)
    want = packed.double().requires_grad_(True)
    naive(*heads(want), bias.double(), 0.25).backward(grad_out.double())
    torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-5, rtol=1e-4)


def test_the_grids_and_offsets_bound_what_fits():
    """B x H on the grids' second axis (65,535 at most) and a row's offsets into the T x T bias (int32): refused
    past either bound, taken at it. (Expanded tensors: nothing is allocated.)"""
    one = torch.zeros(1, 1, 1, 1)

    def shaped(b, t):
        return one.expand(b, 1, t, 16), one.expand(b, 1, t, 16), one.expand(b, 1, t, 16), one.expand(b, 1, t, t)
    assert cb.fits(*shaped(cb.MAX_ROWS, 8)) and not cb.fits(*shaped(cb.MAX_ROWS + 1, 8))
    assert cb.fits(*shaped(1, cb.MAX_T)) and not cb.fits(*shaped(1, cb.MAX_T + 1))
    assert cb.MAX_T ** 2 < 2 ** 31 <= (cb.MAX_T + 1) ** 2


def test_inputs_are_read_in_place_through_their_strides():
    """q, k, v as the mixers hand them (transposed views of [B,T,H,D]), a bias with padded rows, a gradient of the
    output in another layout: the same values and gradients as contiguous copies, and the output laid out [B,T,H,D]
    (the mixer's transpose back to [B,T,H*D] is a view)."""
    gen = torch.Generator().manual_seed(6)
    b, h, g, t, d = 2, 4, 2, 33, 16
    q, k, v, bias = inputs(b, h, g, t, d, gen=gen)
    grad_out = torch.randn(b, h, t, d, generator=gen)
    views = [q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2),
             v.transpose(1, 2).contiguous().transpose(1, 2),
             torch.cat([bias, torch.zeros(b, 1, t, 5)], -1)[..., :t]]
    assert not any(x.is_contiguous() for x in views)
    leaves = [x.detach().clone().requires_grad_(True) for x in views]
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in leaves[:3]] + [
        torch.nn.functional.pad(leaves[3], (0, 5))[..., :t]]
    out = cb.attention(*strided, 0.25)
    assert out.transpose(1, 2).is_contiguous()
    out.backward(grad_out.transpose(2, 3).contiguous().transpose(2, 3))
    want = grads(lambda *a: cb.attention(*a, 0.25), [x.contiguous().requires_grad_(True) for x in views], grad_out)
    torch.testing.assert_close(out, want[0], atol=1e-6, rtol=1e-5)
    for a, w in zip(leaves, want[1:]):
        torch.testing.assert_close(a.grad, w, atol=1e-6, rtol=1e-5)


def test_a_bias_without_a_gradient_and_one_the_mask_overrides():
    """A bias that needs no gradient gets none (the kernel skips the atomic adds), q/k/v's are unchanged; and what
    a bias holds above the diagonal changes nothing: the causal mask applies whatever it says."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, bias = inputs(2, 4, 2, 40, 16, gen=gen)
    grad_out = torch.randn(2, 4, 40, 16, generator=gen)
    with_grad = grads(lambda *a: cb.attention(*a, 0.25), [x.requires_grad_(True) for x in (q, k, v, bias)], grad_out)
    bias.requires_grad_(False)
    upper = torch.ones(40, 40, dtype=torch.bool).triu(1)
    open_above = bias.masked_fill(upper, 3.0)
    without = grads(lambda *a: cb.attention(*a, 0.25), [q, k, v, open_above], grad_out)
    assert without[4] is None
    for a, w in zip(without[:4], with_grad[:4]):
        torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-5)


def test_a_row_with_nothing_allowed_gives_zeros_not_nan():
    """A bias of -inf on a row's every allowed key (log I never has one: I_kk = 1) outputs zeros and passes no
    gradient, where a plain softmax gives NaN; the other rows are unaffected."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, bias = inputs(1, 2, 2, 20, 16, gen=gen)
    bias[0, 0, 5] = float("-inf")
    grad_out = torch.randn(1, 2, 20, 16, generator=gen)
    got = grads(lambda *a: cb.attention(*a, 0.25), [x.requires_grad_(True) for x in (q, k, v, bias)], grad_out)
    assert all(not x.isnan().any() for x in got)
    assert torch.count_nonzero(got[0][:, :, 5]) == 0 and torch.count_nonzero(got[1][:, :, 5]) == 0
    assert torch.count_nonzero(got[4][0, 0, 5]) == 0
    rows = [i for i in range(20) if i != 5]
    want = naive(*(x.detach().double() for x in (q, k, v, bias)), 0.25)
    torch.testing.assert_close(got[0][:, :, rows].double(), want[:, :, rows], atol=2e-5, rtol=1e-4)


def test_what_the_kernels_take_and_a_clear_refusal():
    q, k, v, bias = inputs(1, 4, 2, 32, 16, gen=torch.Generator().manual_seed(3))
    assert cb.fits(q, k, v, bias) and cb.fits(q, k, v, bias.expand(1, 1, 32, 32))
    assert not cb.fits(q, k, v, None)
    assert not cb.fits(q, k[:, :1].expand(1, 3, 32, 16), v[:, :1].expand(1, 3, 32, 16), bias)  # 3 does not divide 4
    assert not cb.fits(q, k, v, bias.expand(1, 4, 32, 32))                                      # a bias per head
    assert not cb.fits(q, k[:, :, :16], v[:, :, :16], bias[..., :16])                           # T != S: a cache
    assert not cb.fits(q, k, v, bias.double()) and not cb.fits(*(x.double() for x in (q, k, v, bias)))
    wide = torch.zeros(1, 1, 8, 256)
    assert not cb.fits(wide, wide, wide, torch.zeros(1, 1, 8, 8))                               # D > 128
    with pytest.raises(ValueError, match="bias \\[B,1,T,T\\]"):
        cb.attention(q, k, v, bias.expand(1, 4, 32, 32), 0.25)


def test_the_dispatch_hands_a_causal_bias_to_the_kernels_only_when_asked(monkeypatch):
    """kernels.attention takes these kernels for a training step's whole-sequence attention with a causal bias when
    MIXSCOPE_CAUSAL_BIAS=triton and the Triton path is taken (here forced, in the interpreter); otherwise, and for
    anything else, the reference, as before."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, bias = inputs(1, 4, 2, 24, 16, gen=gen)
    bias.requires_grad_(True)
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")

    def path(**kw):
        with kernels.record_paths() as paths:
            out, _ = kernels.attention(q, k, v, scale=0.25, bias=bias, **kw)
        return paths["attention"], out
    assert path(bias_is_causal=True)[0] == "reference"  # (PyTorch's kernel: CUDA only)
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "triton")
    took, out = path(bias_is_causal=True)
    assert took == "triton"
    torch.testing.assert_close(out, naive(q, k, v, bias, 0.25).detach(), atol=1e-5, rtol=1e-4)
    assert path(bias_is_causal=False)[0] == "reference"  # a bias not promised causal: SDPA builds the mask
    with torch.no_grad():
        assert path(bias_is_causal=True)[0] == "triton"  # no gradient: inference's prefill kernel, as before
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    assert path(bias_is_causal=True)[0] == "reference"
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "yes")
    with pytest.raises(ValueError, match="0, 1 or triton"):
        path(bias_is_causal=True)


def test_a_pruned_training_step_in_the_kernels_equals_the_reference_step(monkeypatch):
    """A pruned model's loss and every gradient, its attention in these kernels (all other ops too in the
    interpreter), equal the step on the reference path."""
    cfg = tiny_config("gqa", n_kv_heads=2, positions="rope", context=40, d_model=32, prune=True, prune_sinks=2)
    torch.manual_seed(0)
    model = DecoderLM(cfg).train()
    randomize(model, std=0.2)
    with torch.no_grad():  # the rule near its start: saturated gates would pass no gradient to it
        for blk in model.blocks:
            rule = blk.mixer.pruning
            rule.W_Qint.mul_(0.2), rule.W_Kint.mul_(0.2), rule.beta.fill_(0.0)
    model.set_alpha(2.5)
    idx = torch.randint(0, cfg.vocab_size, (2, 41), generator=torch.Generator().manual_seed(5))
    out = {}
    for forced, switch in (("reference", "1"), ("triton", "triton")):
        monkeypatch.setenv("MIXSCOPE_KERNELS", forced)
        monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", switch)
        model.zero_grad(set_to_none=True)
        with kernels.record_paths() as paths:
            res = model(idx[:, :-1], targets=idx[:, 1:])
            (res.loss + sparsity_loss(res.prune_mass, 0.3, pair_count(cfg.n_layers, 40))).backward()
        out[paths["attention"]] = (res.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss, got), (want_loss, want) = out["triton"], out["reference"]
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    for n, w in want.items():
        assert w is not None and float(w.norm()) > 0, n
        torch.testing.assert_close(got[n], w, atol=1e-5, rtol=1e-3, msg=n)
