"""The small ops of a one-token decode step, one launch each (kernels.reference says what they compute).

At batch 1 a decode step replayed from a CUDA graph costs about what its kernels cost one after another, and
most of them move a few kilobytes: in PyTorch the rotary embedding of q and k and the cache write are twelve
launches a layer (four products, two sums, two concatenations, two negations, two index copies), and more with the
pruning rule's key and the compacted cache's slot bookkeeping; SwiGLU's gate two, a residual sum and the norm after
it two. Here each is one. Each rounds where PyTorch rounds (the rotary's
products and sum, SwiGLU's silu and product, a norm once after its weight), so in half precision they give
PyTorch's bits, save where the GPU's compiler fuses a float32 product into its sum, its exponential differs in the
last place, or a norm sums in another order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotated(X, COS, SIN, offs, partner, first, m):
    """x * cos + (-x2, x1) * sin for one head, each product and the sum rounded to x's dtype."""
    x = tl.load(X + offs, mask=m, other=0.0)
    xp = tl.load(X + partner, mask=m, other=0.0)
    dt = x.dtype
    a = (x.to(tl.float32) * tl.load(COS + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
    b = (tl.where(first, -xp, xp).to(tl.float32) * tl.load(SIN + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _step_write_kernel(Q, K, V, KI, COS, SIN, AT, QO, KB, VB, KIB, LIVE, POS, QPOS, CUR,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, ski_b, so_b, so_h, sat,
                       skb_b, skb_h, skb_s, svb_b, svb_h, svb_s, skib_b, skib_s, sl_b, sp_b, sqp_b,
                       HQ, G, D, HALF, RI, S, P,
                       ROTATE: tl.constexpr, HAS_V: tl.constexpr, HAS_KI: tl.constexpr, HAS_SLOTS: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_RI: tl.constexpr):
    """Program (b, h), every write at the cursor's slot of row b (none past the S slots the cache has: the caller
    checks for room first):
    h < HQ (ROTATE): query head h rotated into QO;
    HQ <= h < HQ + G: key group g = h - HQ (rotated with ROTATE) into KB, value group g into VB (HAS_V);
    h = HQ + G: the rule's key K_int into KIB (HAS_KI); the slot's position QPOS[b] into POS and its live bit
    (HAS_SLOTS: the compacted cache's slots).
    With ROTATE row b is at position AT[b * sat] (sat 0: every row at one), its angles that row of the [P, D]
    tables. The callers keep positions under P (the context): a row past the tables would write neither its q
    nor its K and V (K_int, the position and the live bit still go in)."""
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: batch x groups x slots x width passes 2^31 in a big cache
    h = tl.program_id(1)
    slot = tl.load(CUR)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    if ROTATE:
        at = tl.load(AT + b * sat)
        COS += at * D
        SIN += at * D
        m = m & ((offs * 0 + at) < P)  # (broadcast first: the interpreter refuses a scalar bool in a mask)
    w = m & ((offs * 0 + slot) < S)
    if h < HQ:
        y = _rotated(Q + b * sq_b + h * sq_h, COS, SIN, offs, partner, first, m)
        tl.store(QO + b * so_b + h * so_h + offs, y, mask=m)
    elif h < HQ + G:
        g = h - HQ
        if ROTATE:
            y = _rotated(K + b * sk_b + g * sk_h, COS, SIN, offs, partner, first, m)
        else:
            y = tl.load(K + b * sk_b + g * sk_h + offs, mask=m)
        tl.store(KB + b * skb_b + g * skb_h + slot * skb_s + offs, y.to(KB.dtype.element_ty), mask=w)
        if HAS_V:
            val = tl.load(V + b * sv_b + g * sv_h + offs, mask=m)
            tl.store(VB + b * svb_b + g * svb_h + slot * svb_s + offs, val.to(VB.dtype.element_ty), mask=w)
    else:
        if HAS_KI:
            offs_i = tl.arange(0, BLOCK_RI)
            wi = (offs_i < RI) & ((offs_i * 0 + slot) < S)
            ki = tl.load(KI + b * ski_b + offs_i, mask=offs_i < RI)
            tl.store(KIB + b * skib_b + slot * skib_s + offs_i, ki.to(KIB.dtype.element_ty), mask=wi)
        if HAS_SLOTS:
            if slot < S:
                tl.store(POS + b * sp_b + slot, tl.load(QPOS + b * sqp_b))
                tl.store(LIVE + b * sl_b + slot, 1)


def _rows_of(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"step_write takes {what} whose last dimension is contiguous")
    return t


def step_write(q, new, buffers, cursor, rope=None, slots=None):
    k, v, ki = new["k"], new.get("v"), new.get("k_int")
    if set(new) != set(buffers) or not set(new) <= {"k", "v", "k_int"}:
        raise ValueError(f"step_write writes the cache's entries {sorted(buffers)}, got {sorted(new)}")
    kb, vb, kib = buffers["k"], buffers.get("v"), buffers.get("k_int")
    b, g, t, d = k.shape
    if t != 1 or (v is not None and v.shape != k.shape) or (ki is not None and ki.shape[-2] != 1):
        raise ValueError("step_write takes one new position per row")
    if kb.dtype != k.dtype or (v is not None and vb.dtype != v.dtype) or (ki is not None and kib.dtype != ki.dtype):
        raise ValueError("step_write writes into caches of the new positions' dtype")
    for x, what in ((k, "k"), (v, "v"), (kb, "the K cache"), (vb, "the V cache"), (ki, "K_int"),
                    (kib, "the K_int cache")):
        if x is not None:
            _rows_of(x, what)
    dummy = k.new_empty(1)
    hq, out = 0, q
    cos = sin = at = dummy
    sat = p = 0
    if rope is not None:
        cos, sin, at = rope
        hq = q.shape[1]
        if q.shape[2] != 1 or q.shape[3] != d or d % 2 or q.stride(-1) != 1:
            raise ValueError("step_write rotates one query position per row, as wide as k (an even width), "
                             "its last dimension contiguous")
        if q.dtype != k.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
            raise ValueError("step_write takes q, k and the angles in one dtype")
        if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or not (cos.is_contiguous() and
                                                                                 sin.is_contiguous()):
            raise ValueError(f"step_write takes contiguous angle tables [positions, {d}]")
        if at.dtype != torch.int64 or at.dim() != 1 or at.numel() not in (1, b):
            raise ValueError("step_write takes the positions as int64 [1] (every row) or [B]")
        sat, p = (0 if at.numel() == 1 else at.stride(0)), cos.shape[0]
        out = torch.empty(b, hq, 1, d, dtype=q.dtype, device=q.device)
    live = pos = q_pos = dummy
    if slots is not None:
        live, pos, q_pos = slots
        if live.dtype != torch.bool or pos.dtype != torch.int64 or q_pos.dtype != torch.int64:
            raise ValueError("step_write takes the slots' live mask (bool), positions and new positions (int64)")
        live, pos = _rows_of(live, "the live mask").view(torch.uint8), _rows_of(pos, "the positions")
    ri = 1 if ki is None else ki.shape[-1]
    ki_t = dummy if ki is None else ki.reshape(b, ri)
    extra = int(ki is not None or slots is not None)
    _step_write_kernel[(b, hq + g + extra)](
        q, k, dummy if v is None else v, ki_t, cos, sin, at, out, kb, dummy if vb is None else vb,
        dummy if kib is None else kib, live, pos, q_pos, cursor,
        q.stride(0) if hq else 0, q.stride(1) if hq else 0, k.stride(0), k.stride(1),
        0 if v is None else v.stride(0), 0 if v is None else v.stride(1), ki_t.stride(0) if ki is not None else 0,
        out.stride(0), out.stride(1), sat,
        kb.stride(0), kb.stride(1), kb.stride(2), 0 if vb is None else vb.stride(0), 0 if vb is None else vb.stride(1),
        0 if vb is None else vb.stride(2), 0 if kib is None else kib.stride(0), 0 if kib is None else kib.stride(-2),
        live.stride(0) if slots is not None else 0, pos.stride(0) if slots is not None else 0,
        q_pos.stride(0) if slots is not None else 0,
        hq, g, d, d // 2, ri, kb.shape[2], p,
        ROTATE=rope is not None, HAS_V=v is not None, HAS_KI=ki is not None, HAS_SLOTS=slots is not None,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_RI=triton.next_power_of_2(ri))
    return out


@triton.jit
def _silu_mul_kernel(G, U, OUT, N, sg, su, BLOCK: tl.constexpr):
    """Program (row, block): one block of a row; g and u read by their row strides (the two halves of one packed
    gate-and-up product are read in place), out contiguous."""
    r = tl.program_id(0).to(tl.int64)  # 64-bit: a long prefill passes 2^31
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(G + r * sg + i, mask=m, other=0.0)
    u = tl.load(U + r * su + i, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(OUT + r * N + i, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


SILU_BLOCK = 1024


def silu_mul(g, u):
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError("silu_mul takes two tensors of one shape and dtype")
    n = g.shape[-1] if g.dim() else 1
    gr, ur = g.reshape(-1, n), u.reshape(-1, n)  # views where the rows are evenly strided
    gr, ur = (t if t.stride(-1) == 1 else t.contiguous() for t in (gr, ur))
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if out.numel():
        _silu_mul_kernel[(gr.shape[0], triton.cdiv(n, SILU_BLOCK))](gr, ur, out, n, gr.stride(0), ur.stride(0),
                                                                    BLOCK=SILU_BLOCK)
    return out


@triton.jit
def _add_norm_kernel(X, H, W, B, S, Y, D, eps, sx, sh, ss, sy, HAS_H: tl.constexpr, HAS_W: tl.constexpr,
                     HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program r: row r's sum s = x + h (rounded to x's dtype, as PyTorch stores it) into S, and its norm into Y,
    computed in float32 with weight (and bias) applied before the one rounding to the dtype, as torch's norms
    round."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(X + r * sx + offs, mask=m, other=0.0)
    dt = x.dtype
    if HAS_H:
        x = (x.to(tl.float32) + tl.load(H + r * sh + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
        tl.store(S + r * ss + offs, x, mask=m)
    s = x.to(tl.float32)
    if RMS:
        y = s * tl.rsqrt(tl.sum(s * s, axis=0) / D + eps)
        if HAS_W:
            y = y * tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    else:
        mean = tl.sum(s, axis=0) / D
        c = tl.where(m, s - mean, 0.0)
        y = c * tl.rsqrt(tl.sum(c * c, axis=0) / D + eps)
        if HAS_W:
            y = y * tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + r * sy + offs, y.to(dt), mask=m)


def add_norm(x, h, weight, bias, eps, rms):
    d = x.shape[-1]
    if h is not None and (h.shape != x.shape or h.dtype != x.dtype):
        raise ValueError("add_norm adds two tensors of one shape and dtype")
    for t in (weight, bias):
        if t is not None and (t.shape != (d,) or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"add_norm takes a contiguous affine weight and bias of shape ({d},) in x's dtype")
    rows = x.reshape(-1, d)  # a view unless x's rows are not evenly strided (then a copy)
    hs = None if h is None else h.reshape(-1, d)
    if rows.stride(-1) != 1 or (hs is not None and hs.stride(-1) != 1):
        rows, hs = rows.contiguous(), None if hs is None else hs.contiguous()
    s = x if h is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s_rows = rows if h is None else s.view(-1, d)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(-1, d)
    if rows.shape[0]:
        _add_norm_kernel[(rows.shape[0],)](
            rows, rows if hs is None else hs, rows if weight is None else weight, rows if bias is None else bias,
            s_rows, y_rows, d, eps, rows.stride(0), 0 if hs is None else hs.stride(0), s_rows.stride(0),
            y_rows.stride(0), HAS_H=hs is not None, HAS_W=weight is not None, HAS_B=bias is not None, RMS=rms,
            BLOCK_D=triton.next_power_of_2(d))
    return s, y


@triton.jit
def _rule_product_kernel(X, W, Y, D, N, sx, sw, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row, block of columns): y = float32(x) @ w over d in blocks, in float32 (no tl.dot: one row)."""
    r = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        x = tl.load(X + r * sx + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs_d[:, None] * sw + offs_n[None, :], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.sum(x[:, None] * w.to(tl.float32), 0)
    tl.store(Y + r * N + offs_n, acc, mask=n_mask)


RULE_BLOCK_D, RULE_BLOCK_N = 64, 32


def rule_product(x, w):
    d, n = w.shape
    if x.shape[-1] != d or w.dtype != torch.float32 or w.stride(-1) != 1:
        raise ValueError(f"rule_product takes x [..., {d}] and a float32 weight [d, n] with contiguous rows")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _rule_product_kernel[(rows.shape[0], triton.cdiv(n, RULE_BLOCK_N))](
            rows, w, y, d, n, rows.stride(0), w.stride(0), BLOCK_D=RULE_BLOCK_D, BLOCK_N=RULE_BLOCK_N)
    return y
