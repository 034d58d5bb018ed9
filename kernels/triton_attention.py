"""Fused causal attention in Triton: prefill (flash-style) and split-KV decode, for query heads that share
key/value groups, with the head-embedding (MHE) query and output maps applied inside the kernel.

Shapes follow kernels.reference: q [B,H,T,D] (or [B,1,T,D] with per-head maps: MHE's shared Q),
k/v [B,G,S,D], head h reads group h // (H/G). K and V are read in place, never expanded to H heads.
Softmax runs in base 2 (exp2): the 1/sqrt(d) scale and log2(e) are folded into Q once. The two products run in the
inputs' dtype (fp32 in the CPU interpreter, whose bf16 tl.dot is broken); softmax state and accumulators are fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 inputs stay IEEE float32 (on a GPU Triton's default would be TF32,
    ~1e-3 relative, and the float32 contract with the reference would not hold); half types use the tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Launch shape per head width on a GPU (block_m, block_n, num_warps, num_stages): the fastest of the sweep that
# `python -m bench.kernels --tune` ran on an H100 (prefill at t = 8192, decode at 32k context, batch 8, bf16).
# Decode's two runs there picked (128, 4, 2) then (128, 4, 3) for d = 64 and (128, 2, 2) then (128, 2, 1) for
# d = 128 (bench/results/kernels_h100.json holds the second): block_n = 128 is what matters. The interpreter
# ignores the warps and stages; it runs block_n.
PREFILL_LAUNCH = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}
DECODE_LAUNCH = {64: (128, 4, 2), 128: (128, 2, 2)}  # (block_n, num_warps, num_stages)
# float32 on a GPU (the app's default there), per head width: twice the bytes a tile and IEEE dots without tensor
# cores. At d = 64 bf16's shape, though ptxas spills 1,180 bytes a thread of it (Triton 3.6, the static step), was
# 1.4-2.2x faster than 32 slots a block on 8 warps (24 bytes) on an H200 (MHA, MQA and MHE-MUL at 16k,
# batch 1, 8 and 64, bench/results/gpu_call_h200_run3.txt): the block size counts, not the spill. At d = 128 bf16's
# shape spilled 47 KB a thread pruned, so 32 slots a block on 8 warps (36 bytes), untimed. bench.kernels
# --dtype float32 times the other shapes beside it. The interpreter keeps the bf16 shape.
DECODE_LAUNCH_FP32 = {64: DECODE_LAUNCH[64], 128: (32, 8, 2)}
DECODE_ALTERNATIVES_FP32 = ((32, 8, 2), (64, 4, 2), (128, 4, 2))  # what bench.kernels times beside the table's


def decode_launch(d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of a decode at head width d in dtype on device."""
    if dtype == torch.float32 and device.type == "cuda":  # (other widths: d = 128's, the shape that spills least)
        return DECODE_LAUNCH_FP32.get(_pow2(d), DECODE_LAUNCH_FP32[128])
    return DECODE_LAUNCH.get(_pow2(d), (64, 4, 2))


def prefill_launch(d: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    bm, bn, warps, stages = PREFILL_LAUNCH.get(_pow2(d), (64, 64, 4, 2))
    if dtype == torch.float32:  # twice the bytes per tile: keep shared memory within the limit
        bn, stages = min(bn, 32), min(stages, 2)
    return bm, bn, warps, stages


@triton.jit
def _prefill_kernel(Q, K, V, O, QM, QA, OM, OA, BIAS,
                    sqb, sqh, sqt, skb, skg, sks, svb, svg, svs, sob, soh, sot, sbb, sbt, sbs,
                    H, R, T, S, D, qk_scale,
                    HAS_QM: tl.constexpr, HAS_QA: tl.constexpr, HAS_OM: tl.constexpr, HAS_OA: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_bh = tl.program_id(0)  # batch x heads on axis 0 (up to 2^31 programs; axes 1 and 2 stop at 65,535)
    pid_m = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # 64-bit offsets: b * (T x S) overflows int32 for long pruned sequences
    h = pid_bh % H
    g = h // R
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask, d_mask = offs_m < T, offs_d < D
    qd_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=qd_mask, other=0.0)
    q = q.to(tl.float32)
    if HAS_QM:
        q = q * tl.load(QM + h * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_QA:
        q = q + tl.load(QA + h * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    q = (q * qk_scale).to(K.dtype.element_ty)  # the dots run in the cache's dtype (bf16 tensor cores on GPU)
    q_pos = S - T + offs_m  # the T queries are the last T of the S positions

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = S
    if CAUSAL:  # skip key blocks that lie wholly after this query block's last row
        hi = tl.minimum(S, S - T + (pid_m + 1) * BLOCK_M)
    k_base = K + b * skb + g * skg
    v_base = V + b * svb + g * svg
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < S
        kt = tl.load(k_base + offs_n[None, :] * sks + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :],
                     other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION)         # [M, N], log2 units
        if HAS_BIAS:
            bias = tl.load(BIAS + b * sbb + offs_m[:, None] * sbt + offs_n[None, :] * sbs,
                           mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            s = s + bias.to(tl.float32) * 1.4426950408889634
        allowed = n_mask[None, :] & m_mask[:, None]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet stays at 0
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * svs + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows (never stored) see nothing
    if HAS_OM:
        out = out * tl.load(OM + h * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_OA:
        out = out + tl.load(OA + h * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], out.to(O.dtype.element_ty), mask=qd_mask)


@triton.jit
def _share(n, parts, BLOCK_N: tl.constexpr):
    """Slots per split when `parts` splits share n slots, rounded up to whole blocks."""
    return tl.cdiv(tl.cdiv(n, parts), BLOCK_N) * BLOCK_N


@triton.jit
def _slot_keep(b, offs_n, n_mask, LIVE, POS, KINT, slb, spb, skib, skis, q_int, offs_i, i_mask, int_scale, beta, lam,
               sinks, q_pos, valid):
    """kernels.keep_rule.survives for one block of slots, restated in Triton: the interaction score
    x = q_int . k_int / sqrt(r) + beta (- lam log(q_pos - pos)) keeps a live slot when x > 0, when it is the query's
    own or later, one of the first `sinks`, or its row is padding (valid = 0). Returns (keep, pos, live)."""
    live = tl.load(LIVE + b * slb + offs_n, mask=n_mask, other=0) != 0
    pos = tl.load(POS + b * spb + offs_n, mask=n_mask, other=-1)
    kint = tl.load(KINT + b * skib + offs_n[:, None] * skis + offs_i[None, :],
                   mask=n_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
    x = tl.sum(kint * q_int[None, :], 1) * int_scale + beta
    if lam != 0.0:  # the distance term -lam log(n - j) (kernels.keep_rule.distance_term)
        x = x - lam * tl.log(tl.maximum(q_pos - pos, 1).to(tl.float32))
    keep = live & ((x > 0) | (pos >= q_pos) | (pos < sinks) | (valid == 0))
    return keep, pos, live


@triton.jit
def _write_keep(LIVE_OUT, TRIG, b, offs_n, n_mask, keep, live, q_pos, slob, stb, BLOCK_N: tl.constexpr,
                HAS_TRIG: tl.constexpr):
    """keep into LIVE_OUT; with HAS_TRIG the query's position into TRIG at each live slot it dropped."""
    tl.store(LIVE_OUT + b * slob + offs_n, keep.to(LIVE_OUT.dtype.element_ty), mask=n_mask)
    if HAS_TRIG:
        tl.store(TRIG + b * stb + offs_n, tl.zeros([BLOCK_N], tl.int64) + q_pos, mask=n_mask & live & (keep == 0))


@triton.jit
def _clear_tail(LIVE_OUT, b, slob, length, S, part, parts, BLOCK_N: tl.constexpr):
    """Part `part` of `parts` clears its share of LIVE_OUT's slots [length, S) (nothing there is kept)."""
    tail = _share(S - length, parts, BLOCK_N)
    t0 = length + part * tail
    t1 = tl.minimum(t0 + tail, S)
    for z in range(t0, t1, BLOCK_N):
        offs_z = z + tl.arange(0, BLOCK_N)
        tl.store(LIVE_OUT + b * slob + offs_z, tl.zeros([BLOCK_N], LIVE_OUT.dtype.element_ty), mask=offs_z < t1)


@triton.jit
def _keep_kernel(QINT, KINT, LIVE, POS, QPOS, VALID, LENS, LIVE_OUT, TRIG,
                 sqib, skib, skis, slb, spb, slob, stb, slens, S, RI, int_scale, beta, lam, sinks,
                 HAS_LENS: tl.constexpr, HAS_VALID: tl.constexpr, HAS_TRIG: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_RI: tl.constexpr):
    """The keep pass (decode's keep_pass): program (b, part) decides keep for its share of row b's slots, once for
    every head group, and writes it as the decode kernel's PRUNE path would (LIVE_OUT, TRIG, the cleared tail);
    the decode that follows reads a slot's keep byte (and its position, as before) where it would read the rule's
    K_int once per group."""
    b = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    length = S
    if HAS_LENS:
        length = tl.load(LENS + b * slens)
    chunk = _share(length, parts, BLOCK_N)
    start = part * chunk
    end = tl.minimum(start + chunk, length)
    offs_i = tl.arange(0, BLOCK_RI)
    i_mask = offs_i < RI
    q_int = tl.load(QINT + b * sqib + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    q_pos = tl.load(QPOS + b)
    valid = 1
    if HAS_VALID:
        valid = tl.load(VALID + b)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        keep, pos, live = _slot_keep(b, offs_n, n_mask, LIVE, POS, KINT, slb, spb, skib, skis, q_int, offs_i, i_mask,
                                     int_scale, beta, lam, sinks, q_pos, valid)
        _write_keep(LIVE_OUT, TRIG, b, offs_n, n_mask, keep, live, q_pos, slob, stb, BLOCK_N, HAS_TRIG)
    if HAS_LENS:
        _clear_tail(LIVE_OUT, b, slob, length, S, part, parts, BLOCK_N)


@triton.jit
def _decode_kernel(Q, K, V, PO, PL, QM, QA, BIAS, LENS, QINT, KINT, LIVE, POS, QPOS, VALID, LIVE_OUT, TRIG,
                   O, OM, OA, CNT,
                   sqb, sqh, skb, skg, sks, svb, svg, svs, sbb, sbs, slens, skib, skis, sqib, slb, spb, stb, slob,
                   sob, soh, H, G, R, S, D, RI, split_len, qk_scale, int_scale, beta, lam, sinks,
                   HAS_QM: tl.constexpr, HAS_QA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENS: tl.constexpr,
                   PRUNE: tl.constexpr, HAS_VALID: tl.constexpr, HAS_TRIG: tl.constexpr, PRECISION: tl.constexpr,
                   MERGE: tl.constexpr, HAS_OM: tl.constexpr, HAS_OA: tl.constexpr, KEEP_READY: tl.constexpr,
                   MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, MERGE_L: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RI: tl.constexpr):
    """One query token per sequence. Program (b*G + g, split): every head of group g over one slice of the
    cache, so each K/V block is read once for all of them. Writes the slice's normalised partial output and
    its log2-sum-exp; _merge_kernel combines the slices, or with MERGE the split that finishes last does, here
    (CNT[b*G + g] counts the finished splits; that program sets it back to 0 for the next launch).

    PRUNE (the compacted pruning cache): in the same pass, the interaction score of each live slot,
    x = q_int . k_int / sqrt(r) + beta (- lam log(q_pos - pos)), decides keep = live & (x > 0 or the slot is the
    query's own or later, or one of the first `sinks`); keep is written to LIVE_OUT and only kept slots at or
    before the query are attended to.
    A padding row (VALID = 0) drops nothing and attends to every used slot (its output is discarded). With
    LENS, group 0's programs also clear LIVE_OUT after the row's length (nothing there is kept).
    HAS_TRIG (the step's bookkeeping in place): LIVE_OUT is LIVE itself, and group 0 also writes the query's
    position into TRIG at each slot it dropped (the slots from a row's length on hold nothing live, as the cache
    keeps them, so clearing them notes nothing). The other groups may then read a slot's live bit after group 0
    wrote its keep; keep = live & rule, so they compute the same keep and mask from either.
    KEEP_READY (decode's keep_pass): _keep_kernel ran first and wrote keep into LIVE_OUT (and the notes, and the
    tail); every group reads it there and writes nothing."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // G).to(tl.int64)  # 64-bit offsets: b x G x S x D passes 2^31 at batch 64, 32k context
    g = pid % G
    length = S
    chunk = split_len
    if HAS_LENS:
        # the splits share what this row holds, not the buffer: a preallocated cache filled to a tenth keeps
        # every program busy (the length is on the device, so the split is placed here, not at launch)
        length = tl.load(LENS + b * slens)
        chunk = _share(length, tl.num_programs(1), BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask, d_mask = offs_r < R, offs_d < D
    heads = g * R + offs_r
    rd_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
    if HAS_QM:
        q = q * tl.load(QM + heads[:, None] * D + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
    if HAS_QA:
        q = q + tl.load(QA + heads[:, None] * D + offs_d[None, :], mask=rd_mask, other=0.0).to(tl.float32)
    q = (q * qk_scale).to(K.dtype.element_ty)  # the dots run in the cache's dtype (bf16 tensor cores on GPU)
    if PRUNE:
        q_pos = tl.load(QPOS + b)
        if HAS_VALID:
            valid = tl.load(VALID + b)
        else:
            valid = 1
        if not KEEP_READY:  # (after a keep pass, keep and the cleared tail are already in LIVE_OUT)
            offs_i = tl.arange(0, BLOCK_RI)
            i_mask = offs_i < RI
            q_int = tl.load(QINT + b * sqib + offs_i, mask=i_mask, other=0.0).to(tl.float32)
            if HAS_LENS and g == 0:  # the slots after the length, shared out over the splits like the filled part
                _clear_tail(LIVE_OUT, b, slob, length, S, split, tl.num_programs(1), BLOCK_N)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        allowed = n_mask
        if PRUNE:
            if KEEP_READY:
                keep = tl.load(LIVE_OUT + b * slob + offs_n, mask=n_mask, other=0) != 0
                pos = tl.load(POS + b * spb + offs_n, mask=n_mask, other=-1)
            else:
                keep, pos, live = _slot_keep(b, offs_n, n_mask, LIVE, POS, KINT, slb, spb, skib, skis, q_int, offs_i,
                                             i_mask, int_scale, beta, lam, sinks, q_pos, valid)
                if g == 0:  # the score is shared by every head: group 0 writes it, the others only use it
                    _write_keep(LIVE_OUT, TRIG, b, offs_n, n_mask, keep, live, q_pos, slob, stb, BLOCK_N, HAS_TRIG)
            allowed = n_mask & tl.where(valid != 0, keep & (pos <= q_pos), pos >= 0)
        kt = tl.load(K + b * skb + g * skg + offs_n[None, :] * sks + offs_d[:, None],
                     mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION)         # [R, N]
        if HAS_BIAS:
            bias = tl.load(BIAS + b * sbb + offs_n * sbs, mask=n_mask, other=0.0).to(tl.float32)
            s = s + bias[None, :] * 1.4426950408889634
        s = tl.where(allowed[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        corr = tl.exp2(m_i - m_safe)
        l_i = l_i * corr + tl.sum(p, 1)
        v = tl.load(V + b * svb + g * svg + offs_n[:, None] * svs + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * corr[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    n_split = tl.num_programs(1)
    part = (b * H + heads) * n_split + split
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    tl.store(PO + part[:, None] * D + offs_d[None, :], acc / safe_l[:, None], mask=rd_mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))           # -inf: the slice saw nothing
    tl.store(PL + part, lse, mask=r_mask)
    if MERGE:
        # split-K's semaphore: every thread's stores come before the count (barrier, then a release), and the last
        # split's acquire sees every other split's; it reads them from L2 (.cg), not from a stale L1 line
        tl.debug_barrier()
        done = tl.atomic_add(CNT + pid, 1, sem="acq_rel")
        if done == n_split - 1:
            tl.debug_barrier()  # (the count's acquire came before any of this program's threads loads)
            _merge_group(PO, PL, O, OM, OA, b, g, H, R, D, n_split, sob, soh, HAS_OM, HAS_OA, MERGE_H, MERGE_S,
                         MERGE_L, BLOCK_D)
            tl.atomic_xchg(CNT + pid, 0)


@triton.jit
def _merge_group(PO, PL, O, OM, OA, b, g, H, R, D, n_split, sob, soh,
                 HAS_OM: tl.constexpr, HAS_OA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split partials of group g's R heads of sequence b combined by their log2-sum-exp weights: the decode
    kernel's last split (MERGE) and _merge_kernel both call it (the same bits in the interpreter). Two passes: each
    head's largest log-sum-exp first (BLOCK_L splits a load: one float a split and head), then the weighted sum,
    BLOCK_S splits a load, nothing rescaled between loads. One split a load would be 128 loads one after
    another for MQA at batch 1 (the cache cut into 128 splits), each an L2 round trip: nothing pipelines them."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask, d_mask = offs_h < R, offs_d < D
    heads = g * R + offs_h
    rows = (b * H + heads) * n_split                                          # [H]: each head's first split
    hd_mask = h_mask[:, None] & d_mask[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s0 in range(0, n_split, BLOCK_L):
        sp = s0 + tl.arange(0, BLOCK_L)
        lse = tl.load(PL + rows[None, :] + sp[:, None], mask=(sp < n_split)[:, None] & h_mask[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, tl.max(lse, 0))
    m = tl.where(m == float("-inf"), 0.0, m)                                  # a head that saw nothing: weights 0
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        sh_mask = (sp < n_split)[:, None] & h_mask[None, :]                   # [S, H]
        at = rows[None, :] + sp[:, None]
        w = tl.exp2(tl.load(PL + at, mask=sh_mask, other=float("-inf"), cache_modifier=".cg") - m[None, :])
        part = tl.load(PO + at[:, :, None] * D + offs_d[None, None, :],                        # [S, H, D]
                       mask=sh_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        w_sum += tl.sum(w, 0)
        acc += tl.sum(part * w[:, :, None], 0)
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    if HAS_OM:
        out = out * tl.load(OM + heads[:, None] * D + offs_d[None, :], mask=hd_mask, other=0.0).to(tl.float32)
    if HAS_OA:
        out = out + tl.load(OA + heads[:, None] * D + offs_d[None, :], mask=hd_mask, other=0.0).to(tl.float32)
    tl.store(O + b * sob + heads[:, None] * soh + offs_d[None, :], out.to(O.dtype.element_ty), mask=hd_mask)


@triton.jit
def _merge_kernel(PO, PL, O, OM, OA, G, R, D, n_split, sob, soh,
                  HAS_OM: tl.constexpr, HAS_OA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program b*G + g: _merge_group for group g of sequence b, where the decode did not merge its own splits."""
    pid = tl.program_id(0)
    _merge_group(PO, PL, O, OM, OA, (pid // G).to(tl.int64), pid % G, G * R, R, D, n_split, sob, soh,
                 HAS_OM, HAS_OA, BLOCK_H, BLOCK_S, BLOCK_L, BLOCK_D)


# a merge's loads, in float32 elements a thread ([splits, heads, width] tiles; the log-sum-exps' [splits, heads]):
# small enough to stay in registers inside the decode kernel, whose own tiles take most of them
MERGE_PER_THREAD, LSE_PER_THREAD = 16, 8
MERGE_WARPS = 4  # the merge launched on its own (its loop has no tl.dot: stages pipeline nothing, PTX the same)


def merge_tiles(r: int, d: int, warps: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_S, BLOCK_L) of a merge run by `warps` warps: a group's heads, the splits a load of partials
    and of log-sum-exps. They depend on the shapes of the model, not on the split count, so a growing cache does
    not compile new variants."""
    bh, threads = triton.next_power_of_2(r), 32 * warps
    return bh, max(1, MERGE_PER_THREAD * threads // (bh * _pow2(d))), max(1, LSE_PER_THREAD * threads // bh)


def _heads_and_maps(q, k, q_mul, q_add, o_mul, o_add):
    maps = [m for m in (q_mul, q_add, o_mul, o_add) if m is not None]
    h = maps[0].shape[0] if maps and q.shape[1] == 1 else q.shape[1]
    for m in maps:
        if m.shape != (h, q.shape[-1]):
            raise ValueError(f"per-head maps must be [{h}, {q.shape[-1]}], got {list(m.shape)}")
    g = k.shape[1]
    if h % g:
        raise ValueError(f"{h} query heads cannot share {g} key/value groups")
    dummy = q.new_empty(1)
    return h, [m.contiguous() if m is not None else dummy for m in (q_mul, q_add, o_mul, o_add)]


def _check_rows(*ts):
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("the kernels read rows contiguously: last-dimension stride must be 1")


def prefill(q, k, v, *, scale: float, bias=None, causal: bool = True, q_mul=None, q_add=None, o_mul=None, o_add=None,
            block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
            num_stages: int | None = None):
    """Flash-style causal attention; see kernels.reference.attention for the contract. The launch shape
    defaults to PREFILL_LAUNCH for the head width."""
    b, hq, t, d = q.shape
    s = k.shape[2]
    h, (qm, qa, om, oa) = _heads_and_maps(q, k, q_mul, q_add, o_mul, o_add)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)
    has_bias = bias is not None
    if has_bias:
        bias = bias.expand(b, 1, t, s)
        sb = (bias.stride(0), bias.stride(2), bias.stride(3))
    else:
        bias, sb = q.new_empty(1), (0, 0, 0)
    bd = _pow2(d)
    dbm, dbn, dw, dst = prefill_launch(d, k.dtype)
    bm = min(block_m or dbm, _pow2(t))
    bn = min(block_n or dbn, _pow2(s))
    grid = (b * h, triton.cdiv(t, bm))
    _prefill_kernel[grid](
        q, k, v, out, qm, qa, om, oa, bias,
        q.stride(0), q.stride(1) if hq > 1 else 0, q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), *sb,
        h, h // k.shape[1], t, s, d, scale * LOG2E,
        HAS_QM=q_mul is not None, HAS_QA=q_add is not None, HAS_OM=o_mul is not None, HAS_OA=o_add is not None,
        HAS_BIAS=has_bias, CAUSAL=causal, PRECISION=precision(k.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        num_warps=num_warps or dw, num_stages=num_stages or dst)
    return out


KEEP_BLOCK = 32  # slots per iteration of the keep pass: a [32, r] float32 tile of K_int (r = 64: 8 KB)
KEEP_WARPS, KEEP_STAGES = 4, 2  # (untuned: tests/test_kernels_compile.py compiles this launch)


def _target_programs(device: torch.device) -> int:
    """About four programs per multiprocessor keep enough loads in flight for decode, which is bandwidth-bound."""
    if device.type != "cuda":
        return 128
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _splits(s: int, b: int, g: int, block_n: int, target_programs: int = 128) -> int:
    """Enough slices of the cache to occupy the device when batch x groups alone would not."""
    want = max(1, target_programs // max(1, b * g))
    return max(1, min(want, triton.cdiv(s, block_n), 128))


def decode(q, k, v, *, scale: float, bias=None, lengths=None, q_mul=None, q_add=None, o_mul=None, o_add=None,
           prune: dict | None = None, block_n: int | None = None, n_split: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None, merge_counts=None, keep_pass: bool = False):
    """One new query per sequence, q [B,H|1,1,D], over a cache k/v [B,G,S,D].

    merge_counts: int32 zeros, at least B*G of them, owned by the caller's decode state (one launch at a time
    uses them, and leaves them zero): the splits are combined inside the decode kernel by the one that finishes
    last, so a step launches one kernel, not two (a fixed-shape step replayed from a CUDA graph at batch 1 costs
    about its kernel count).

    bias: additive [B,1,1,S] (or [B,S]); lengths [B]: sequence b uses cache slots [0, lengths[b]).
    prune: the compacted pruning cache, a dict of q_int [B,r], k_int [B,S,r], beta (float), live [B,S] bool,
    pos [B,S] (slot positions, -1 unused), q_pos [B], valid [B] bool, optionally lam (float), sinks (int) and
    trig [B,S] int64 (then live and trig are updated in place: kernels.reference.decode); then the return is
    (out, keep [B,S]).
    keep_pass (with prune): decide keep in a launch of its own first (_keep_kernel), once per slot, so the decode
    reads a keep byte a slot and not the rule's K_int (r floats) once per head group: for MHA at r = 64 and d = 64 those
    re-reads are as many bytes as K and V. One more launch a layer: on an H200 35-39 % off a call at batch 64,
    about 1 us more at batch 1 and 64 live slots (bench.kernels times both); models/ take it under
    MIXSCOPE_KEEP_PASS=1 (kernels.keep_pass).
    """
    b, hq, t, d = q.shape
    if t != 1:
        raise ValueError(f"decode takes one query per sequence, got {t}")
    g, s = k.shape[1], k.shape[2]
    h, (qm, qa, om, oa) = _heads_and_maps(q, k, q_mul, q_add, o_mul, o_add)
    r = h // g
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    dummy = q.new_empty(1)
    bias_t, sbb, sbs = dummy, 0, 0
    if bias is not None:
        if bias.shape[-1] != s or bias.numel() not in (s, b * s):
            raise ValueError(f"decode bias must cover the cache: [B or 1,1,1,{s}] or [B or 1,{s}], "
                             f"got {list(bias.shape)}")
        # one row shared by the batch (the local/strided patterns) is read with batch stride 0, not copied
        bias_t = bias.reshape(-1, s).expand(b, s)
        sbb, sbs = bias_t.stride(0), bias_t.stride(1)
    lens, slens = (dummy, 0) if lengths is None else (lengths, lengths.stride(0))  # (a cursor expanded: stride 0)
    dbn, dw, dst = decode_launch(d, k.dtype, k.device)
    block_n = min(block_n or dbn, _pow2(s))
    ns = n_split or _splits(s, b, g, block_n, _target_programs(q.device))
    split_len = triton.cdiv(triton.cdiv(s, ns), block_n) * block_n
    ns = triton.cdiv(s, split_len)
    po = torch.empty(b * h * ns, d, dtype=torch.float32, device=q.device)
    pl = torch.empty(b * h * ns, dtype=torch.float32, device=q.device)
    if prune is not None:
        qi, ki = prune["q_int"].contiguous(), prune["k_int"]
        if ki.stride(-1) != 1:
            ki = ki.contiguous()
        # read and written as they are (bool as bytes, int64 positions): a conversion would be a kernel of its
        # own on every call, and a decode step replayed from a graph at batch 1 is bound by its kernel count
        live, pos = _rows(prune["live"].view(torch.uint8)), _rows(prune["pos"])
        qpos = prune["q_pos"].contiguous()
        valid = dummy if prune["valid"] is None else prune["valid"].contiguous().view(torch.uint8)  # None: all real
        trig = prune.get("trig")
        if trig is None:
            keep = torch.empty(live.shape, dtype=torch.bool, device=q.device)
            live_out = keep.view(torch.uint8)  # every slot written (after a row's length: 0)
            trig, stb = dummy, 0
            slob = live_out.stride(0)
        else:  # in place: keep is written over live (a copy of live would take the writes away from the cache)
            if (live.data_ptr() != prune["live"].data_ptr() or trig.shape != live.shape or trig.stride(-1) != 1
                    or trig.dtype != torch.int64 or trig.device != live.device):
                raise ValueError("decode updates live and trig in place: give slot-adjacent [B,S] tensors, trig "
                                 "int64 on live's device")
            keep, live_out, stb, slob = prune["live"], live, trig.stride(0), live.stride(0)
        ri = qi.shape[-1]
        pr = (qi, ki, live, pos, qpos, valid, live_out, trig, ki.stride(0), ki.stride(1), qi.stride(0),
              live.stride(0), pos.stride(0), stb, slob, ri, ri ** -0.5, float(prune["beta"]),
              float(prune.get("lam", 0.0)), int(prune.get("sinks", 0)))
    else:
        pr = (dummy,) * 8 + (0, 0, 0, 0, 0, 0, 0, 1, 1.0, 0.0, 0.0, 0)
    (qi_, ki_, live_, pos_, qpos_, valid_, live_out_, trig_, skib, skis, sqib, slb, spb, stb, slob, ri, int_scale,
     beta, lam, sinks) = pr
    keep_ready = prune is not None and keep_pass
    if keep_ready:
        parts = _splits(s, b, 1, KEEP_BLOCK, _target_programs(q.device))  # (the decode's split rule, one group)
        _keep_kernel[(b, parts)](qi_, ki_, live_, pos_, qpos_, valid_, lens, live_out_, trig_,
                                 sqib, skib, skis, slb, spb, slob, stb, slens, s, ri, int_scale, beta, lam, sinks,
                                 HAS_LENS=lengths is not None, HAS_VALID=prune["valid"] is not None,
                                 HAS_TRIG=prune.get("trig") is not None, BLOCK_N=KEEP_BLOCK, BLOCK_RI=_pow2(ri),
                                 num_warps=KEEP_WARPS, num_stages=KEEP_STAGES)
    out = torch.empty(b, h, 1, d, dtype=q.dtype, device=q.device)
    merge = merge_counts is not None
    if merge and (merge_counts.dtype != torch.int32 or merge_counts.numel() < b * g or not merge_counts.is_contiguous()
                  or merge_counts.device != q.device):
        raise ValueError(f"merge_counts: contiguous int32 zeros on q's device, at least {b * g} of them")
    warps = num_warps or dw
    # (without MERGE the tiles are not used: ones, so they compile no variants of their own)
    in_kernel = merge_tiles(r, d, warps) if merge else (1, 1, 1)
    _decode_kernel[(b * g, ns)](
        q, k, v, po, pl, qm, qa, bias_t, lens, qi_, ki_, live_, pos_, qpos_, valid_, live_out_, trig_,
        out, om, oa, merge_counts if merge else dummy,
        q.stride(0), q.stride(1) if hq > 1 else 0, k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), sbb, sbs, slens, skib, skis, sqib, slb, spb, stb, slob,
        out.stride(0), out.stride(1), h, g, r, s, d, ri, split_len, scale * LOG2E, int_scale, beta, lam, sinks,
        HAS_QM=q_mul is not None, HAS_QA=q_add is not None, HAS_BIAS=bias is not None, HAS_LENS=lengths is not None,
        PRUNE=prune is not None, HAS_VALID=prune is not None and prune["valid"] is not None,
        HAS_TRIG=prune is not None and prune.get("trig") is not None,
        PRECISION=precision(k.dtype), MERGE=merge, HAS_OM=o_mul is not None, HAS_OA=o_add is not None,
        KEEP_READY=keep_ready, MERGE_H=in_kernel[0], MERGE_S=in_kernel[1], MERGE_L=in_kernel[2], BLOCK_R=_pow2(r),
        BLOCK_N=block_n, BLOCK_D=_pow2(d),
        BLOCK_RI=_pow2(ri), num_warps=warps, num_stages=num_stages or dst)
    if not merge:
        bh, bs, bl = merge_tiles(r, d, warps)  # the tiles the decode's own merge takes: the same sum
        _merge_kernel[(b * g,)](po, pl, out, om, oa, g, r, d, ns, out.stride(0), out.stride(1),
                                HAS_OM=o_mul is not None, HAS_OA=o_add is not None, BLOCK_H=bh, BLOCK_S=bs, BLOCK_L=bl,
                                BLOCK_D=_pow2(d), num_warps=MERGE_WARPS)
    if prune is not None:
        return out, keep
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B,S] read by row stride (a slice of the cache's buffers is not copied); slots must be adjacent."""
    return t if t.stride(-1) == 1 else t.contiguous()
