"""Decode steps replayed from a CUDA graph (gpt-fast's answer to per-token launch overhead, without
torch.compile): over a fixed-shape state (models.fixed_shape) a one-token step launches the same kernels on the
same buffers every time, so it is captured once and replayed for the price of one launch. The compacted cache of
context pruning keeps its shapes too (models.pruning.fixed_compact): it compacts in place between steps, and only
its growth (new buffers) asks for a new capture.

A captured step belongs to its cache's buffers and to the weights it read, so the two live together in a
`Captured` entry, kept per model, batch, capacity bucket, weights and kernel choice, and reused by the next
generation (capture costs a few eager steps). An entry is checked out by one decoder at a time: app sessions
share a model, never an entry. A capture that fails (another thread's work on the device can end it) leaves
the entry decoding eagerly, with the reason kept.
"""
from __future__ import annotations

import threading
import weakref

import torch

from models import packing

MIN_CAPACITY = 256
WARMUP_STEPS = 2  # eager steps before capture: Triton compiles, cuBLAS picks its kernels
MAX_FREE = 2      # entries kept per key once given back


def refusal(model, state: str, policy=None) -> str | None:
    """Why this model's decode cannot keep static shapes over `state` ("static" or "compacted") (None: it can)."""
    if policy is not None:
        return (f"static-shape decode serves the learned rule or a dense model; an eviction policy "
                f"({policy.method}) decodes eagerly")
    if state not in ("static", "compacted"):
        return f"static-shape decode runs over the static or the compacted cache, not {state!r}"
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
    return min(max(need, cap), context)


class Captured:
    """A cache with fixed shapes and, once captured, the graph of one decode step over it. The compacted
    cache compacts in place between steps; when it grows (new buffers), the step is captured again."""

    def __init__(self, model, batch: int, capacity: int, kind: str = "static"):
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: reset() may run outside inference mode
            if kind == "static":
                self.state = model.new_cache(batch=batch, capacity=capacity, fixed=True)
            else:
                self.state = model.new_compact_cache(batch=batch, capacity=capacity, fixed=True)
        self.batch = batch
        self.allocations = self.state.allocations  # the buffers the graph was captured over
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None   # the graph's input [B,1]
        self.logits: torch.Tensor | None = None   # the graph's output [B,1,V]
        self.paths: dict[str, str] = {}
        self.warm = 0
        self.failed: str | None = None           # why capture failed: this entry decodes eagerly
        self.recaptures = 0

    def step(self, model, tokens: torch.Tensor, eager) -> tuple[torch.Tensor, bool]:
        """One token per row (tokens [B,1]) -> (logits [B,V], replayed). eager(tokens) runs the step without a
        graph (and counts it on the host); a replay is counted by the caller."""
        if self.failed is not None:
            return eager(tokens), False
        if self.graph is not None and self.state.allocations != self.allocations:  # the cache grew: capture again
            self.graph, self.logits, self.warm = None, None, 0
            self.recaptures += 1
        if self.graph is None and self.warm < WARMUP_STEPS:
            # on the caller's stream: the pooled side streams are left to the (locked) capture alone
            self.warm += 1
            return eager(tokens), False
        if self.graph is None and not self._capture(model, tokens):
            return eager(tokens), False
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits[:, 0].clone(), True  # the graph overwrites its output at the next replay

    def _capture(self, model, tokens: torch.Tensor) -> bool:
        """Record one step (nothing runs: the cache is left as it was). One capture at a time in the process,
        on a stream of its own; thread_local, so other sessions' threads may keep launching work."""
        import kernels
        with torch.inference_mode(False):  # a plain tensor, like the cache: copied into outside inference mode too
            self.tokens = tokens.clone()
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream()
        try:
            with _capture_lock, kernels.record_paths() as paths, \
                    torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                self.logits = model(self.tokens, cache=self.state, last_only=True).logits
        except RuntimeError as e:  # e.g. invalidated by a device-wide sync elsewhere: decode eagerly from here
            torch.cuda.set_stream(caller)  # a failed capture_end() skips the switch back to the caller's stream
            self.failed = f"{type(e).__name__}: {e}"[:300]
            self.logits = None
            return False
        self.graph, self.paths, self.allocations = graph, dict(paths), self.state.allocations
        return True


_capture_lock = threading.Lock()
_lock = threading.Lock()
_free: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: [Captured]}


def _weights(model) -> tuple:
    """Where every weight lives, its dtype and the kernel choice (the keep pass's too): a captured step reads them as
    they were (moving or recasting the model reallocates them) and launches what was chosen at capture."""
    import kernels
    from kernels import settings
    return (*packing.where(model), settings.get("MIXSCOPE_KERNELS"), kernels.keep_pass())


def _constants_current(model, entry: Captured) -> bool:
    """Whether a pooled entry's cache still holds the learned rule's constants as the model has them now (a
    training step may have moved them in place, and a fused optimizer step does not move a tensor's version):
    [W^Qint | W^Kint] is refilled in place where it moved (the graph reads it there); False when beta, lambda or
    the sink count moved, which the captured kernels hold as numbers."""
    for block, layer in zip(model.blocks, entry.state.layers):
        held = getattr(layer, "rule_constants", None)
        if held is None:
            continue
        now = block.mixer.pruning.decode_constants()
        if (held["beta"], held["lam"], held["sinks"]) != (now["beta"], now["lam"], now["sinks"]):
            return False
        if not torch.equal(held["qk"], now["qk"]):
            held["qk"].copy_(now["qk"])
    return True


def checkout(model, batch: int, capacity: int, kind: str = "static") -> Captured:
    """A free entry for (model, batch, capacity, cache kind), emptied, or a new one."""
    weights = _weights(model)
    key = (batch, capacity, weights, kind)
    with _lock:
        kept = _free.setdefault(model, {})
        for stale in [k for k in kept if k[2] != weights]:  # captured over weights that have moved since
            del kept[stale]
        entries = kept.get(key, [])
        entry = entries.pop() if entries else None
    if entry is not None:
        with torch.no_grad():
            entry = entry if _constants_current(model, entry) else None
    if entry is None:
        entry = Captured(model, batch, capacity, kind)
    else:
        with torch.no_grad():
            entry.state.reset()
    entry.key = key
    return entry


def give_back(model, entry: Captured) -> None:
    if entry.failed is not None:  # the next generation tries a fresh capture
        return
    with _lock:
        entries = _free.setdefault(model, {}).setdefault(entry.key, [])
        if len(entries) < MAX_FREE:
            entries.append(entry)


def release(model) -> None:
    """Drop every kept entry of `model` and its packed projections (their caches', graphs' and copies' memory go
    back to PyTorch's allocator)."""
    with _lock:
        _free.pop(model, None)
    packing.release(model)
