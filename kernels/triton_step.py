"""The small ops of a one-token decode step, one launch each (kernels.reference says what they compute).

At batch 1 a decode step replayed from a CUDA graph costs about what its kernels cost one after another, and
most of them move a few kilobytes: in PyTorch the rotary embedding of q and k and the cache write are twelve
launches a layer (four products, two sums, two concatenations, two negations, two index copies), SwiGLU's gate
two, a residual sum and the norm after it two. Here each is one. Each rounds where PyTorch rounds (the rotary's
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
def _rope_write_kernel(Q, K, V, COS, SIN, AT, QO, KB, VB, CUR,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, so_b, so_h, sat,
                       skb_b, skb_h, skb_s, svb_b, svb_h, svb_s,
                       H, D, HALF, S, P, BLOCK_D: tl.constexpr):
    """Program (b, h): query head h < H is rotated into QO; h = H + g rotates key group g into the K cache at the
    cursor's slot and copies value group g into the V cache there (nothing is written at a slot past the S slots
    the cache has: the caller checks for room first). Row b is at position AT[b * sat] (sat 0: every row at one
    position), its angles that row of the [P, D] tables (none read past them)."""
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: batch x groups x slots x width passes 2^31 in a big cache
    h = tl.program_id(1)
    pos = tl.load(AT + b * sat)
    COS += pos * D
    SIN += pos * D
    offs = tl.arange(0, BLOCK_D)
    m = (offs < D) & ((offs * 0 + pos) < P)  # (broadcast first: the interpreter refuses a scalar bool in a mask)
    first = offs < HALF
    partner = tl.where(first, offs + HALF, offs - HALF)
    if h < H:
        y = _rotated(Q + b * sq_b + h * sq_h, COS, SIN, offs, partner, first, m)
        tl.store(QO + b * so_b + h * so_h + offs, y, mask=m)
    else:
        g = h - H
        slot = tl.load(CUR)
        w = m & ((offs * 0 + slot) < S)  # (broadcast first: the interpreter refuses a scalar bool in a mask)
        y = _rotated(K + b * sk_b + g * sk_h, COS, SIN, offs, partner, first, m)
        tl.store(KB + b * skb_b + g * skb_h + slot * skb_s + offs, y.to(KB.dtype.element_ty), mask=w)
        val = tl.load(V + b * sv_b + g * sv_h + offs, mask=m)
        tl.store(VB + b * svb_b + g * svb_h + slot * svb_s + offs, val.to(VB.dtype.element_ty), mask=w)


def rope_write(q, k, v, cos, sin, at, k_buf, v_buf, cursor):
    b, h, t, d = q.shape
    g = k.shape[1]
    if t != 1 or k.shape[2] != 1 or v.shape[2] != 1 or d % 2:
        raise ValueError("rope_write takes one new position per row and an even head width")
    if q.dtype != k.dtype or k.dtype != v.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError("rope_write takes q, k, v and the angles in one dtype")
    if k_buf.dtype != k.dtype or v_buf.dtype != v.dtype:
        raise ValueError("rope_write writes into caches of the new positions' dtype")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_buf, v_buf)):
        raise ValueError("rope_write takes tensors whose last dimension is contiguous")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d or not (cos.is_contiguous() and
                                                                             sin.is_contiguous()):
        raise ValueError(f"rope_write takes contiguous angle tables [positions, {d}]")
    if at.dtype != torch.int64 or at.dim() != 1 or at.numel() not in (1, b):
        raise ValueError("rope_write takes the positions as int64 [1] (every row) or [B]")
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    _rope_write_kernel[(b, h + g)](
        q, k, v, cos, sin, at, out, k_buf, v_buf, cursor,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        0 if at.numel() == 1 else at.stride(0),
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
        h, d, d // 2, k_buf.shape[2], cos.shape[0], BLOCK_D=triton.next_power_of_2(d))
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
