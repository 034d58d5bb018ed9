"""Decode steps replayed from a CUDA graph (gpt-fast's answer to per-token launch overhead, without
torch.compile): over a static-shape cache (models.cache.DecodeCache.fix_shapes) a one-token step launches the
same kernels on the same buffers every time, so it is captured once and replayed for the price of one launch.

A captured step belongs to its cache's buffers, so the two live together in a `Captured` entry, kept per model
and reused by the next generation of the same batch and capacity bucket (capture costs a few eager steps).
An entry is checked out by one decoder at a time: app sessions share a model, never an entry.
"""
from __future__ import annotations

import threading
import weakref

import torch

MIN_CAPACITY = 256
WARMUP_STEPS = 2  # eager steps (on a side stream) before capture: Triton compiles, cuBLAS picks its kernels
MAX_FREE = 2      # entries kept per (model, batch, capacity) once given back


def refusal(model, state: str) -> str | None:
    """Why this model's decode cannot keep static shapes (None: it can)."""
    if state != "static":
        return "static-shape decode runs over the static cache (the compacted cache changes shape as it evicts)"
    for block in model.blocks:
        m = block.mixer
        if not hasattr(m, "kv_shared"):
            return f"static-shape decode serves attention mixers; {model.config.mixer} mixes past inputs by lag"
        if m.pattern != "dense":
            return f"static-shape decode serves dense attention, not the {m.pattern} pattern"
    return None


def capacity_bucket(need: int, context: int) -> int:
    """A power of two at least `need` (and MIN_CAPACITY), at most the context: generations of similar lengths
    share one captured graph, and the decode kernel reads only up to the length, so room costs memory alone."""
    cap = MIN_CAPACITY
    while cap < need:
        cap *= 2
    return max(need, min(cap, context))


class Captured:
    """A cache with fixed shapes and, once captured, the graph of one decode step over it."""

    def __init__(self, model, batch: int, capacity: int):
        self.batch, self.state = batch, model.new_cache(batch=batch, capacity=capacity)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None   # the graph's input [B,1]
        self.logits: torch.Tensor | None = None   # the graph's output [B,1,V]
        self.paths: dict[str, str] = {}
        self.warm = 0

    def step(self, model, tokens: torch.Tensor, eager) -> torch.Tensor:
        """One token per row (tokens [B,1]) -> logits [B,V]. eager(tokens) runs the step without a graph."""
        if self.graph is None and self.warm < WARMUP_STEPS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = eager(tokens)
            torch.cuda.current_stream().wait_stream(side)
            self.warm += 1
            return out
        if self.graph is None:
            import kernels
            self.tokens = tokens.clone()
            graph = torch.cuda.CUDAGraph()
            # thread_local: app sessions may run CUDA work in other threads while this one captures
            with kernels.record_paths() as paths, torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.logits = model(self.tokens, cache=self.state, last_only=True).logits
            self.graph, self.paths = graph, dict(paths)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits[:, 0].clone()  # the graph overwrites its output at the next replay


_lock = threading.Lock()
_free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(batch, capacity): [Captured]}


def checkout(model, batch: int, capacity: int) -> Captured:
    """A free entry for (model, batch, capacity), emptied, or a new one."""
    with _lock:
        entries = _free.setdefault(model, {}).get((batch, capacity), [])
        entry = entries.pop() if entries else None
    if entry is None:
        return Captured(model, batch, capacity)
    entry.state.reset()
    return entry


def give_back(model, entry: Captured) -> None:
    with _lock:
        entries = _free.setdefault(model, {}).setdefault((entry.batch, entry.state.capacity), [])
        if len(entries) < MAX_FREE:
            entries.append(entry)


def release(model) -> None:
    """Drop every kept entry of `model` (their caches and graphs' memory go back to PyTorch's allocator)."""
    with _lock:
        _free.pop(model, None)
