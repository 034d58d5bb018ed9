"""Fixed-shape decode states: the static cache's (here) and the compacted cache's (models.pruning.fixed_compact).

Such a state is built as one (DecoderLM.new_cache / new_compact_cache with fixed=True) and serves every call as its
plain cache does until `fix_shapes()`, called once the prompt is in (models.decode.Decoder, models.graphs). From
then on a one-token call of every row without diagnostics is a fixed-shape step: it writes at device-side cursors
and reads the whole buffers up to them (gpt-fast's decode), so its shapes and addresses stay the same and it asks
the host nothing, and a CUDA graph can replay it. The host's count (`length`; a compacted layer's `end`) is then
kept by the caller (`advance`), since a replayed graph runs no Python. A call of several tokens, or with
diagnostics, still takes the plain path, and the cursors follow it.
"""
from __future__ import annotations

import torch

from models.backends import Step, check_fits, fixed
from models.cache import DecodeCache, LayerCache


def new_marks(n: int, device) -> torch.Tensor:
    """n longs on the device that a state's cursors are views of, so that a step moves them all with one launch (a
    plain tensor: reset() may run outside inference mode)."""
    with torch.inference_mode(False):
        return torch.zeros(n, dtype=torch.long, device=device)


def merge_counts(buffers: dict) -> torch.Tensor | None:
    """A fixed-shape layer's workspace for the decode kernel, which combines its splits itself with it (one count
    per row and K/V group, left zero by every launch; kernels.triton_attention.decode): None without K."""
    k = buffers.get("k")
    if k is None:
        return None
    with torch.inference_mode(False):  # a plain tensor, as the cache's marks
        return torch.zeros(k.shape[0] * k.shape[1], dtype=torch.int32, device=k.device)


class FixedLayerCache(LayerCache):
    """One layer of a FixedDecodeCache: a LayerCache's buffers, with (once the shapes are fixed) the `cursor` a step
    writes at and the `filled` count it reads (cursor + 1), views of the state's marks, and the decode kernel's
    `merge_counts`."""

    def __init__(self, plain: LayerCache):
        vars(self).update(vars(plain))  # its buffers, alive mask and count, taken over (nothing copied)
        self.cursor: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None
        self.merge_counts: torch.Tensor | None = None

    def fixed_step(self, q: torch.Tensor, record) -> bool:
        """Whether this call is a fixed-shape step (one query per row after fix_shapes, no diagnostics)."""
        return self.cursor is not None and q.shape[2] == 1 and record is None

    rotates = fixed_step  # a fixed-shape step takes q and k unrotated: it rotates them as it writes K (one kernel)

    def attend(self, mixer, x, q, k, v, record, rope=None):
        """A fixed-shape step's attention (models.backends.fixed), else the plain cache's. rope: the angle tables and
        positions of q and k, not rotated yet (only where `rotates` said so)."""
        if self.fixed_step(q, record):
            return fixed.attend_static(mixer, self, x, q, k, v, rope)
        if rope is not None:
            raise ValueError("only a static-shape step takes q and k unrotated")
        return super().attend(mixer, x, q, k, v, record)


class FixedDecodeCache(DecodeCache):
    """The static cache with fixed shapes: every layer's cursor and filled count are views of one tensor (`marks`)
    on the device, so that a step moves them all with one launch (step_done)."""

    allocations = 0  # its buffers are never reallocated: a captured step stays valid (models.graphs)

    def __init__(self, layers: list[LayerCache]):
        super().__init__([FixedLayerCache(layer) for layer in layers])
        self.marks = self.cursor = self.filled = None

    @property
    def shapes_fixed(self) -> bool:
        """Whether fix_shapes() has run: a one-token call (no diagnostics) is now a fixed-shape step."""
        return self.marks is not None

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """A fixed-shape step's position is the device-side cursor, with no host count; any other call is the plain
        cache's."""
        if not (self.shapes_fixed and idx.shape[1] == 1 and plain):
            return super().begin(idx, context, positions, valid, plain)
        start = self.length
        check_fits(start + 1, context, "positions")
        if start + 1 > self.capacity:  # index_copy_ past the buffers would be a device-side assert
            raise ValueError(f"cache full: {start} + 1 positions exceed capacity {self.capacity}")
        # (a copy: the rotary tables are memoised on the positions tensor, and the cursor outlives this forward)
        return Step(self.cursor.clone(), True)

    def end(self, step: Step) -> None:
        if not self.shapes_fixed:
            return
        if step.fixed:
            self.step_done()  # the host's count is the caller's (a replayed graph runs no Python)
        else:
            self.fix_shapes()  # a call of several tokens counted on the host: the cursor follows

    def fix_shapes(self) -> None:
        """From here on, one-token steps keep every shape: each layer writes at the device-side cursor and attends
        over its whole buffers up to it. The host count (`length`) is then kept by the caller (advance)."""
        if self.marks is None:
            self.marks = new_marks(2, self.layers[0].buffers_device())
            self.cursor, self.filled = self.marks[:1], self.marks[1:]
            for layer in self.layers:
                layer.cursor, layer.filled = self.cursor, self.filled
                layer.merge_counts = merge_counts(layer.buffers)
        self.cursor.fill_(self.length)  # in place: a captured graph holds them
        self.filled.fill_(self.length + 1)

    def step_done(self) -> None:
        """A fixed-shape step wrote its slot: the next writes one further and reads one more (on the device)."""
        self.marks.add_(1)

    def advance(self, t: int) -> None:
        """The host's count of positions, after a fixed-shape step that the device already counted."""
        for layer in self.layers:
            layer.length += t

    def reset(self) -> None:
        """Empty again (the buffers, the marks and their addresses kept)."""
        super().reset()
        if self.marks is not None:
            self.cursor.zero_()
            self.filled.fill_(1)
