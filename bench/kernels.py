"""Kernel benchmark: each op against the strongest baselines present, in one run, on whatever device is here.

    python -m bench.kernels [--json FILE] [--quick] [--device cpu|cuda]

Per case: median time, achieved GB/s and TFLOP/s, and the ratio to the physical floor, max(bytes / copy
bandwidth, flops / matmul rate), with both rates measured at the start of the same run. Baselines:
torch's scaled_dot_product_attention (K/V expanded to every head where sharing is not native),
FlexAttention (enable_gqa) and our reference; Triton runs only on CUDA (its CPU interpreter checks
correctness, it is not a performance path). End to end: decode tokens/s of zoo models.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import kernels
from kernels import efficient, reference
from kernels.keep_rule import rule_dtype


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() over reps runs after warmup (on CUDA: device events, triton's do_bench)."""
    if dev.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=max(50, 5 * reps), return_mode="median") / 1e3
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timeit_graph(make, nbytes: int, dev, reps: int, max_copies: int = 512) -> float:
    """Median seconds per call with the launches replayed from one CUDA graph, as a decode step runs
    (models.graphs), so what is left is the kernel's own time. make(i) -> a call on its own copy of the inputs:
    the calls rotate over enough copies (nbytes read each) to fill three L2 caches, so each reads from memory, as a
    step over many layers does; at most max_copies (a copy may hold more than it reads: a cache's whole capacity)."""
    import triton.testing
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    n = max(1, min(512, max_copies, -(-3 * l2 // max(nbytes, 1))))  # (64 copies left small cases in L2)
    fns = [make(i) for i in range(n)]
    # do_bench_cudagraph warms up on a stream of its own that does not wait for this one: the copies' inputs
    # (lengths, merge counters) must be written first, or a warm-up call reads recycled memory as a length and runs
    # off its buffers (an illegal memory access on an H200 once the decode section had freed its copies)
    torch.cuda.synchronize(dev)

    def every():
        for fn in fns:
            fn()
    ms = triton.testing.do_bench_cudagraph(every, rep=max(20, reps), return_mode="median")
    return ms / 1e3 / len(fns)


def copy_bandwidth(dev, mb: int = 256, reps: int = 10) -> float:
    """Read + write bytes per second of a copy of `mb` MB (median of reps). The two 256 MB buffers together
    exceed the last-level cache of the hosts seen here (a 480 MB L3 held a 64 MB copy and overstated DRAM
    bandwidth)."""
    a = torch.empty(mb * 2 ** 20 // 4, dtype=torch.float32, device=dev).normal_()
    b = torch.empty_like(a)  # preallocated: a fresh clone would time page faults, not bandwidth
    return 2 * a.numel() * 4 / timeit(lambda: b.copy_(a), dev, reps)


def floors(dev, dtype) -> dict:
    """Measured copy bandwidth (read + write bytes / s) and dense matmul rate (flop / s) for dtype."""
    bw = copy_bandwidth(dev)
    m = 8192 if dev.type == "cuda" else 1024
    x = torch.randn(m, m, device=dev, dtype=dtype)
    rate = 2 * m ** 3 / timeit(lambda: x @ x, dev, 10)
    return {"copy_bytes_per_s": bw, "matmul_flops_per_s": rate, "matmul_size": m}


def row(name, impl, secs, nbytes, flops, fl) -> dict:
    floor = max(nbytes / fl["copy_bytes_per_s"], flops / fl["matmul_flops_per_s"])
    return {"case": name, "impl": impl, "ms": secs * 1e3, "GB_s": nbytes / secs / 1e9, "TFLOP_s": flops / secs / 1e12,
            "x_floor": secs / floor}


def flex_fn(dev):
    """A compiled causal FlexAttention with enable_gqa, or the reason there is none here."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        raise_recompile_limit()
        compiled = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001 - report, do not fail the run
        return None, f"{type(e).__name__}: {e}"
    masks = {}

    def run(q, k, v, scale):
        t, s = q.shape[2], k.shape[2]
        if (t, s) not in masks:
            masks[(t, s)] = create_block_mask(lambda b, h, qi, ki: ki <= qi + (s - t), None, None, t, s,
                                              device=dev.type)
        return compiled(q, k, v, block_mask=masks[(t, s)], scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return run, None


def raise_recompile_limit(n: int = 256) -> None:
    """One compiled flex_attention serves every shape here; dynamo's default of 8 recompilations would fall
    back to the unfused (score-materialising) path after the eighth shape and time that instead."""
    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, n)


def expanded_sdpa(q, k, v, scale, maps):
    """SDPA where K/V sharing is not native: K/V repeated to every head (what MHE costs elsewhere)."""
    h = q.shape[1] if not maps else next(iter(maps.values())).shape[0]
    if "q_mul" in maps:
        q = q * maps["q_mul"][:, None]
    r = h // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale)
    return out * maps["o_mul"][:, None] if "o_mul" in maps else out


VARIANTS = {"mha": 0, "mqa": 1, "mhe-mul": 1}  # K/V groups (0: one per head)


def make_qkv(variant, b, h, t, s, d, dev, dtype):
    g = VARIANTS[variant] or h
    maps = {}
    if variant == "mhe-mul":
        maps = {"q_mul": 1 + 0.1 * torch.randn(h, d, device=dev, dtype=dtype),
                "o_mul": 1 + 0.1 * torch.randn(h, d, device=dev, dtype=dtype)}
    q = torch.randn(b, 1 if maps else h, t, d, device=dev, dtype=dtype)
    k, v = (torch.randn(b, g, s, d, device=dev, dtype=dtype) for _ in range(2))
    return q, k, v, maps, g


def bench_prefill(dev, dtype, lengths, fl, reps, flex, h=16, d=64, b=1) -> list[dict]:
    out = []
    es = torch.tensor([], dtype=dtype).element_size()
    for t in lengths:
        for variant in VARIANTS:
            q, k, v, maps, g = make_qkv(variant, b, h, t, t, d, dev, dtype)
            name = f"prefill {variant} t={t}"
            nbytes = (q.numel() + k.numel() + v.numel() + b * h * t * d) * es
            flops = 4 * b * h * d * t * (t + 1) / 2                    # causal: half the score matrix
            impls = {"reference": lambda: reference.attention(q, k, v, scale=d ** -0.5, **maps),
                     "sdpa_expanded": lambda: expanded_sdpa(q, k, v, d ** -0.5, maps)}
            if flex[0] is not None and not maps:
                impls["flex"] = lambda: flex[0](q, k, v, d ** -0.5)
            if dev.type == "cuda" and "attention" in kernels.TRITON:
                from kernels import triton_attention
                impls["triton"] = lambda: triton_attention.prefill(q, k, v, scale=d ** -0.5, **maps)
            for impl, fn in impls.items():
                try:
                    out.append(row(name, impl, timeit(fn, dev, reps), nbytes, flops, fl))
                except Exception as e:  # noqa: BLE001
                    out.append({"case": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def bench_decode(dev, dtype, contexts, batches, fl, reps, budget_bytes, h=16, d=64) -> list[dict]:
    out = []
    es = torch.tensor([], dtype=dtype).element_size()
    for s in contexts:
        for b in batches:
            for variant in VARIANTS:
                g = VARIANTS[variant] or h
                cache_bytes = 2 * b * g * s * d * es
                expanded = 2 * b * h * s * d * es
                name = f"decode {variant} ctx={s} batch={b}"
                if cache_bytes > budget_bytes:
                    continue
                q, k, v, maps, g = make_qkv(variant, b, h, 1, s, d, dev, dtype)
                nbytes = cache_bytes + 2 * b * h * d * es
                flops = 4 * b * h * s * d
                impls = {"reference": lambda: reference.decode(q, k, v, scale=d ** -0.5, **maps)}
                if expanded <= budget_bytes:
                    impls["sdpa_expanded"] = lambda: expanded_sdpa(q, k, v, d ** -0.5, maps)
                if not maps:
                    impls["sdpa_gqa"] = lambda: F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5,
                                                                               enable_gqa=g != h)
                if dev.type == "cuda" and "attention" in kernels.TRITON:
                    from kernels import triton_attention
                    impls["triton"] = lambda: triton_attention.decode(q, k, v, scale=d ** -0.5, **maps)
                for impl, fn in impls.items():
                    out.append(row(name, impl, timeit(fn, dev, reps), nbytes, flops, fl) | {"cache_bytes": cache_bytes})
                if "triton" in impls and 3 * cache_bytes <= budget_bytes:
                    launches = {"triton_graph": {}}
                    if dtype == torch.float32:  # the other shapes float32 might take, beside its table's, same run
                        for bn, warps, stages in triton_attention.DECODE_ALTERNATIVES_FP32:
                            if (bn, warps, stages) != triton_attention.decode_launch(d, dtype, dev):
                                launches[f"triton_graph_launch_{bn}x{warps}x{stages}"] = dict(
                                    block_n=bn, num_warps=warps, num_stages=stages)
                    launches |= fewer_splits(s, b, g, d, dtype, dev)
                    for impl, launch in launches.items():
                        def make(i, variant=variant, b=b, s=s, launch=launch):  # a fixed-shape step: merged in-kernel
                            q, k, v, maps, g = make_qkv(variant, b, h, 1, s, d, dev, dtype)
                            counts = torch.zeros(b * g, dtype=torch.int32, device=dev)
                            return lambda: triton_attention.decode(q, k, v, scale=d ** -0.5, merge_counts=counts,
                                                                   **launch, **maps)
                        out.append(row(name, impl, timeit_graph(make, nbytes, dev, reps), nbytes, flops, fl)
                                   | {"cache_bytes": cache_bytes})
    return out


# split counts timed beside the decode's own where batch x groups is small: fewer splits mean longer loops over
# the cache but fewer partials for the last split to merge, which it loads one group of splits after another (MQA
# at batch 1 and 16k on an H200: 128 splits, 0.076 ms a call from a graph against SDPA's 0.013)
DECODE_FEWER_SPLITS = (8, 16, 32, 64)


def fewer_splits(s: int, b: int, g: int, d: int, dtype, dev) -> dict[str, dict]:
    """{row name: decode's keyword arguments} for each of DECODE_FEWER_SPLITS below the split count the decode
    would take itself, where batch x groups is at most 8 (else none)."""
    from kernels import triton_attention as ta
    if b * g > 8:
        return {}
    splits = ta._splits(s, b, g, ta.decode_launch(d, dtype, dev)[0], ta._target_programs(dev))
    return {f"triton_graph_split{n}": {"n_split": n} for n in DECODE_FEWER_SPLITS if n < splits}


FIXED_SLOTS = 64  # the compacted benchmark's smallest live count: its time is the call's fixed cost


def compact_inputs(dev, dtype, b, live_n, capacity, h=16, d=64, r=64):
    """A compacted pruning cache as a fixed-shape decode step sees it: `capacity` slots per row, the first
    live_n filled and live, read up to `lengths` (= live_n)."""
    q = torch.randn(b, h, 1, d, device=dev, dtype=dtype)
    k, v = (torch.randn(b, h, capacity, d, device=dev, dtype=dtype) for _ in range(2))
    pos = torch.where(torch.arange(capacity, device=dev) < live_n, torch.arange(capacity, device=dev), -1)
    rule = rule_dtype(dtype)  # the cache keeps K_int in the rule's precision (float32 in a bf16 model)
    prune = {"q_int": torch.randn(b, r, device=dev, dtype=rule), "beta": 50.0,
             "k_int": torch.randn(b, capacity, r, device=dev, dtype=rule),
             "live": (pos >= 0).expand(b, -1).contiguous(), "pos": pos.expand(b, -1).contiguous(),
             "q_pos": torch.full((b,), live_n - 1, device=dev), "valid": None,
             # the drop notes, as a decode step passes them: keep written over live in place (after the first call
             # nothing more drops, so every timed call does the same work)
             "trig": torch.full((b, capacity), -1, dtype=torch.long, device=dev)}
    return q, k, v, prune, torch.full((b,), live_n, device=dev)


def bench_compact(dev, dtype, s, batches, fl, reps, budget_bytes, h=16, d=64, r=64) -> list[dict]:
    """Decode over the compacted pruning cache at several live shares of context s: time should follow the live
    share. The buffers hold s slots, as a fixed-shape cache that has not shrunk, read up to the live count."""
    out = []
    es = torch.tensor([], dtype=dtype).element_size()
    # a slot's bytes: K and V, K_int in the rule's precision, the live byte and the int64 position
    slot = 2 * h * d * es + r * torch.tensor([], dtype=rule_dtype(dtype)).element_size() + 1 + 8
    for b in batches:
        full_bytes = slot * b * s  # at capacity s
        if full_bytes > budget_bytes:
            continue
        # the last share, FIXED_SLOTS live slots (under one decode block), is the call's fixed cost: what no live
        # share goes under
        for share in dict.fromkeys((1.0, 0.5, 0.25, 0.1, FIXED_SLOTS / s)):  # (at s = 256 the last is 0.25)
            live_n = max(1, int(s * share))
            q, k, v, prune, lengths = compact_inputs(dev, dtype, b, live_n, s, h, d, r)
            nbytes = slot * b * live_n
            flops = 4 * b * h * live_n * d + 2 * b * live_n * r
            name = f"compact decode mha ctx={s} live={share:g} batch={b}"
            impls = {"reference": lambda: reference.decode(q, k, v, scale=d ** -0.5, prune=prune, lengths=lengths)}
            if dev.type == "cuda" and "compact_decode" in kernels.TRITON:
                from kernels import triton_attention
                impls["triton"] = lambda: triton_attention.decode(q, k, v, scale=d ** -0.5, prune=prune,
                                                                  lengths=lengths)
            for impl, fn in impls.items():
                out.append(row(name, impl, timeit(fn, dev, reps), nbytes, flops, fl) | {"live_share": share})
            if "triton" in impls and 3 * full_bytes <= budget_bytes:
                # each copy holds the whole capacity: as many as half the budget takes (64 live slots would
                # otherwise ask for 512 copies of 71 MB at batch 1)
                copies = max(1, budget_bytes // (2 * full_bytes))
                # as a fixed-shape step: the splits merged in-kernel; and with keep decided first, once per slot
                # (decode's keep_pass), against K_int read by every head group
                for impl, keep_pass in (("triton_graph", False), ("triton_graph_keep_pass", True)):
                    def make(i, b=b, live_n=live_n, keep_pass=keep_pass):
                        q, k, v, prune, lengths = compact_inputs(dev, dtype, b, live_n, s, h, d, r)
                        counts = torch.zeros(b * h, dtype=torch.int32, device=dev)
                        return lambda: triton_attention.decode(q, k, v, scale=d ** -0.5, prune=prune, lengths=lengths,
                                                               merge_counts=counts, keep_pass=keep_pass)
                    print(f"  {name} {impl} copies={copies}", file=sys.stderr, flush=True)
                    out.append(row(name, impl, timeit_graph(make, nbytes, dev, reps, copies), nbytes, flops, fl)
                               | {"live_share": share})
    return out


def bench_lag(dev, dtype, lengths, fl, reps, b=4, c=512) -> list[dict]:
    out = []
    es = torch.tensor([], dtype=dtype).element_size()
    for s in lengths:
        x = torch.randn(b, s, c, device=dev, dtype=dtype)
        for kind, w in (("me", torch.randn(s, device=dev, dtype=dtype)),
                        ("we/he", torch.randn(s, c, device=dev, dtype=dtype))):
            nbytes, flops = (2 * x.numel() + w.numel()) * es, 2 * b * c * s * (s + 1) / 2
            impls = {"reference_direct": lambda: reference.lag_conv(x, w, method="direct"),
                     "reference_fft": lambda: reference.lag_conv(x.float(), w.float(), method="fft")}
            if dev.type == "cuda" and "lag_conv" in kernels.TRITON:
                from kernels import triton_lag
                impls["triton"] = lambda: triton_lag.lag_conv(x, w)
            for impl, fn in impls.items():
                out.append(row(f"lag {kind} s={s}", impl, timeit(fn, dev, reps), nbytes, flops, fl))
        cs = 128  # SHE: a c x c matrix per lag; FFT path = one c x c product per frequency
        xs, ws = torch.randn(b, s, cs, device=dev), torch.randn(s, cs, cs, device=dev)
        flops = 2 * b * (s + 1) * cs * cs * 2        # the per-frequency complex products, roughly
        out.append(row(f"lag she s={s} c={cs}", "reference_fft", timeit(lambda: reference.lag_conv(xs, ws), dev, reps),
                       (xs.numel() * 2 + ws.numel()) * 4, flops, fl))
    return out


def bench_models(dev, steps: int, model_dirs: list[str]) -> list[dict]:
    """End-to-end decode per model and kernel path (Triton on CUDA only): batch 1, filled to the model's
    context, median step time (bench.pruning_decode.decode_run; the compacted cache for pruned models)."""
    import os

    from bench.pruning_decode import decode_run
    from models.checkpoint import load_model_dir
    out = []
    paths = ["reference"] + (["triton"] if dev.type == "cuda" and kernels.TRITON else [])
    for d in model_dirs:
        if not Path(d).is_dir():
            continue
        model = load_model_dir(d, device=dev, dtype="auto").model.eval()  # bf16 on a GPU, as the app runs it
        cfg = model.config
        for path in paths:
            os.environ["MIXSCOPE_KERNELS"] = path
            run = decode_run(model, 1, cfg.context, steps, compact=cfg.prune)
            out.append({"model": d, "mixer": cfg.mixer, "pruned": cfg.prune, "path": path, "context": cfg.context,
                        "tokens": steps, "tokens_per_s": run["tokens_per_s"]})
        os.environ.pop("MIXSCOPE_KERNELS", None)
    return out


def train_attention_inputs(dev, dtype, b, h, g, d, t):
    """q [B,H,T,D], k and v [B,G,T,D] and log I [B,1,T,T] (float32), each needing a gradient, and the output's
    gradient: log I at most 0 and -inf above the diagonal, as a pruned layer's is, so it is the causal mask too
    (models.backends.full)."""
    q = torch.randn(b, h, t, d, device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, g, t, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    later = torch.ones(t, t, dtype=torch.bool, device=dev).triu(1)
    log_i = (-torch.rand(b, 1, t, t, device=dev)).masked_fill(later, float("-inf")).requires_grad_()
    return q, k, v, log_i, torch.randn(b, h, t, d, device=dev, dtype=dtype)


def bench_train_attention(dev, dtype, fl, reps, b=4, h=9, g=3, d=64, lengths=(1024, 2048),
                          with_flex: bool = True) -> list[dict]:
    """Training attention with the pruning bias log I (which needs a gradient), forward + backward:
    SDPA with an additive mask (what training ran first) against FlexAttention with a score_mod reading log I, and on
    a GPU PyTorch's memory-efficient kernel with its causal mask (kernels.efficient, training's default there) and
    ours (kernels.triton_causal_bias), both given log I in the inputs' dtype, as a bf16 autocast step hands it.
    with_flex False leaves FlexAttention out (its compile and autotuning take longer than a short call's part)."""
    out = []
    flex = None
    if dev.type == "cuda" and with_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            raise_recompile_limit()
            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # noqa: BLE001
            out.append({"case": "train attention", "impl": "flex", "error": f"{type(e).__name__}: {e}"[:300]})
    for t in lengths:
        q, k, v, log_i, grad = train_attention_inputs(dev, dtype, b, h, g, d, t)
        name = f"train attention+log I fwd+bwd t={t} b={b} h={h} g={g}"
        flops = 3 * 4 * b * h * d * t * (t + 1) / 2
        nbytes = 3 * (4 * b * h * t * d) * q.element_size() + 2 * log_i.numel() * 4

        def sdpa():
            o, _ = reference.attention(q, k, v, scale=d ** -0.5, bias=log_i, causal=False)  # as training passes it
            torch.autograd.backward(o, grad)

        impls = {"sdpa": sdpa}
        log_i_cast = log_i.detach().to(dtype).requires_grad_()
        if dev.type == "cuda" and efficient.usable(q, k, v, log_i_cast):
            def memory_efficient():
                torch.autograd.backward(efficient.attention(q, k, v, log_i_cast, d ** -0.5), grad)
            impls["efficient"] = memory_efficient
        if dev.type == "cuda" and "causal_bias" in kernels.TRITON:
            def ours():
                torch.autograd.backward(kernels.TRITON["causal_bias"](q, k, v, log_i_cast, d ** -0.5), grad)
            impls["triton"] = ours
        if flex is not None:
            mask = create_block_mask(lambda bb, hh, qi, ki: ki <= qi, None, None, t, t, device=dev.type)

            def flex_run():
                bias = log_i

                def score_mod(score, bb, hh, qi, ki):
                    return score + bias[bb, 0, qi, ki]
                o = flex(q, k, v, score_mod=score_mod, block_mask=mask, scale=d ** -0.5, enable_gqa=True)
                torch.autograd.backward(o, grad)
            impls["flex"] = flex_run
        for impl, fn in impls.items():
            try:
                out.append(row(name, impl, timeit(fn, dev, reps), nbytes, flops, fl))
            except Exception as e:  # noqa: BLE001 - one failing baseline must not end the run
                out.append({"case": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


# Launch shapes (block_m, block_n, num_warps, num_stages) to try for kernels.triton_causal_bias in half types at
# d <= 64, the table's own first: each compiles for sm_90 on the CPU under Triton 3.6 and 3.9 without spilling
# (a shape the sweep picks goes into LAUNCH, where tests/test_kernels_compile.py holds it to that)
TRAIN_LAUNCH_CANDIDATES = {"forward": [(64, 64, 8, 3), (64, 32, 4, 3)],
                           "kv": [(32, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
                           "q": [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)]}


def tune_train_attention(dev, dtype, reps, b=4, h=9, g=3, d=64, t=1024, rounds: int = 5) -> dict:
    """Forward + backward ms of our pruned-step attention (kernels.triton_causal_bias) with each kernel's candidate
    launch shapes, one kernel varied at a time, the others at the table's: {kernel: [{launch, ms, ms_rounds,
    vs_table}, ...]}. Each shape is timed once a round, the rounds interleaved, and ms is the median: two H200 calls
    of one timing each can disagree by up to 40 % on one shape. vs_table: the median over rounds of the
    shape's time over the table's own shape's (each kernel's first candidate) in the same round. Half types at
    d <= 64 (SmolLM2's and the GPU config's heads); the table is put back afterwards."""
    from kernels import triton_causal_bias as cb
    q, k, v, log_i, grad = train_attention_inputs(dev, dtype, b, h, g, d, t)
    log_i = log_i.detach().to(dtype).requires_grad_()  # (in the inputs' dtype, as a bf16 autocast step hands it)
    table = dict(cb.LAUNCH["half"])
    samples: dict[tuple, list[float]] = {}
    errors: dict[tuple, str] = {}
    try:
        for i in range(rounds):
            for kernel, shapes in TRAIN_LAUNCH_CANDIDATES.items():
                turn = i % len(shapes)  # (each round starts at another shape: no shape is always timed first)
                for shape in shapes[turn:] + shapes[:turn]:
                    if (kernel, shape) in errors:
                        continue
                    cb.LAUNCH["half"] = table | {kernel: shape}
                    try:
                        ms = 1e3 * timeit(lambda: torch.autograd.backward(cb.attention(q, k, v, log_i, d ** -0.5),
                                                                          grad), dev, reps)
                    except Exception as e:  # noqa: BLE001 - a shape that fails to compile or launch is reported
                        errors[kernel, shape] = f"{type(e).__name__}: {e}"[:300]
                        continue
                    samples.setdefault((kernel, shape), []).append(ms)
    finally:
        cb.LAUNCH["half"] = table
    out: dict[str, list] = {}
    for kernel, shapes in TRAIN_LAUNCH_CANDIDATES.items():
        base = samples.get((kernel, shapes[0]), [])
        for shape in shapes:
            if (kernel, shape) in errors:
                out.setdefault(kernel, []).append({"launch": list(shape), "error": errors[kernel, shape]})
                continue
            ms = samples[kernel, shape]
            row = {"launch": list(shape), "ms": statistics.median(ms), "ms_rounds": ms}
            if len(base) == len(ms):  # (paired by round; not where the table's own shape failed)
                row["vs_table"] = statistics.median(m / b_ for m, b_ in zip(ms, base))
            out.setdefault(kernel, []).append(row)
    return out


def bench_keep(dev, fl, reps, b, t, alpha=2.5) -> list[dict]:
    """Context pruning's training chain (scores -> log I, I, and the gradient back), forward + backward of one
    layer: the Triton kernels (kernels.triton_keep) against the PyTorch reference."""
    x = torch.randn(b, t, t, device=dev) * 2
    # what a training step hands back: I feeds only the mass, whose gradient is one number
    g_log, g_mass = torch.randn_like(x), torch.ones((), device=dev)
    name = f"log I chain fwd+bwd, gradients of log I and mass t={t} b={b} alpha={alpha}"
    nbytes = 8 * 4 * x.numel()  # forward reads x and writes log I, I, ratio; backward reads three, writes one
    impls = {"reference": reference}
    if dev.type == "cuda" and "log_keep" in kernels.TRITON:
        from kernels import triton_keep
        impls["triton"] = triton_keep
    out = []
    for impl, mod in impls.items():
        def fn(mod=mod):
            _, keep, ratio, _ = mod.log_keep(x, alpha=alpha)
            mod.log_keep_grad(g_log, None, keep, ratio, g_mass)
        try:
            out.append(row(name, impl, timeit(fn, dev, reps), nbytes, 0, fl))
        except Exception as e:  # noqa: BLE001
            out.append({"case": name, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


def tune(dev, dtype, reps) -> dict:
    """Sweep the launch shapes of prefill (t = 8192) and decode (32k context, batch 8) per head width;
    returns the fastest of each (kernels.triton_attention's PREFILL_LAUNCH / DECODE_LAUNCH take them; with
    --dtype float32, DECODE_LAUNCH_FP32 the decode's)."""
    from kernels import triton_attention
    best = {"prefill": {}, "decode": {}}
    for d in (64, 128):
        q, k, v = (torch.randn(1, 16, 8192, d, device=dev, dtype=dtype) for _ in range(3))
        trials = []
        for bm in (64, 128):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        def fn():
                            triton_attention.prefill(q, k, v, scale=d ** -0.5, block_m=bm, block_n=bn,
                                                     num_warps=warps, num_stages=stages)
                        try:
                            trials.append((timeit(fn, dev, reps), (bm, bn, warps, stages)))
                        except Exception:  # noqa: BLE001 - out of shared memory for this shape: not a candidate
                            continue
        ms, cfg = min(trials)
        best["prefill"][d] = {"launch": cfg, "ms": ms * 1e3, "tried": len(trials)}
        qd = torch.randn(8, 16, 1, d, device=dev, dtype=dtype)
        kd, vd = (torch.randn(8, 2, 32768, d, device=dev, dtype=dtype) for _ in range(2))
        trials = []
        for bn in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    def fn():
                        triton_attention.decode(qd, kd, vd, scale=d ** -0.5, block_n=bn, num_warps=warps,
                                                num_stages=stages)
                    try:
                        trials.append((timeit(fn, dev, reps), (bn, warps, stages)))
                    except Exception:  # noqa: BLE001
                        continue
        ms, cfg = min(trials)
        best["decode"][d] = {"launch": cfg, "ms": ms * 1e3, "tried": len(trials)}
    return best


def _ms(rows, case, impl):
    return next((r["ms"] for r in rows if r.get("case") == case and r.get("impl") == impl and "ms" in r), None)


def targets(rows: list[dict]) -> list[dict]:
    """The issue's GPU targets, each as measured / target from this run's rows (None where a row is missing)."""
    out = []
    for r in rows:
        c = r.get("case", "")
        if r.get("impl") == "triton" and c.startswith(("decode mqa", "decode mhe-mul")) and "ms" in r:
            ctx = int(c.split("ctx=")[1].split()[0])
            if ctx >= 8192:
                mha = _ms(rows, c.replace("mqa", "mha").replace("mhe-mul", "mha"), "triton")
                out.append({"target": f"{c}: within 1.5x of the bandwidth floor", "value": r["x_floor"], "goal": 1.5,
                            "met": r["x_floor"] <= 1.5})
                if mha:
                    out.append({"target": f"{c}: >= 3x faster than MHA decode", "value": mha / r["ms"], "goal": 3.0,
                                "met": mha / r["ms"] >= 3.0})
        if r.get("impl") == "triton" and c.startswith("prefill") and "ms" in r:
            flex = _ms(rows, c, "flex")
            if flex:
                out.append({"target": f"{c}: >= 0.9x FlexAttention speed", "value": flex / r["ms"], "goal": 0.9,
                            "met": flex / r["ms"] >= 0.9})
        if r.get("impl") in ("triton", "triton_graph", "triton_graph_keep_pass") and c.startswith("compact decode") \
                and r.get("live_share") == 0.1:
            # launched (a Python call each) and replayed from a graph (the decode step's own case, with and without
            # its keep pass), each against dense MHA decode timed the same way
            ctx, batch = c.split("ctx=")[1].split()[0], c.split("batch=")[1]
            dense = _ms(rows, f"decode mha ctx={ctx} batch={batch}", r["impl"].replace("_keep_pass", ""))
            how = {"triton_graph": " (graph replay)", "triton_graph_keep_pass": " (graph replay, keep pass)"}.get(
                r["impl"], "")
            if dense:
                out.append({"target": f"{c}: >= 5x faster than dense MHA decode{how}", "value": dense / r["ms"],
                            "goal": 5.0, "met": dense / r["ms"] >= 5.0})
                # the most any live share could give, timed: dense over the same call at FIXED_SLOTS live slots
                fixed = _ms(rows, c.replace("live=0.1", f"live={FIXED_SLOTS / int(ctx):g}"), r["impl"])
                if fixed:
                    out[-1] |= {"fixed_ms": fixed, "ceiling": dense / fixed}
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per case: every impl's time relative to the fastest baseline that is not ours."""
    by_case: dict[str, dict[str, float]] = {}
    for r in rows:
        if "ms" in r:
            by_case.setdefault(r["case"], {})[r["impl"]] = r["ms"]
    out = []
    for case, impls in by_case.items():
        base = {k: v for k, v in impls.items() if k.startswith(("sdpa", "flex", "efficient"))}  # (PyTorch's own)
        if base:
            best = min(base, key=base.get)
            out.append({"case": case, "baseline": best}
                       | {f"{k}_vs_baseline": v / base[best] for k, v in impls.items()})
    return out


def markdown(result: dict) -> str:
    """A short table: per case, each implementation's time and its multiple of the floor."""
    env, fl = result["environment"], result["floors"]
    lines = [f"# Kernel benchmark: {env['device']}", "",
             f"{env['date']}, torch {env['torch']}, triton {env['triton']}, {result['dtype']}. Floors measured in the "
             f"same run: copy {fl['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul {fl['matmul_flops_per_s'] / 1e12:.3f} "
             f"TFLOP/s. Triton: {result['triton']}. FlexAttention: {result['flex']}.", "",
             "| case | implementation | ms | GB/s | TFLOP/s | x floor |", "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "ms" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['GB_s']:.1f} | {r['TFLOP_s']:.3f} | "
                         f"{r['x_floor']:.1f} |")
        else:
            lines.append(f"| {r['case']} | {r['impl']} | error: {r['error'][:80]} | | | |")
    if result.get("targets"):
        lines += ["", "| target | measured | goal | met |", "|---|---:|---:|---|"]
        lines += [f"| {t['target']} | {t['value']:.2f} | {t['goal']} | {'yes' if t['met'] else 'no'} |"
                  for t in result["targets"]]
        ceilings = [t for t in result["targets"] if "ceiling" in t]
        if ceilings:  # a target the fixed cost alone rules out
            lines += ["", f"Compacted decode's fixed cost (the same call at {FIXED_SLOTS} live slots) and the most it "
                      "allows against dense:", "", "| target | fixed, ms | ceiling |", "|---|---:|---:|"]
            lines += [f"| {t['target']} | {t['fixed_ms']:.4f} | {t['ceiling']:.2f} |" for t in ceilings]
    if result["end_to_end"]:
        lines += ["", "| model | kernel path | context | decode tokens/s (median step) |", "|---|---|---:|---:|"]
        lines += [f"| {m['model']} | {m['path']} | {m['context']} | {m['tokens_per_s']:.1f} |"
                  for m in result["end_to_end"]]
    return "\n".join(lines) + "\n"


def environment(dev) -> dict:
    import triton
    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if dev.type == "cuda":
        env["device"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"cpu: {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return env


SECTIONS = ["prefill", "decode", "compact", "lag", "train_attention", "log_I_chain"]


def main(argv=None) -> int:
    args, sections, contexts = _parse(argv)
    from models.device import resolve
    dev = resolve(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if dev.type == "cuda" else torch.float32
    cuda = dev.type == "cuda"
    sizes = _sizes(args.quick, cuda, contexts)
    budget = (40 if cuda else 2) * 2 ** 30
    fl = floors(dev, dtype)
    print(f"device {dev}: copy {fl['copy_bytes_per_s'] / 1e9:.1f} GB/s, matmul {fl['matmul_flops_per_s'] / 1e12:.2f} "
          f"TFLOP/s", file=sys.stderr)
    flex = flex_fn(dev) if not args.quick and not args.no_flex and "prefill" in sections \
        else (None, "skipped in --quick, by --no-flex or with its sections left out")
    rows = _time_sections(args, sections, dev, dtype, sizes, fl, flex, budget)
    models = bench_models(dev, sizes["tokens"], [m for m in args.models.split(",") if m])
    tuned = None
    if args.tune and cuda:
        t0 = time.perf_counter()
        tuned = tune(dev, dtype, sizes["reps"])
        print(f"tune: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tuned_train = None
    if args.tune_train and cuda and dtype != torch.float32 and "causal_bias" in kernels.TRITON:
        t0 = time.perf_counter()
        tuned_train = tune_train_attention(dev, dtype, sizes["reps"])
        print(f"tune train attention: {time.perf_counter() - t0:.1f} s; {json.dumps(tuned_train)}", file=sys.stderr)
    result = {"environment": environment(dev), "dtype": str(dtype), "floors": fl,
              "flex": "ok" if flex[0] is not None else flex[1],
              "triton": "timed" if cuda else "not timed: no CUDA device (the interpreter is a correctness tool)",
              "rows": rows, "ratios": ratios(rows), "targets": targets(rows), "tuned_launch": tuned,
              "tuned_train_launch": tuned_train,
              "end_to_end": models}
    _print_result(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(markdown(result))
    return 0


def _parse(argv) -> tuple[argparse.Namespace, list[str], list[int] | None]:
    """The arguments, the sections to time and the decode contexts asked for (None: the device's)."""
    ap = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="write a short markdown table here")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="toy sizes (a smoke run)")
    ap.add_argument("--tune-train", action="store_true",
                    help="CUDA, half types: also time our pruned-step attention's candidate launch shapes "
                         "(kernels.triton_causal_bias; TRAIN_LAUNCH_CANDIDATES)")
    ap.add_argument("--no-flex", action="store_true",
                    help="leave FlexAttention out (its compile and autotuning alone can outlast a short GPU call)")
    ap.add_argument("--tune", action="store_true", help="CUDA: also sweep the kernels' launch shapes")
    ap.add_argument("--models", default="assets/models/mha,assets/models/mhe-mul,assets/models/mha-1024-pruned",
                    help="comma-separated model directories for the end-to-end decode rows ('' for none)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated: which of these to time (a short GPU call times only some)")
    ap.add_argument("--contexts", default=None, help="decode contexts, comma-separated (default: the device's)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="default: bfloat16 on CUDA, float32 elsewhere (float32 on CUDA: the app's default there)")
    args = ap.parse_args(argv)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    if not sections:
        ap.error(f"--sections names none; known: {', '.join(SECTIONS)}")
    if set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; known: {', '.join(SECTIONS)}")
    try:
        contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else None
    except ValueError:
        ap.error(f"--contexts takes comma-separated token counts, got {args.contexts!r}")
    return args, sections, contexts


def _sizes(quick: bool, cuda: bool, contexts: list[int] | None) -> dict:
    """The cases' sizes and repetitions: toy ones under --quick, else the device's (decode contexts as asked)."""
    if quick:
        sizes = dict(prefill=[64], contexts=[128], batches=[1, 2], lag=[64], reps=2, tokens=4, compact_s=256,
                     compact_b=[1])
    elif cuda:  # the compacted target's shapes: 16k, batch 1 and 64 (the issue's)
        sizes = dict(prefill=[512, 1024, 2048, 4096, 8192], contexts=[1024, 4096, 16384, 32768],
                     batches=[1, 8, 64], lag=[256, 1024, 4096], reps=20, tokens=64, compact_s=16384,
                     compact_b=[1, 64])
    else:
        sizes = dict(prefill=[512, 1024, 2048], contexts=[1024, 4096, 16384], batches=[1, 8],
                     lag=[256, 1024], reps=5, tokens=32, compact_s=16384, compact_b=[1])
    if contexts:
        sizes["contexts"] = contexts
    return sizes


def _time_sections(args, sections: list[str], dev, dtype, sizes: dict, fl: dict, flex, budget: int) -> list[dict]:
    """The rows of each section asked for, in SECTIONS' order, each section's time on stderr."""
    cuda = dev.type == "cuda"
    rows = []
    steps = [("prefill", lambda: bench_prefill(dev, dtype, sizes["prefill"], fl, sizes["reps"], flex)),
             ("decode", lambda: bench_decode(dev, dtype, sizes["contexts"], sizes["batches"], fl, sizes["reps"],
                                             budget)),
             ("compact", lambda: bench_compact(dev, dtype, sizes["compact_s"], sizes["compact_b"], fl, sizes["reps"],
                                               budget)),
             ("lag", lambda: bench_lag(dev, dtype, sizes["lag"], fl, sizes["reps"])),
             ("train attention", lambda: bench_train_attention(dev, dtype, fl, sizes["reps"],
                                                               lengths=(128,) if args.quick else (1024, 2048),
                                                               with_flex=not args.no_flex)),
             ("log I chain", lambda: bench_keep(dev, fl, sizes["reps"], *((1, 64) if args.quick else
                                                                         (32, 1024) if cuda else (2, 1024))))]
    for name, fn in steps:
        if name.replace(" ", "_") not in sections:
            continue
        t0 = time.perf_counter()
        rows += fn()
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return rows


def _print_result(result: dict) -> None:
    """Every row, the targets, the tuned launch and the end-to-end rates, on stdout."""
    for r in result["rows"]:
        if "ms" in r:
            print(f"{r['case']:<44} {r['impl']:<16} {r['ms']:9.3f} ms {r['GB_s']:8.1f} GB/s "
                  f"{r['TFLOP_s']:7.3f} TFLOP/s  x{r['x_floor']:.1f} floor")
        else:
            print(f"{r['case']:<44} {r['impl']:<16} error: {r['error']}")
    for t in result["targets"]:
        print(f"target {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['value']:.2f} (goal {t['goal']})")
    if result["tuned_launch"]:
        print(f"tuned launch: {json.dumps(result['tuned_launch'])}")
    for m in result["end_to_end"]:
        print(f"end to end {m['mixer']}{' pruned' if m['pruned'] else ''} [{m['path']}]: "
              f"{m['tokens_per_s']:.1f} tokens/s")


if __name__ == "__main__":
    raise SystemExit(main())
