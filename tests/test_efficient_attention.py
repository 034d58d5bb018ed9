"""A pruned training step's attention on CUDA (kernels.efficient): PyTorch's memory-efficient kernel with the log I
bias and its own causal mask, which leaves the bias's gradient above the diagonal unwritten. The kernel itself runs
only on a GPU (tests/test_gpu.py holds it to SDPA); here, on the CPU: which calls may take it, and that a gradient of
log I holding garbage above the diagonal changes nothing in a training step, through either keep backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import efficient
from models.pruning import pair_count, sparsity_loss
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)


def qkvb(b=2, h=4, t=32, d=16, g=None, dtype=torch.float32):
    q = torch.randn(b, h, t, d, dtype=dtype)
    k, v = (torch.randn(b, g or h, t, d, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(b, 1, t, t, dtype=dtype)


def test_which_shapes_the_kernel_takes():
    q, k, v, bias = qkvb()
    assert efficient.shapes_fit(q, k, v, bias)
    assert efficient.shapes_fit(*qkvb(dtype=torch.bfloat16))
    assert efficient.shapes_fit(*qkvb(g=2)) and efficient.shapes_fit(*qkvb(g=1))  # grouped K/V, repeated
    assert not efficient.shapes_fit(*qkvb(h=6, g=4))                              # groups that do not divide
    assert not efficient.shapes_fit(*qkvb(t=20))                                   # rows not 16-aligned
    assert not efficient.shapes_fit(q, k, v, bias.expand(2, 4, 32, 32))            # a bias per head
    assert not efficient.shapes_fit(q, k, v, bias.double())                        # two dtypes
    assert not efficient.shapes_fit(q, k[:, :, :16], v[:, :, :16], bias[..., :16])  # T != S (a cache)
    assert not efficient.shapes_fit(q, k, v, None)
    assert not efficient.shapes_fit(*qkvb(dtype=torch.float64))


def test_off_cuda_and_when_switched_off_training_attention_stays_on_sdpa(monkeypatch):
    q, k, v, bias = qkvb()
    bias.requires_grad_(True)
    assert not efficient.usable(q, k, v, bias)  # a CPU tensor
    with kernels.record_paths() as paths:
        kernels.attention(q, k, v, scale=0.25, bias=bias, bias_is_causal=True)
    assert paths["attention"] == "reference"
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "0")
    assert not efficient.enabled()
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "yes")
    with pytest.raises(ValueError, match="MIXSCOPE_CAUSAL_BIAS"):
        efficient.enabled()


def test_only_a_causal_bias_without_maps_or_lengths_is_offered_to_the_kernel(monkeypatch):
    """kernels.attention asks kernels.efficient only for a whole sequence's training attention whose bias the caller
    says is causal: not a plain causal mask, not the compacted cache's bias, not MHE's maps or a cache's lengths."""
    offered = []
    monkeypatch.setattr(efficient, "usable", lambda *a: offered.append(a) or False)
    q, k, v, bias = qkvb()
    bias.requires_grad_(True)
    maps = {"q_mul": torch.ones(4, 16)}
    for kw in (dict(bias_is_causal=False), dict(bias_is_causal=True, causal=False),
               dict(bias_is_causal=True, lengths=torch.full((2,), 32)), dict(bias_is_causal=True, **maps)):
        kernels.attention(q, k, v, scale=0.25, bias=bias, **kw)
    assert not offered
    with torch.no_grad():
        kernels.attention(q, k, v, scale=0.25, bias=bias, bias_is_causal=True)  # inference: no gradient
    assert not offered
    kernels.attention(q, k, v, scale=0.25, bias=bias, bias_is_causal=True)
    assert len(offered) == 1


def test_a_refused_call_runs_on_sdpa_and_turns_the_path_off_for_the_process(monkeypatch):
    monkeypatch.setattr(efficient, "_refused", [])
    monkeypatch.setattr(efficient, "usable", lambda q, k, v, bias: efficient.shapes_fit(q, k, v, bias)
                        and efficient.enabled())

    def refusing(*a):
        raise RuntimeError("no kernel for this")
    monkeypatch.setattr(efficient, "attention", refusing)
    q, k, v, bias = qkvb()
    bias.requires_grad_(True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.25)
    with pytest.warns(RuntimeWarning, match="no kernel for this"), kernels.record_paths() as paths:
        out, _ = kernels.attention(q, k, v, scale=0.25, bias=bias, bias_is_causal=True)
    assert paths["attention"] == "reference" and torch.equal(out, want)
    assert not efficient.enabled() and efficient._refused == ["no kernel for this"]


def test_out_of_memory_is_not_a_refusal(monkeypatch):
    """Running out of memory says nothing about the operator: it is raised, and the path stays on."""
    monkeypatch.setattr(efficient, "_refused", [])
    monkeypatch.setattr(efficient, "usable", lambda q, k, v, bias: efficient.shapes_fit(q, k, v, bias))

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(efficient, "attention", out_of_memory)
    q, k, v, bias = qkvb()
    with pytest.raises(torch.OutOfMemoryError):
        kernels.attention(q, k, v, scale=0.25, bias=bias.requires_grad_(True), bias_is_causal=True)
    assert efficient.enabled() and not efficient._refused


class _Unwritten(torch.autograd.Function):
    """Identity forward; backward leaves NaN in the bias's gradient wherever the causal kernel skips (strictly above
    the diagonal: worse than the kernel, which skips whole blocks and writes the diagonal blocks' masked entries)."""

    @staticmethod
    def forward(ctx, bias):
        return bias.clone()

    @staticmethod
    def backward(ctx, g):
        t = g.shape[-1]
        return g.masked_fill(torch.ones(t, t, dtype=torch.bool, device=g.device).triu(1), float("nan"))


def _cpu_stand_in(q, k, v, bias, scale):
    """What kernels.efficient.attention computes, on the CPU (its K/V repeated to every head as there), with its
    unwritten gradient above the diagonal."""
    b, h, t, _ = q.shape
    return F.scaled_dot_product_attention(q, efficient.heads(q, k), efficient.heads(q, v),
                                          attn_mask=_Unwritten.apply(bias.expand(b, h, t, t)), scale=scale)


def test_grouped_kv_repeated_to_heads_give_sdpas_grouped_attention_and_gradients():
    """heads() repeats group g to heads g R .. g R + R - 1, as SDPA's enable_gqa and kernels.reference read them:
    the same output, and K's and V's gradients summed back over each group's heads."""
    torch.manual_seed(0)
    q, k, v, bias = qkvb(h=6, g=2)
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(ins[0], efficient.heads(ins[0], ins[1]), efficient.heads(ins[0], ins[2]),
                                         attn_mask=bias, scale=0.25)
    out.sum().backward()
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=bias, scale=0.25, enable_gqa=True)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    for a, w in zip(ins, ref):
        torch.testing.assert_close(a.grad, w.grad)
    assert efficient.heads(q, q) is q


@pytest.mark.parametrize("mixer", [dict(mixer="mha"), dict(mixer="gqa", n_kv_heads=2, positions="rope")],
                         ids=lambda m: m["mixer"])
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_garbage_above_the_diagonal_of_log_is_gradient_changes_no_training_gradient(path, mixer, monkeypatch):
    """A training step whose attention leaves NaN in the gradient of log I above the diagonal gives the loss and
    gradients of the plain step, finite, through the reference keep backward and the Triton one (interpreter), with
    a K/V per head and grouped (repeated to the heads on this path, read by group on SDPA's)."""
    if path == "triton" and "log_keep" not in kernels.TRITON:
        pytest.skip("needs triton")
    monkeypatch.setenv("MIXSCOPE_KERNELS", path)
    cfg = tiny_config(**mixer, prune=True, prune_r=8, prune_sinks=1, prune_distance=True, context=32)
    model = DecoderLM(cfg).train()
    randomize(model, std=0.3)
    model.set_alpha(2.5)
    ids = torch.randint(0, cfg.vocab_size, (2, 33))

    def step():
        model.zero_grad(set_to_none=True)
        with kernels.record_paths() as paths:
            res = model(ids[:, :-1], targets=ids[:, 1:])
            (res.loss + sparsity_loss(res.prune_mass, 0.3, pair_count(cfg.n_layers, 32))).backward()
        return paths, res.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    paths, want_loss, want = step()
    assert paths["attention"] == "reference" and paths["log_keep_grad"] == path
    monkeypatch.setattr(efficient, "usable", lambda q, k, v, bias: efficient.shapes_fit(q, k, v, bias))
    monkeypatch.setattr(efficient, "attention", _cpu_stand_in)
    paths, got_loss, got = step()
    assert paths["attention"] == "efficient" and paths["log_keep_grad"] == path
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.isfinite(got[n]).all(), n
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6 * float(want[n].abs().max()), msg=n)
