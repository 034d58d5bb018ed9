"""Static (preallocated) decode state, gpt-fast style: no reallocation while generating."""
from __future__ import annotations

import torch

from kernels.keep_rule import state_dtype
from models.backends import LayerState, State, Step, check_fits, static


class LayerCache(LayerState):
    """One layer's state: named buffers [batch, *lead, capacity, width], filled up to `length`.

    Attention keeps K and V here (a single group for MQA/MHE, K only when K is V);
    Extractors keep the window of past sub-layer inputs.
    """

    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, track_alive: bool = False):
        self.capacity = capacity
        self.length = 0
        self.buffers = {name: torch.zeros(batch, *shape[:-1], capacity, shape[-1], dtype=state_dtype(name, dtype),
                                          device=device) for name, shape in spec.items()}
        # context pruning: which cached positions are still kept (a dropped one stays dropped)
        self.alive = torch.ones(batch, capacity, dtype=torch.bool, device=device) if track_alive else None
        # static shapes (DecodeCache.fix_shapes): the length on the device, and the slots a step reads (length + 1)
        self.cursor: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None
        self.packed: dict | None = None  # fixed shapes: the block's packed projections (models.packing)
        self.merge_counts: torch.Tensor | None = None  # fixed shapes: the decode kernel's (kernels.attention)

    def append(self, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write the new positions (dim -2 of each tensor) and return views of everything so far."""
        if set(new) != set(self.buffers):
            raise ValueError(f"cache holds {sorted(self.buffers)}, got {sorted(new)}")
        t = next(iter(new.values())).shape[-2]
        end = self.length + t
        if end > self.capacity:
            raise ValueError(f"cache full: {self.length} + {t} positions exceed capacity {self.capacity}")
        for name, value in new.items():
            self.buffers[name][..., self.length:end, :] = value
        self.length = end
        return {name: buf[..., :end, :] for name, buf in self.buffers.items()}

    def fixed_step(self, q: torch.Tensor, record) -> bool:
        """Whether this call is a static-shape step (one query per row after fix_shapes, no diagnostics)."""
        return self.cursor is not None and q.shape[2] == 1 and record is None

    rotates = fixed_step  # a static-shape step takes q and k unrotated: it rotates them as it writes K (one kernel)

    def attend(self, mixer, x, q, k, v, record, rope=None):
        """The attention backend over this cache (models.backends.static); Extractors read the buffers alone.
        rope: the angle tables and positions of q and k, not rotated yet (only where `rotates` said so)."""
        return static.attend(mixer, self, x, q, k, v, record, rope)

    def buffers_device(self) -> torch.device:
        return next(iter(self.buffers.values())).device

    def nbytes(self) -> int:
        """Bytes holding live positions (what the state costs now, not what was reserved)."""
        return sum(buf[..., :self.length, :].numel() * buf.element_size() for buf in self.buffers.values())

    def allocated_bytes(self) -> int:
        """Bytes reserved for the state (every buffer at its capacity, and the step mask of a pruned model)."""
        held = sum(buf.numel() * buf.element_size() for buf in self.buffers.values())
        return held + (self.alive.numel() if self.alive is not None else 0)


def merge_counts(buffers: dict) -> torch.Tensor | None:
    """A fixed-shape layer's workspace for the decode kernel, which combines its splits itself with it (one count
    per row and K/V group, left zero by every launch; kernels.triton_attention.decode): None without K."""
    k = buffers.get("k")
    if k is None:
        return None
    with torch.inference_mode(False):  # a plain tensor, as the cache's marks
        return torch.zeros(k.shape[0] * k.shape[1], dtype=torch.int32, device=k.device)


class DecodeCache(State):
    """The whole model's decode state: one LayerCache per block."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers
        # static shapes (fix_shapes): the slot a step writes and the slots it reads, on the device, views of one
        # tensor so that a step moves both with one launch (step_done), not one per layer
        self.marks = self.cursor = self.filled = None

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """The new tokens follow what the cache holds. A one-token call after fix_shapes (no diagnostics) is a
        static-shape step: its position is the device-side cursor, with no host count."""
        t, start = idx.shape[1], self.length
        check_fits(start + t, context, "positions")
        fixed = self.cursor is not None and t == 1 and plain
        if fixed and start + 1 > self.capacity:  # index_copy_ past the buffers would be a device-side assert
            raise ValueError(f"cache full: {start} + 1 positions exceed capacity {self.capacity}")
        # (a copy: the rotary tables are memoised on the positions tensor, and the cursor outlives this forward)
        return Step(self.cursor.clone() if fixed else torch.arange(start, start + t, device=idx.device), fixed)

    def end(self, step: Step) -> None:
        if self.cursor is None:
            return
        if step.fixed:
            self.step_done()  # the host's count is the caller's (a replayed graph runs no Python)
        else:
            self.fix_shapes()  # a call of several tokens counted on the host: the cursor follows

    def fix_shapes(self) -> None:
        """From here on, one-token steps keep every shape: each layer writes at a device-side cursor and
        attends over its whole buffers up to it (gpt-fast's decode), so the step can be captured in a CUDA
        graph. The host count (`length`) is then kept by the caller (models.decode.Decoder), since a replayed
        graph runs no Python."""
        if self.marks is None:
            with torch.inference_mode(False):  # a plain tensor: reset() may run outside inference mode
                self.marks = torch.zeros(2, dtype=torch.long, device=self.layers[0].buffers_device())
            self.cursor, self.filled = self.marks[:1], self.marks[1:]
            for layer in self.layers:
                layer.cursor, layer.filled = self.cursor, self.filled
                layer.merge_counts = merge_counts(layer.buffers)
        self.cursor.fill_(self.length)  # in place: a captured graph holds them
        self.filled.fill_(self.length + 1)

    def step_done(self) -> None:
        """A static-shape step wrote its slot: the next writes one further and reads one more (on the device)."""
        self.marks.add_(1)

    def advance(self, t: int) -> None:
        """The host's count of positions, after a static-shape step that the device already counted."""
        for layer in self.layers:
            layer.length += t

    def reset(self) -> None:
        """Empty again, to be reused by the next generation (the buffers keep their memory; what is left in
        them is never read, since every read stops at the length)."""
        for layer in self.layers:
            layer.length = 0
            if layer.alive is not None:
                layer.alive.fill_(True)
        if self.marks is not None:
            self.cursor.zero_()
            self.filled.fill_(1)

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)
