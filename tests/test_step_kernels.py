"""A decode step's small fused ops (kernels.triton_step): the cache writes with the rotary embedding, SwiGLU's gate,
and the residual sum with the next norm. Each reference against a naive form written from its equation, each
Triton kernel (interpreter, outputs poisoned) against its reference on fresh random inputs, whole models on
either path, and the number of kernels a step launches (bench.step_launches), which is what these ops are for."""
import math

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference, triton_step  # noqa: E402
from models.decode import Decoder  # noqa: E402
from models.mixers.attention import rotary_tables  # noqa: E402
from models.transformer import DecoderLM  # noqa: E402
from tests.helpers import randomize, tiny_config  # noqa: E402
from tests.test_kernels_triton import _Poisoned, close  # noqa: E402


@pytest.fixture(autouse=True)
def poisoned(monkeypatch, request):
    if "launches" not in request.node.name:  # a count of kernels must not count the poison's fills
        monkeypatch.setattr(triton_step, "torch", _Poisoned())


def naive_rotary(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Llama's rotary embedding from its definition: pair i of a head is (x_i, x_{i + D/2}), rotated by the angle
    pos * theta^(-2i/D), as the complex number x_i + i x_{i+D/2} times e^{i angle} (float64)."""
    d = x.shape[-1]
    h = d // 2
    out = torch.empty_like(x, dtype=torch.float64)
    for i in range(h):
        a = pos * theta ** (-2 * i / d)
        z = torch.complex(x[..., i].double(), x[..., i + h].double()) * complex(math.cos(a), math.sin(a))
        out[..., i], out[..., i + h] = z.real, z.imag
    return out


def test_rotate_half_is_the_rotary_embedding():
    x = torch.randn(2, 3, 1, 10, dtype=torch.float64)
    cos, sin = rotary_tables(torch.tensor([37]), 10, 500.0, torch.float64)
    assert torch.allclose(reference.rotate_half(x, cos, sin), naive_rotary(x, 37, 500.0), atol=1e-12)


def rope_case(b, h, g, d, s, slot, per_row=False, dtype=torch.float32):
    """per_row: each row at its own position (the compacted cache's rows), at [B]; else one position, at [1]. The
    angle tables cover positions 0..63."""
    q, k, v = torch.randn(b, h, 1, d, dtype=dtype), torch.randn(b, g, 1, d, dtype=dtype), torch.randn(b, g, 1, d,
                                                                                                      dtype=dtype)
    at = slot + 3 * torch.arange(b) if per_row else torch.tensor([slot])
    cos, sin = rotary_tables(torch.arange(64), d, 10000.0, dtype)
    bufs = torch.randn(b, g, s, d, dtype=dtype), torch.randn(b, g, s, d, dtype=dtype)
    return q, k, v, cos, sin, at, bufs, torch.tensor([slot])


def both(q, new, buffers, cursor, rope=None, slots=None):
    """step_write on copies of the buffers (and slots) by the reference and by the kernel: (want, got) as (q,
    buffers, slots)."""
    out = []
    for fn in (reference.step_write, triton_step.step_write):
        bufs = {n: t.clone() for n, t in buffers.items()}
        sl = None if slots is None else tuple(t.clone() for t in slots[:2]) + (slots[2],)
        out.append((fn(q, new, bufs, cursor, rope, sl), bufs, sl))
    return out


@pytest.mark.parametrize("b,h,g,d,s,slot,per_row", [(1, 9, 3, 64, 20, 7, False), (2, 4, 4, 16, 5, 0, False),
                                                    (3, 6, 1, 6, 9, 8, True), (1, 2, 2, 130, 3, 2, False),
                                                    (2, 9, 3, 64, 12, 11, True)])
def test_step_write_rotates_and_writes_as_the_reference(b, h, g, d, s, slot, per_row):
    q, k, v, cos, sin, at, (kb, vb), cursor = rope_case(b, h, g, d, s, slot, per_row)
    (want, wb, _), (got, gb, _) = both(q, {"k": k, "v": v}, {"k": kb, "v": vb}, cursor, (cos, sin, at))
    close(got, want, tol=1e-6)
    assert torch.allclose(gb["k"], wb["k"], atol=1e-6, rtol=0)
    assert torch.equal(gb["v"], wb["v"])  # V is copied, and nothing else in either buffer moved
    others = torch.arange(s) != slot
    assert torch.equal(gb["k"][:, :, others], kb[:, :, others]) and torch.equal(gb["v"][:, :, others], vb[:, :, others])
    for r in range(b):  # row r's key rotated by its own position
        p = slot + 3 * r if per_row else slot
        assert torch.allclose(gb["k"][r, :, slot], naive_rotary(k[r, :, 0], p, 10000.0).float(), atol=1e-5)


@pytest.mark.parametrize("kv_shared", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_step_write_writes_the_rules_key_and_the_compacted_slot(kv_shared, rotate):
    """Every write of a compacted cache's step in one launch: K (rotated or not), V unless K is V, the rule's
    K_int (a float32 view of a wider product, as the rule hands it), the slot's position and live bit; nothing
    else moves, and q comes back unrotated without rope."""
    b, h, g, d, s, r, slot = 3, 4, 2, 8, 10, 6, 4
    q, k, v, cos, sin, at, (kb, vb), cursor = rope_case(b, h, g, d, s, slot, per_row=True)
    qk = torch.randn(b, 1, 2 * r)
    new = {"k": k, "k_int": qk[..., r:]} | ({} if kv_shared else {"v": v})
    buffers = {"k": kb, "k_int": torch.randn(b, s, r)} | ({} if kv_shared else {"v": vb})
    slots = (torch.rand(b, s) < 0.5, torch.randint(-1, 40, (b, s)), torch.tensor([[7], [12], [30]]))
    rope = (cos, sin, at) if rotate else None
    (want, wb, ws), (got, gb, gs) = both(q, new, buffers, cursor, rope, slots)
    close(got, want, tol=1e-6)
    if not rotate:
        assert got is q
    for n in buffers:
        assert torch.allclose(gb[n], wb[n], atol=1e-6, rtol=0), n
    assert torch.equal(gs[0], ws[0]) and torch.equal(gs[1], ws[1])
    assert bool(gs[0][:, slot].all()) and torch.equal(gs[1][:, slot], slots[2][:, 0])
    others = torch.arange(s) != slot
    assert torch.equal(gb["k_int"][:, others], buffers["k_int"][:, others])
    assert torch.equal(gs[0][:, others], slots[0][:, others]) and torch.equal(gs[1][:, others], slots[1][:, others])


def test_step_write_reads_projections_in_place_and_refuses_what_it_cannot_write():
    """q and k as the mixer hands them (views of one projection, transposed), and the refusals."""
    b, h, g, d = 2, 4, 2, 8
    y = torch.randn(b, 1, (h + 2 * g) * d)
    q = y[..., :h * d].unflatten(-1, (h, d)).transpose(1, 2)
    k = y[..., h * d:(h + g) * d].unflatten(-1, (g, d)).transpose(1, 2)
    v = y[..., (h + g) * d:].unflatten(-1, (g, d)).transpose(1, 2)
    cos, sin = rotary_tables(torch.arange(8), d, 10000.0, torch.float32)
    at, cur = torch.tensor([3]), torch.tensor([3])
    rope = (cos, sin, at)
    new, bufs = {"k": k, "v": v}, {"k": torch.zeros(b, g, 6, d), "v": torch.zeros(b, g, 6, d)}
    (want, wb, _), (got, gb, _) = both(q, new, bufs, cur, rope)
    close(got, want, tol=1e-6)
    assert torch.allclose(gb["k"], wb["k"], atol=1e-6) and torch.equal(gb["v"], wb["v"])
    with pytest.raises(ValueError, match="one new position"):
        triton_step.step_write(q, {"k": torch.randn(b, g, 2, d), "v": torch.randn(b, g, 2, d)}, bufs, cur, rope)
    with pytest.raises(ValueError, match="one dtype"):
        triton_step.step_write(q.double(), new, bufs, cur, rope)
    with pytest.raises(ValueError, match="int64"):
        triton_step.step_write(q, new, bufs, cur, (cos, sin, at.int()))
    with pytest.raises(ValueError, match="angle tables"):
        triton_step.step_write(q, new, bufs, cur, (cos[3:4, None], sin[3:4, None], at))
    with pytest.raises(ValueError, match="entries"):
        triton_step.step_write(q, {"k": k}, bufs, cur, rope)
    with kernels.record_paths() as paths:  # a gradient: autograd's rotary and copies
        got = kernels.step_write(q.detach().requires_grad_(), new, bufs, cur, rope)
    assert paths["step_write"] == "reference" and got.requires_grad and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1, 1536), (3, 5, 7), (2, 1025)])
def test_silu_mul_matches_the_reference_and_its_equation(shape):
    g, u = torch.randn(shape) * 3, torch.randn(shape)
    want = reference.silu_mul(g, u)
    assert torch.allclose(want.double(), g.double() * torch.sigmoid(g.double()) * u.double(), atol=1e-6)
    close(triton_step.silu_mul(g, u), want, tol=1e-6)


@pytest.mark.parametrize("rows", [1, 3])
def test_silu_mul_reads_the_halves_of_a_packed_product_in_place(rows):
    """gate and up as the two halves of one [..., 2 d_ff] product (models.packing): row-strided views, read
    without a copy, the output contiguous."""
    gu = torch.randn(rows, 1, 2 * 1100) * 3
    g, u = gu.chunk(2, -1)
    got = triton_step.silu_mul(g, u)
    assert got.is_contiguous() and torch.allclose(got, reference.silu_mul(g, u), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,d,n", [(1, 576, 128), (3, 100, 40), (2, 16, 8)])
def test_rule_product_is_the_widened_product(dtype, rows, d, n):
    """The rule's projection of a half-precision hidden state in float32, one kernel: float32(x) @ w (in float64
    from the same half-precision values, to float32 rounding), read in place from a view of wider rows."""
    x = (torch.randn(rows, 1, d + 5) * 2).to(dtype)[..., :d]
    w = torch.randn(d, n)
    got = triton_step.rule_product(x, w)
    want = (x.double() @ w.double()).float()
    assert got.dtype == torch.float32 and got.shape == (rows, 1, n)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    assert torch.allclose(got, reference.rule_product(x, w), atol=1e-4, rtol=1e-5)


def test_rule_product_takes_the_reference_where_there_is_nothing_to_widen():
    w = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(2, 1, 8, dtype=torch.float64)
    with kernels.record_paths() as paths:
        assert torch.equal(kernels.rule_product(x, w), x @ w)  # float64 stays float64
    assert paths["rule_product"] == "reference"
    with pytest.raises(ValueError, match="float32 weight"):
        triton_step.rule_product(x.half(), w)


def naive_norm(s: torch.Tensor, w, b, eps: float, rms: bool) -> torch.Tensor:
    """RMSNorm: s / sqrt(mean(s^2) + eps) * w; LayerNorm: (s - mean) / sqrt(var + eps) * w + b (float64)."""
    s = s.double()
    if rms:
        y = s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)
    else:
        c = s - s.mean(-1, keepdim=True)
        y = c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps)
    y = y if w is None else y * w.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 37), (5, 1024), (3, 1, 1)])
@pytest.mark.parametrize("residual,affine", [(True, True), (False, True), (True, False)])
def test_add_norm_matches_the_reference_and_its_equation(rms, shape, residual, affine):
    d = shape[-1]
    x = torch.randn(shape) * 2 + 0.5
    h = torch.randn(shape) if residual else None
    w = 1 + 0.5 * torch.randn(d) if affine else None
    b = 0.3 * torch.randn(d) if affine and not rms else None
    s_ref, y_ref = reference.add_norm(x, h, w, b, 1e-5, rms)
    assert torch.equal(s_ref, x if h is None else x + h)
    assert torch.allclose(y_ref.double(), naive_norm(s_ref, w, b, 1e-5, rms), atol=1e-5)
    s, y = triton_step.add_norm(x, h, w, b, 1e-5, rms)
    close(y, y_ref, tol=1e-5)
    assert torch.equal(s, s_ref)


@pytest.mark.parametrize("rms", [True, False])
def test_add_norm_rounds_as_torch_in_half_precision(rms):
    """float16 (the interpreter rounds it as a GPU does; it truncates bfloat16): the stored sum is torch's to the
    bit, RMSNorm's output too (one rounding, after the weight), LayerNorm's within one unit in the last place
    (its mean is summed in another order)."""
    x, h = torch.randn(6, 576).half(), torch.randn(6, 576).half()
    w, b = (1 + 0.5 * torch.randn(576)).half(), (0.2 * torch.randn(576)).half()
    s_ref, y_ref = reference.add_norm(x, h, w, None if rms else b, 1e-5, rms)
    s, y = triton_step.add_norm(x, h, w, None if rms else b, 1e-5, rms)
    assert torch.equal(s, s_ref)
    if rms:
        assert torch.equal(y, y_ref)
    else:
        ulp = (y_ref.float().abs() * 2 ** -10).clamp_min(2 ** -24)
        assert bool(((y.float() - y_ref.float()).abs() <= ulp).all())


def test_step_write_and_silu_mul_round_as_torch_in_half_precision():
    q, k, v, cos, sin, at, (kb, vb), cursor = rope_case(2, 9, 3, 64, 12, 5, per_row=True, dtype=torch.float16)
    (want, wb, _), (got, gb, _) = both(q, {"k": k, "v": v}, {"k": kb, "v": vb}, cursor, (cos, sin, at))
    assert torch.equal(got, want) and torch.equal(gb["k"], wb["k"]) and torch.equal(gb["v"], wb["v"])
    g, u = torch.randn(4, 1536).half() * 3, torch.randn(4, 1536).half()
    got, want = triton_step.silu_mul(g, u), reference.silu_mul(g, u)
    assert (got != want).float().mean() < 1e-3  # the exponential may differ in its last place
    assert torch.allclose(got.float(), want.float(), rtol=2e-3, atol=1e-6)


def test_step_write_writes_nothing_past_the_cache():
    """A cursor at the end of the buffers (a caller that did not make room) writes nowhere; q is still rotated."""
    q, k, v, cos, sin, at, (kb, vb), _ = rope_case(2, 4, 2, 16, 6, 6)
    before = kb.clone(), vb.clone()
    slots = (torch.zeros(2, 6, dtype=torch.bool), torch.full((2, 6), -1), torch.tensor([[6], [6]]))
    new = {"k": k, "v": v, "k_int": torch.randn(2, 1, 4)}
    bufs = {"k": kb, "v": vb, "k_int": torch.zeros(2, 6, 4)}
    got = triton_step.step_write(q, new, bufs, torch.tensor([6]), (cos, sin, at), slots)
    close(got, reference.rotate_half(q, cos[at], sin[at]), tol=1e-6)
    assert torch.equal(kb, before[0]) and torch.equal(vb, before[1]) and not bufs["k_int"].any()
    assert not slots[0].any() and bool((slots[1] == -1).all())


def test_add_norm_reads_strided_rows():
    x = torch.randn(4, 6, 32)[:, ::2]   # rows evenly strided, not contiguous as a whole
    h = torch.randn(4, 3, 32)
    w = torch.randn(32)
    s_ref, y_ref = reference.add_norm(x, h, w, None, 1e-6, True)
    s, y = triton_step.add_norm(x, h, w, None, 1e-6, True)
    assert torch.equal(s, s_ref)
    close(y, y_ref, tol=1e-5)


def test_the_norms_take_the_reference_with_a_gradient_and_give_the_module_answers(monkeypatch):
    """Training runs the reference (autograd owns the backward); the model's norm modules give torch's own."""
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    model = DecoderLM(tiny_config("gqa", norm="rmsnorm", positions="rope", ffn="swiglu", n_kv_heads=2))
    x, h = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16)
    with kernels.record_paths() as paths:
        s, y = model.blocks[0].ln_2(x, h)
    assert paths == {"add_norm": "reference"}
    y.sum().backward()
    assert x.grad is not None
    ln = model.blocks[0].ln_1
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    with torch.no_grad():
        assert torch.equal(ln(x), torch.nn.RMSNorm.forward(ln, x))
        assert torch.equal(s, x + h) and torch.equal(y, torch.nn.RMSNorm.forward(ln, x + h))
        ln = DecoderLM(tiny_config("mha")).blocks[0].ln_1
        assert torch.equal(ln(x), torch.nn.LayerNorm.forward(ln, x))


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_a_forward_without_gradient_under_autocast_runs_as_before(norm, monkeypatch):
    """Training's distillation teacher: no gradient, bf16 autocast, a float32 residual stream meeting bf16 sums.
    The norms fall back to torch's (float32 under autocast) instead of refusing the mixed dtypes."""
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, norm=norm, positions="rope", ffn="swiglu"))
    idx = torch.randint(0, 61, (2, 9))
    outs = {}
    # the step ops on Triton, attention on the reference (the interpreter's bf16 dots are not a GPU's)
    monkeypatch.setattr(kernels, "TRITON", {op: f for op, f in kernels.TRITON.items() if op in ("add_norm",
                                                                                                 "silu_mul")})
    for path in ("reference", "triton"):
        monkeypatch.setenv("MIXSCOPE_KERNELS", path)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), kernels.record_paths() as paths:
            outs[path] = model(idx).logits.float()
    assert paths.get("add_norm") == "reference" and paths.get("silu_mul") == "triton"
    # the norms are torch's own; SwiGLU's gate is the kernel's (bf16, which the interpreter truncates)
    assert torch.allclose(outs["triton"], outs["reference"], rtol=0.05, atol=0.02)


SMOLLM2_LIKE = dict(mixer="gqa", n_kv_heads=2, norm="rmsnorm", positions="rope", ffn="swiglu", ffn_bias=False)


def decode(model, idx, n_prompt):
    dec = Decoder(model, idx.shape[0], "static", fixed=True)
    with torch.inference_mode():
        out = [dec.prefill(idx[:, :n_prompt].tolist(), last_only=False)]
        out += [dec.step(idx[:, i])[:, None] for i in range(n_prompt, idx.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("overrides", [SMOLLM2_LIKE, dict(mixer="mha"), dict(mixer="mqa", positions="rope")],
                         ids=["smollm2-like", "mha-layernorm-gelu", "mqa-rope"])
def test_static_shape_decode_on_the_fused_kernels_equals_the_reference_and_the_full_forward(overrides, monkeypatch):
    model = DecoderLM(tiny_config(**overrides)).eval()
    randomize(model, std=0.3, seed=5)
    idx = torch.randint(0, 61, (2, 16))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    want = decode(model, idx, 5)
    with torch.inference_mode():
        full = model(idx).logits
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    dec = Decoder(model, 2, "static", fixed=True)
    with torch.inference_mode():
        got = [dec.prefill(idx[:, :5].tolist(), last_only=False)]
        got += [dec.step(idx[:, i])[:, None] for i in range(5, 16)]
    got = torch.cat(got, 1)
    assert torch.allclose(want, full, atol=1e-4, rtol=1e-4)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    fused = {"add_norm"} | ({"silu_mul"} if overrides.get("ffn") == "swiglu" else set()) | (
        {"step_write"})
    assert {op for op, path in dec.kernel_paths.items() if path == "triton"} >= fused


def layer_cost(state: str = "static", dtype=torch.float32, **overrides) -> "Counter":  # noqa: F821
    """The kernels one more layer adds to a fixed-shape batch-1 step (a 3-layer model's count less a 2-layer one's,
    same shapes): what the per-step constant (embedding, rotary angles, final norm, head) does not blur."""
    from collections import Counter

    from bench.step_launches import count_step
    counts = []
    for n_layers in (2, 3):
        torch.manual_seed(0)
        cfg = tiny_config(**{**overrides, "n_layers": n_layers}, context=64)
        counts.append(count_step(DecoderLM(cfg).to(dtype).eval(), state, prompt=6, capacity=32))
    diff = Counter(counts[1])
    diff.subtract(counts[0])
    return +diff


def test_a_smollm2_shaped_layer_launches_nine_kernels_a_step():
    """An RMSNorm, rotary GQA, SwiGLU layer: the previous layer's residual sum with its norm, q|k|v (one packed
    product), rotary + cache write, the decode (its splits merged by the last of them), W_O, residual sum + norm,
    gate|up (one product), their silu product, down. Before the fused ops a GPU launched 28 (the rotary ten and
    the cache write two, SwiGLU's gate two, both residual sums apart from their norms, a merge kernel), before the
    packing 14; nothing elementwise may creep back in."""
    cost = layer_cost(**SMOLLM2_LIKE)
    assert sum(cost.values()) == 9, cost
    assert cost["mm"] == 4 and cost["triton:_add_norm_kernel"] == 2 and cost["triton:_step_write_kernel"] == 1
    assert cost["triton:_silu_mul_kernel"] == 1 and "add" not in cost and "triton:_merge_kernel" not in cost, cost


def test_a_zoo_layer_launches_its_norms_with_the_residual_sums():
    """A LayerNorm, GELU, learned-position MHA layer (the zoo): 4 + 1 (biased W_O) + ... each norm with the sum
    before it in one kernel."""
    cost = layer_cost(mixer="mha")
    assert cost["triton:_add_norm_kernel"] == 2 and "native_layer_norm" not in cost, cost


def test_a_pruned_smollm2_shaped_layer_on_the_compacted_cache_launches_ten_kernels_a_step():
    """The same layer with the learned rule over the compacted cache: the rule's [W^Qint | W^Kint] product, the
    fused decode that scores, attends, keeps and notes its drops in the cache (it was four more kernels a layer
    after it), and one write of everything the step stores (K, V, K_int, the slot's position and live bit: five
    kernels and the cursor's step before); the cursors move on once a step, for every layer."""
    cost = layer_cost("compacted", **SMOLLM2_LIKE, prune=True)
    assert sum(cost.values()) == 10, cost
    assert cost["mm"] == 5 and cost["triton:_decode_kernel"] == 1 and cost["triton:_step_write_kernel"] == 1, cost
    assert not {"where", "bitwise_xor", "copy_"} & set(cost), cost


def test_in_bf16_a_pruned_layer_launches_no_widening_copy():
    """In bf16 the rule's projection reads the half-precision hidden state and computes in float32 in one kernel
    (it was a widening copy and a product): the same ten kernels as in float32."""
    cost = layer_cost("compacted", dtype=torch.bfloat16, **SMOLLM2_LIKE, prune=True)
    assert sum(cost.values()) == 10 and cost["triton:_rule_product_kernel"] == 1 and "_to_copy" not in cost, cost


def test_a_fixed_step_with_a_gradient_rotates_in_pytorch():
    """Outside inference mode, with parameters that want gradients, a fixed-shape step keeps PyTorch's rotary
    (the fused kernel has no backward) and still equals the full forward."""
    model = DecoderLM(tiny_config(**SMOLLM2_LIKE)).eval()
    randomize(model, std=0.3, seed=2)
    idx = torch.randint(0, 61, (1, 8))
    dec = Decoder(model, 1, "static", fixed=True)
    with kernels.record_paths() as paths:
        out = [dec.prefill(idx[:, :4].tolist(), last_only=False)] + [dec.step(idx[:, i])[:, None] for i in range(4, 8)]
    assert paths.get("step_write") == "reference"  # index copies, in autograd's view
    with torch.no_grad():
        assert torch.allclose(torch.cat(out, 1), model(idx).logits, atol=1e-5)


def test_a_fixed_step_where_only_the_rule_wants_a_gradient_equals_the_full_forward(monkeypatch):
    """The base frozen, the learned rule's projections wanting gradients, outside inference mode: q, k and v need
    none, so the step rotates in the write, whose K_int needs one: the write takes the reference, rotary and all
    (it raised before), and the step equals the full forward."""
    model = DecoderLM(tiny_config(**SMOLLM2_LIKE, prune=True, prune_beta=0.3)).eval()
    randomize(model, std=0.3, seed=4)
    for name, p in model.named_parameters():
        p.requires_grad_(".pruning." in name)
    idx = torch.randint(0, 61, (1, 8))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    dec = Decoder(model, 1, "static", fixed=True)
    with kernels.record_paths() as paths:
        out = [dec.prefill(idx[:, :4].tolist(), last_only=False)] + [dec.step(idx[:, i])[:, None] for i in range(4, 8)]
    assert paths.get("step_write") == "reference"
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    with torch.no_grad():
        assert torch.allclose(torch.cat(out, 1), model(idx).logits, atol=1e-4)


def test_a_full_compacted_cache_refuses_the_step_before_writing():
    """The rotary step writes K and V at the cursor without a bound on the device: the host check comes first."""
    model = DecoderLM(tiny_config(context=64, prune=True, **SMOLLM2_LIKE)).eval()
    dec = Decoder(model, 1, "compacted", capacity=16, fixed=True)
    with torch.inference_mode():
        dec.prefill([list(range(5))])
        layer = dec.state.layers[0]
        layer.end = layer.capacity  # as if no room had been made
        k_before = layer.buffers["k"].clone()
        with pytest.raises(RuntimeError, match="make_room"):
            dec.model(torch.tensor([[7]]), cache=dec.state, last_only=True)
        assert torch.equal(layer.buffers["k"], k_before)


def test_the_learned_rule_adds_seventeen_kernels_a_layer_to_a_training_step():
    """A training step of a pruned model waits on the host on a GPU (an H200 was busy 24 of its 42-51 ms), so
    what the rule dispatches a layer is held here (bench.train_launches: bf16 autocast, the Triton keep kernels,
    attention counted as CUDA runs it), the difference between a 3-layer and a 2-layer model less the dense twins'.
    Forward: Q_int and K_int (two products), the scores with their scale and bias in one (baddbmm), the keep
    kernel, which also sums the mass, that sum's strips, and the mass into the loss; backward: the keep kernel, the
    bias's gradient summed over the heads, the scores' two products with their scale inside, beta's sum, the two
    weights' and the input's gradients (four products, two sums into x's). It was 25 before the mass moved into the
    kernel (its tril, sum and mean, and their backward), the scores into one product (a scale and a bias each way,
    then K's gradient made contiguous), log I into attention's dtype (a cast each way) and the positions to where
    the distance term needs them; against a dense twin that then still built a causal mask (three kernels a layer,
    SDPA's own flag since)."""
    from collections import Counter

    from bench.train_launches import count
    counts = {}
    for n_layers in (2, 3):
        for prune in (False, True):
            torch.manual_seed(0)
            model = DecoderLM(tiny_config("mha", n_layers=n_layers, prune=prune, prune_r=8, context=32)).train()
            counts[n_layers, prune] = Counter(count(model, 1.7 if prune else None, 2, 32)["by_op"])
    rule = counts[3, True]
    rule.subtract(counts[2, True])
    rule.subtract(counts[3, False])
    rule.update(counts[2, False])
    rule = {op: n for op, n in rule.items() if n}
    assert sum(rule.values()) == 17, rule
    assert rule["triton:_forward_kernel"] == rule["triton:_backward_kernel"] == 1 and rule["baddbmm"] == 3, rule
    assert rule["mm"] == 6 and rule["sum"] == 2, rule
    # the mass, the scale, the cast and the transposed gradient stay fused
    assert not {"tril", "mean", "div", "mul", "_to_copy", "clone", "bmm"} & rule.keys(), rule
