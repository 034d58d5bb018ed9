"""A pruned model's training attention in Triton, forward and backward: softmax(q k^T * scale + bias) v under the
causal mask, where bias [B,1,T,T] (the layer's log I) is shared by the heads and carries a gradient.

Why a kernel of our own: given a bias with a gradient, SDPA runs PyTorch's memory-efficient kernel. Handed log I
alone, every block computed (before kernels.efficient gave it the causal mask too, which is not yet timed), it took
5.9 ms of a pruned step's device time on an H200 against 2.0 ms of cuDNN flash for the dense twin
(bench/results/archive/train_step_profile_mha-pruned_h200.json). It writes the bias's gradient once per head, [B,H,T,T],
which autograd then sums over the heads (aten::sum had 1.0 ms of that step, every sum of the step counted), and
kernels.efficient repeats grouped K/V to every head for it. Here:

- the backward adds each head's share of the bias's gradient into one float32 [B,1,T,T] as it goes (atomic adds:
  the heads' order varies between runs, so the gradient's last bits do too);
- grouped K/V (GQA, MQA) are read in place, and their gradients summed over each group's heads inside the kernel;
- blocks wholly above the diagonal are skipped both ways, and the bias's gradient there is an exact zero.

Contract (kernels.efficient's): q [B,H,T,D], k/v [B,G,T,D], G dividing H, head h reads group h // (H/G); bias
[B,1,T,T] in q's dtype; the causal mask applies whatever bias holds above the diagonal. A row whose every allowed
score is -inf (a bias of -inf on the diagonal, which log I never has: I_kk = 1) outputs zeros and passes no
gradient, where SDPA would give NaN.

The products run in the inputs' dtype (bf16 tensor cores under autocast; IEEE float32 for float32 inputs, and in the
CPU interpreter, whose bf16 tl.dot is broken); softmax statistics and accumulators are float32. Softmax runs in base
2 as in kernels.triton_attention. Launch shapes are untuned (`bench.kernels` and the profile's A/B time them;
tests/test_kernels_compile.py checks they compile for sm_90 without spilling).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import LOG2E, _pow2, precision

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 128  # head widths beyond this would hold too many registers per tile
MAX_ROWS = 65535  # batch x heads: the grids' second axis
MAX_T = 46340  # a row's offsets into the bias and its gradient (t x t) stay within int32
DELTA_ROWS, DELTA_WARPS = 64, 8  # query rows a program of the delta pass reads, and its warps

# (block_m, block_n, num_warps, num_stages) of each kernel: "forward", "kv" (a program holds a key block's K, V and
# their gradients while query blocks stream past), "q" (a query block's q, dO and dq while key blocks stream past).
# Chosen so that ptxas spills nothing for sm_90 under Triton 3.6 and 3.9 in half types (tests/test_kernels_compile.py;
# float32's q kernel spills 12 bytes under 3.6 at d = 64), not timed.
LAUNCH = {
    "half": {"forward": (64, 64, 8, 3), "kv": (32, 64, 8, 2), "q": (64, 32, 8, 2)},        # d <= 64
    "half-128": {"forward": (64, 32, 8, 3), "kv": (32, 32, 8, 2), "q": (32, 32, 4, 2)},    # 64 < d <= 128
    "float32": {"forward": (32, 16, 8, 3), "kv": (16, 16, 8, 2), "q": (32, 16, 8, 2)},     # IEEE dots, any d
}


def launch(kernel: str, d: int, dtype: torch.dtype, t: int | None = None) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of `kernel` at head width d in dtype, blocks no longer than t."""
    kind = "float32" if dtype == torch.float32 else "half" if d <= 64 else "half-128"
    bm, bn, warps, stages = LAUNCH[kind][kernel]
    if t is not None:  # (16 at least: tl.dot's smallest operand)
        bm, bn = min(bm, _pow2(t)), min(bn, _pow2(t))
    return bm, bn, warps, stages


@triton.jit
def _logits(q, k, BIAS_B, offs_m, offs_n, m_mask, n_mask, sbt, sbs, qk_scale, PRECISION: tl.constexpr):
    """Scores of a [M] x [N] tile in log2 units, bias added, -inf wherever the causal mask or padding masks."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    tile = m_mask[:, None] & n_mask[None, :]
    bias = tl.load(BIAS_B + offs_m[:, None] * sbt + offs_n[None, :] * sbs, mask=tile, other=0.0)
    s = s + bias.to(tl.float32) * 1.4426950408889634
    return tl.where(tile & (offs_n[None, :] <= offs_m[:, None]), s, float("-inf"))


@triton.jit
def _query_block(Q, DO, LSE, DELTA, b, h, H, T, offs_m, offs_d, m_mask, d_mask, sqb, sqh, sqt, sdb, sdh, sdt):
    """What both backward kernels read of a query block of one head: q, dO, and each row's log-sum-exp and delta
    (padding rows: lse +inf, so their probabilities are 0)."""
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=qd_mask, other=0.0)
    row = (b * H + h) * T + offs_m
    lse = tl.load(LSE + row, mask=m_mask, other=float("inf"))
    delta = tl.load(DELTA + row, mask=m_mask, other=0.0)
    return q, do, lse, delta


@triton.jit
def _tile_grads(q, k, v, do, lse, delta, BIAS_B, offs_m, offs_n, m_mask, n_mask, sbt, sbs, qk_scale,
                PRECISION: tl.constexpr):
    """A tile's probabilities p and the gradient of its scores ds = p (dO v^T - delta), natural units: what both
    backward kernels turn into their gradients."""
    s = _logits(q, k, BIAS_B, offs_m, offs_n, m_mask, n_mask, sbt, sbs, qk_scale, PRECISION)
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _causal_bias_forward_kernel(Q, K, V, BIAS, O, LSE,
                                sqb, sqh, sqt, skb, skg, skt, svb, svg, svt, sbb, sbt, sbs, sob, soh, sot,
                                H, R, T, D, qk_scale,
                                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr):
    # query blocks on axis 0, the last (the most key blocks) first: the causal triangle's long programs start early
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)  # (at most 65,535: fits() says so)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: b x T x T overflows int32 for long sequences
    h = pid_bh % H
    g = h // R
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < T, offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, tl.minimum(T, (pid_m + 1) * BLOCK_M), BLOCK_N):  # key blocks up to the diagonal
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < T
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + b * skb + g * skg + offs_n[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _logits(q, k, BIAS + b * sbb, offs_m, offs_n, m_mask, n_mask, sbt, sbs, qk_scale, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays at 0
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(V + b * svb + g * svg + offs_n[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    # log2 of the softmax's denominator; +inf for a row that saw nothing, so the backward's exp2(s - lse) is 0 there
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])
    tl.store(LSE + (b * H + h) * T + offs_m, lse, mask=m_mask)


@triton.jit
def _causal_bias_delta_kernel(O, DO, DELTA, sob, soh, sot, sdb, sdh, sdt, H, T, D,
                              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """rowsum(dO * O) in float32 for one query block of one head: the softmax backward's correction, [B,H,T]."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < T
    tile = m_mask[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], mask=tile, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=tile, other=0.0)
    tl.store(DELTA + (b * H + h) * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=m_mask)


@triton.jit
def _causal_bias_kv_kernel(Q, K, V, BIAS, DO, LSE, DELTA, DK, DV,
                           sqb, sqh, sqt, skb, skg, skt, svb, svg, svt, sbb, sbt, sbs, sdb, sdh, sdt,
                           sgkb, sgkg, sgkt, sgvb, sgvg, sgvt,
                           G, R, T, D, qk_scale, scale,
                           PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """dK and dV of one key block of one group: the group's heads, each query block from the diagonal down."""
    pid_bg = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = (pid_bg // G).to(tl.int64)
    g = pid_bg % G
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_mask, d_mask = offs_n < T, offs_d < D
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + b * skb + g * skg + offs_n[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + g * svg + offs_n[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query block holding a row at or after this block's keys
    for r in range(0, R):
        h = g * R + r
        for start_m in range(first, T, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_mask = offs_m < T
            q, do, lse, delta = _query_block(Q, DO, LSE, DELTA, b, h, G * R, T, offs_m, offs_d, m_mask, d_mask,
                                             sqb, sqh, sqt, sdb, sdh, sdt)
            p, ds = _tile_grads(q, k, v, do, lse, delta, BIAS + b * sbb, offs_m, offs_n, m_mask, n_mask, sbt, sbs,
                                qk_scale, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    tl.store(DK + b * sgkb + g * sgkg + offs_n[:, None] * sgkt + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * sgvb + g * sgvg + offs_n[:, None] * sgvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _causal_bias_q_kernel(Q, K, V, BIAS, DO, LSE, DELTA, DQ, DB,
                          sqb, sqh, sqt, skb, skg, skt, svb, svg, svt, sbb, sbt, sbs, sdb, sdh, sdt, sgqb, sgqh, sgqt,
                          H, R, T, D, qk_scale, scale,
                          HAS_DB: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dq of one query block of one head, and that head's share of the bias's gradient over the same tiles."""
    # as the forward's grid: the heads of a batch row, which add into the same bias-gradient tiles, are far apart in
    # launch order, and the longest query blocks start first
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = h // R
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < T, offs_d < D
    q, do, lse, delta = _query_block(Q, DO, LSE, DELTA, b, h, H, T, offs_m, offs_d, m_mask, d_mask,
                                     sqb, sqh, sqt, sdb, sdh, sdt)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, tl.minimum(T, (pid_m + 1) * BLOCK_M), BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < T
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + b * skb + g * skg + offs_n[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + b * svb + g * svg + offs_n[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        _, ds = _tile_grads(q, k, v, do, lse, delta, BIAS + b * sbb, offs_m, offs_n, m_mask, n_mask, sbt, sbs,
                            qk_scale, PRECISION)  # (ds: the gradient of the scores, and so of the bias)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if HAS_DB:  # float32 [B,T,T]: every head of the batch row adds into the same tile
            tl.atomic_add(DB + b * T * T + offs_m[:, None] * T + offs_n[None, :], ds,
                          mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
    dq = dq * scale
    tl.store(DQ + b * sgqb + h * sgqh + offs_m[:, None] * sgqt + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether these kernels take the call: the contract's shapes, one dtype of the three for all four, D <= 128,
    B x H <= 65,535, T <= 46,340."""
    if bias is None or q.dim() != 4 or k.dim() != 4 or bias.dim() != 4:
        return False
    b, h, t, d = q.shape
    g = k.shape[1]
    return (g >= 1 and h % g == 0 and k.shape == (b, g, t, d) and v.shape == (b, g, t, d)
            and tuple(bias.shape) == (b, 1, t, t) and d <= MAX_D and b * h <= MAX_ROWS and t <= MAX_T
            and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype == bias.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t itself where its rows are contiguous (the kernels read any other layout through its strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _forward(q, k, v, bias, scale):
    b, h, t, d = q.shape
    g = k.shape[1]
    # laid out [B,T,H,D], as SDPA's kernels lay theirs out: the mixer's transpose back to [B,T,H*D] is then a view
    out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(b, h, t, dtype=torch.float32, device=q.device)
    bm, bn, warps, stages = launch("forward", d, q.dtype, t)
    _causal_bias_forward_kernel[(triton.cdiv(t, bm), b * h)](
        q, k, v, bias, out, lse, *_strides(q), *_strides(k), *_strides(v),
        bias.stride(0), bias.stride(2), bias.stride(3), *_strides(out),
        h, h // g, t, d, scale * LOG2E,
        PRECISION=precision(q.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pow2(d), num_warps=warps, num_stages=stages)
    return out, lse


def _backward(q, k, v, bias, out, lse, dout, scale, kv_grad: bool, bias_grad: bool):
    b, h, t, d = q.shape
    g = k.shape[1]
    dout = _rows(dout)
    # [B,H,T] rowsum(dO * O), the softmax backward's correction, in one pass (four of PyTorch's: two float32 copies,
    # their product, its sum)
    delta = torch.empty(b, h, t, dtype=torch.float32, device=q.device)
    _causal_bias_delta_kernel[(triton.cdiv(t, DELTA_ROWS), b * h)](
        out, dout, delta, *_strides(out), *_strides(dout), h, t, d, BLOCK_M=DELTA_ROWS, BLOCK_D=_pow2(d),
        num_warps=DELTA_WARPS)
    dq = torch.empty_like(q)
    # float32 [B,T,T], zeroed: every head adds into it, and blocks above the diagonal stay zero
    db = torch.zeros((b, t, t) if bias_grad else (1,), dtype=torch.float32, device=q.device)
    reads = (*_strides(q), *_strides(k), *_strides(v), bias.stride(0), bias.stride(2), bias.stride(3),
             *_strides(dout))
    bd, prec = _pow2(d), precision(q.dtype)
    dk = dv = None
    if kv_grad:  # (not when K and V need none: a frozen first layer under freeze_base)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        bm, bn, warps, stages = launch("kv", d, q.dtype, t)
        _causal_bias_kv_kernel[(b * g, triton.cdiv(t, bn))](
            q, k, v, bias, dout, lse, delta, dk, dv, *reads, *_strides(dk), *_strides(dv), g, h // g, t, d,
            scale * LOG2E, scale, PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps,
            num_stages=stages)
    bm, bn, warps, stages = launch("q", d, q.dtype, t)
    _causal_bias_q_kernel[(triton.cdiv(t, bm), b * h)](
        q, k, v, bias, dout, lse, delta, dq, db, *reads, *_strides(dq), h, h // g, t, d, scale * LOG2E, scale,
        HAS_DB=bias_grad, PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    return dq, dk, dv, (db.to(bias.dtype).unsqueeze(1) if bias_grad else None)


class _CausalBiasAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        # read in place through their strides (the mixers' q, k, v are transposed views): no copies
        q, k, v, bias = (_rows(x) for x in (q, k, v, bias))
        out, lse = _forward(q, k, v, bias, scale)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dv, db = _backward(q, k, v, bias, out, lse, dout, ctx.scale, need[1] or need[2], need[3])
        return dq, dk, dv, db, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the causal mask, for inputs `fits` accepts -> [B,H,T,D], with a
    backward for q, k, v and bias."""
    if not fits(q, k, v, bias):
        raise ValueError("triton_causal_bias.attention takes q [B,H,T,D], k/v [B,G,T,D] with G dividing H, "
                         f"bias [B,1,T,T], one dtype, D <= {MAX_D}, B x H <= {MAX_ROWS}, T <= {MAX_T}; got "
                         f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"bias {tuple(bias.shape)} {bias.dtype}")
    return _CausalBiasAttention.apply(q, k, v, bias, scale)
