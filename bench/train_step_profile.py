"""Where a training step's time goes, for any run config (issue: profile before fine-tuning a real model).

    python -m bench.train_step_profile --config configs/real/smollm2-pruned.json [--alphas 1,1.02,2,8] [--steps 2]
        [--batch 4] [--ab-alpha 2 | --cuda-graph] [--json FILE]

Builds the model of the config with random weights (the cost does not depend on their values), freezes what the
run freezes, and times what models.train runs a step (forward + backward under bf16 autocast on a GPU, the gradient
clipped, AdamW fused on a GPU) on random tokens at each alpha of the schedule (the alpha-sigmoid
takes a closed form at 1 and 2 and an interpolated table elsewhere), then lists the operators that took the most
time in the last step (torch.profiler) and, on a GPU, that step's summed kernel time and kernel count
(device_busy_s, device_kernels: a wall time well above the busy time is the host's). Alpha moves every training
step, so each step needs a new table: step_s adds its share, built as models.train builds them over the config's
schedule (table_cost: on a GPU 64 steps' tables at once, one batched bisection a side of alpha 2; on a CPU one a
step). Threads: torch's setting, reported.

A config that prunes is timed beside its dense twin in the same run: the same model without the rule, every
parameter training (what a dense run of it does). Each pruned row carries vs_dense, its tokens/s over the twin's
(issue target: >= 0.5), and each row its trainable and rule parameters. Under freeze_base the pruned run trains
the rule alone while its twin trains everything, so vs_dense there is not the rule's overhead (the JSON says so).
Each row notes the kernel paths its profiled step took (kernel_paths: on a GPU a pruned step's attention is
"efficient", kernels.efficient, or "triton" under MIXSCOPE_CAUSAL_BIAS=triton, kernels.triton_causal_bias);
--ab-alpha adds a row with that path switched off (causal_bias "0", causal_bias_off), one in our own kernels
("triton"), then one on PyTorch's again ("1"), so that the A/B compares neighbours. --cuda-graph replays both
models' forward and backward from CUDA graphs, as train.cuda_graph does (models.step_graph: one capture per form of
the alpha-sigmoid, in the first warm-up step at that form; each row's kernel_paths are those its capture took).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import kernels
from bench import env
from kernels import efficient
from models.adapters import set_trainable_params, trainable_params
from kernels.alpha_sigmoid import alpha_schedule
from models.pruning import pair_count, sparsity_loss
from kernels.alpha_sigmoid import AHEAD, clear_tables, needs_table, prepare_tables
from models.device import describe as device_name
from models.step_graph import GraphedLoss, eager_loss, form
from models.train import load_run_config
from models.transformer import DecoderLM


WARMUP = 2  # steps before timing: a fresh model's first steps also compile kernels and grow the allocator's pool


def step_times(model, opt, loss_of, x, y, gamma: float, pairs: int, steps: int, clip: float) -> list[float]:
    """loss_of(x, y) -> (LM loss, mass or None): models.step_graph's eager_loss, or its GraphedLoss."""
    out = []
    cuda = x.is_cuda
    for _ in range(steps):  # (the alpha-sigmoid's table is kept from the warm-up: table_cost adds its share)
        t0 = time.perf_counter()
        lm, mass = loss_of(x, y)
        loss = lm if mass is None else lm + sparsity_loss(mass, gamma, pairs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # (models.train clips, then steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def table_cost(alpha: float, dev, schedule: tuple[int, float, float]) -> dict:
    """What a training step pays for its alpha-sigmoid table, built as models.train builds them over the run's
    schedule (total steps, start, end): on a GPU the AHEAD steps' tables from the schedule's step nearest `alpha`
    in one call (one batched bisection a side of alpha 2), their share per step;
    on a CPU one table a step. Nothing at alpha 1, 2 or inf (closed forms)."""
    if not needs_table(alpha):
        return {"table_s_per_step": 0.0}
    total, start, end = schedule
    ahead = AHEAD if dev.type == "cuda" else 1
    at = min(range(total + 1), key=lambda s: abs(alpha_schedule(s, total, start, end) - alpha))
    block = [alpha_schedule(s, total, start, end) for s in range(at, at + ahead)] if ahead > 1 else [alpha]
    times = []
    for _ in range(3):
        clear_tables()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prepare_tables(block, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    clear_tables()
    spent = statistics.median(times)
    return {"table_s_per_step": spent / ahead, "table_block_s": spent, "tables_per_block": ahead,
            "block_from_step": at, "block_alphas": [round(block[0], 6), round(block[-1], 6)]}


def device_busy(events, top: int) -> dict:
    """The profiled step's GPU work: its kernels' (and copies') summed device time and how many ran. A step whose
    wall time is well above its busy time waits on the host (launches, Python), not on the GPU; then the host's
    own top operators (self CPU time) say where it waits. Empty on a CPU."""
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if not kernels:
        return {}
    host = sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: -e.self_cpu_time_total)
    return {"device_busy_s": sum(e.self_device_time_total for e in kernels) / 1e6,
            "device_kernels": sum(e.count for e in kernels),
            "host_top_ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
                             for e in host[:top]]}


def build(cfg, freeze_base: bool, dev):
    """The model of cfg with random weights, what the run trains set trainable, and its optimizer (AdamW, fused on
    a GPU as models.train builds it: one kernel for every parameter)."""
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(dev).train()
    set_trainable_params(model, trainable_params(model, freeze_base))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6,
                                    fused=dev.type == "cuda")


def profile_row(model, opt, alpha, x, y, gamma: float, pairs: int, args, graphed: GraphedLoss | None = None) -> dict:
    """Median step time and the top operators of one model at one alpha (None: a dense model); graphed: its
    forward and backward replayed from CUDA graphs (the warm-up captures a form's first step)."""
    if alpha is not None:
        model.set_alpha(alpha)
    # (bf16 autocast on a GPU, as models.train runs)
    loss_of = graphed or eager_loss(model, torch.bfloat16 if x.is_cuda else None)
    step_times(model, opt, loss_of, x, y, gamma, pairs, WARMUP, args.clip)
    times = step_times(model, opt, loss_of, x, y, gamma, pairs, args.steps, args.clip)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=acts) as prof, kernels.record_paths() as paths:
        step_times(model, opt, loss_of, x, y, gamma, pairs, 1, args.clip)
    replayed = graphed is not None and form(alpha) in graphed.graphs
    if replayed:  # (a replay notes nothing: the paths its capture took)
        paths = graphed.paths.get(form(alpha), {})
    key = "self_device_time_total" if x.is_cuda else "self_cpu_time_total"  # where the time is
    events = prof.key_averages()
    top = [{"op": e.key, "self_s": getattr(e, key) / 1e6}
           for e in sorted(events, key=lambda e: -getattr(e, key))[:args.top]]
    busy = device_busy(events, args.top)
    # operators dispatched in the step (every aten call, launched or not): on a GPU a step that waits on the host
    # pays for each of them, so the count compares the two models' host work on any machine
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    table = table_cost(alpha, x.device, args.schedule) if alpha is not None else {}
    step = statistics.median(times) + table.get("table_s_per_step", 0.0)
    label = ("dense twin" if alpha is None else f"alpha {alpha:g}") + f" (attention: {paths.get('attention')})"
    print(f"{label}: {step:.2f} s/step ({x.shape[0]} x {x.shape[1]} tokens); top: "
          + ", ".join(f"{t['op']} {t['self_s']:.2f}s" for t in top[:5]), file=sys.stderr, flush=True)
    rule = sum(p.numel() for b in model.blocks if getattr(b.mixer, "pruning", None) is not None
               for p in b.mixer.pruning.parameters())
    failed = {"capture_failed": graphed.failed[form(alpha)]} if graphed and form(alpha) in graphed.failed else {}
    # (a path whose kernels gave NaN without raising writes it into the weights: every later row would time those)
    finite = bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())
    return {"model": "dense" if alpha is None else "pruned", "alpha": alpha, "cuda_graph": replayed, **failed,
            "weights_finite": finite, "step_s": step,
            "step_s_each": [round(t, 6) for t in times], "aten_calls": aten, "kernel_paths": dict(paths),
            **table, **busy,
            "tokens_per_s": x.numel() / step, "trainable_params": sum(p.numel() for p in model.parameters()
                                                                      if p.requires_grad),
            "rule_params": rule, "top_ops": top}


def main(argv=None) -> int:
    args = _parse(argv)
    dev = torch.device(args.device)
    cfg, tc, _ = load_run_config(args.config)
    b = args.batch or tc.batch_size
    args.schedule = (tc.alpha_steps or tc.steps, tc.alpha_start, tc.alpha_end)  # (table_cost: the run's schedule)
    args.clip = tc.grad_clip
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.context), generator=gen).to(dev)
    y = torch.randint(0, cfg.vocab_size, (b, cfg.context), generator=gen).to(dev)
    pairs = pair_count(cfg.n_layers, cfg.context)
    rows = []
    head = {"config": args.config, "batch": b, "context": cfg.context, "layers": cfg.n_layers,
            "cuda_graph": args.cuda_graph, "threads": torch.get_num_threads(),
            **({"vs_dense_note": "the pruned run trains the rule alone (freeze_base), its dense twin every "
                                "parameter: vs_dense is not the rule's overhead"} if cfg.prune and tc.freeze_base
               else {}),
            "device": device_name(dev), "torch": torch.__version__}
    save = functools.partial(_save, args.json, head, rows)

    if cfg.prune:  # the dense twin first, then freed: one model in memory at a time
        _dense_twin(cfg, dev, x, y, tc.gamma, pairs, args, rows, save)
    model, opt = build(cfg, tc.freeze_base, dev)
    head["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    alphas = [float(a) for a in args.alphas.split(",")] if cfg.prune else [None]
    graphed = None
    if args.cuda_graph:  # (every form a row times is captured: each takes WARMUP + steps + 1 steps)
        graphed = GraphedLoss(model, [a for a in alphas if a is not None], min_steps=1)
    for alpha in alphas:
        rows.append(profile_row(model, opt, alpha, x, y, tc.gamma, pairs, args, graphed))
        if cfg.prune:
            rows[-1]["vs_dense"] = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        save(False)
    if cfg.prune and args.ab_alpha is not None:
        _ab_rows(model, opt, x, y, tc.gamma, pairs, args, dev, rows, save)
    save(True)
    return 0


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.train_step_profile")
    ap.add_argument("--config", required=True)
    ap.add_argument("--alphas", default="1,1.02,2,8")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="default: the config's batch_size")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ab-alpha", type=float, default=None,
                    help="three more pruned rows at this alpha, one per MIXSCOPE_CAUSAL_BIAS: 0 (attention on SDPA "
                         "with the bias alone, every block computed), triton (kernels.triton_causal_bias), 1 "
                         "(kernels.efficient): the A/B of the three")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="each model's forward and backward replayed from CUDA graphs, as train.cuda_graph runs them "
                         "(models.step_graph; --device cuda, not with --ab-alpha: a graph keeps the path it captured)")
    args = ap.parse_args(argv)
    if args.cuda_graph and (args.device != "cuda" or args.ab_alpha is not None):
        ap.error("--cuda-graph needs --device cuda and no --ab-alpha")
    return args


def _save(path: str | None, head: dict, rows: list[dict], complete: bool) -> None:
    """The JSON so far, after every row (complete: false until the last): a process that dies keeps its rows."""
    if not path:
        return
    # (set when PyTorch's operator refused the causal bias: the pruned rows then ran SDPA, kernel_paths say)
    refused = efficient._refused[0] if efficient._refused else None
    result = head | {"causal_bias_refused": refused, "complete": complete,
                     "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    part = f"{path}.part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    os.replace(part, path)


def _dense_twin(cfg, dev, x, y, gamma: float, pairs: int, args, rows: list[dict], save) -> None:
    """The pruned config's dense twin profiled into rows (then saved), and freed before the pruned model is built."""
    dense = dataclasses.replace(cfg, prune=False, prune_distance=False, prune_sinks=0)
    twin, twin_opt = build(dense, False, dev)
    twin_graphed = GraphedLoss(twin) if args.cuda_graph else None
    rows.append(profile_row(twin, twin_opt, None, x, y, gamma, pairs, args, twin_graphed))
    save(False)
    failed = bool(twin_graphed and twin_graphed.failed)
    del twin, twin_opt, twin_graphed
    gc.collect()  # (a graphed module holds itself through its forward: the twin's graphs go with a collection)
    if dev.type == "cuda" and not failed:  # (after a failed capture torch < 2.12 may assert in empty_cache)
        torch.cuda.empty_cache()


def _ab_rows(model, opt, x, y, gamma: float, pairs: int, args, dev, rows: list[dict], save) -> None:
    """--ab-alpha's rows into rows (each saved): the pruned model at that alpha with its attention's path switched
    off, in our own kernels, then on again."""
    faulted = None
    # off, ours, then the default again right after: no row's place decides the A/B
    for switch in ("0", "triton", "1"):
        if faulted:  # a device fault leaves the process's CUDA context broken: no later row could run
            rows.append({"model": "pruned", "alpha": args.ab_alpha, "skipped": f"after a device fault: {faulted}"})
        else:
            try:
                with env("MIXSCOPE_CAUSAL_BIAS", switch):
                    rows.append(profile_row(model, opt, args.ab_alpha, x, y, gamma, pairs, args))
                rows[-1]["vs_dense"] = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
            except Exception as e:  # noqa: BLE001 - a path that fails (our kernels' first GPU run) loses its row
                said = f"{type(e).__name__}: {e}"[:500]
                rows.append({"model": "pruned", "alpha": args.ab_alpha, "error": said})
                opt.zero_grad(set_to_none=True)  # (AdamW steps only after a whole backward: its state is intact)
                if isinstance(e, torch.OutOfMemoryError):  # the path's own memory: freed, and the next row runs
                    gc.collect()
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                elif not efficient.refusal(e):  # a device fault (AcceleratorError)
                    faulted = said
        rows[-1] |= {"causal_bias": switch, "causal_bias_off": switch == "0"}
        save(False)


if __name__ == "__main__":
    raise SystemExit(main())
