"""The compacted cache with fixed shapes (models.fixed_shape says what that means and when it starts): built by
DecoderLM.new_compact_cache(fixed=True), for the learned rule or a dense model (not an eviction policy).

A decode step writes at a device-side `cursor` (the device's `end`), attends over the whole buffers with the kernel
stopping at `filled` (cursor + 1), and asks the host nothing. Compaction moves the live slots to the front of the
same buffers (their addresses, which a captured graph holds, never change) and is asked for by the caller between
steps (`make_room`), never inside one; the buffers only grow, by doubling, which a captured graph must follow
(`allocations` counts it).
"""
from __future__ import annotations

import torch

import kernels
from models.backends import Step
from models.fixed_shape import merge_counts, new_marks
from models.pruning.compact_cache import CompactCache, CompactDecodeCache, StepView
from models.pruning.slots import ALIGN


class FixedCompactCache(CompactCache):
    """One layer: compaction in place and capacity never shrinking from the start; `cursor` and `filled` (views of
    the state's marks) and the decode kernel's `merge_counts` once fix_shapes has run."""

    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int, dtype, device, policy=None,
                 rule_constants: dict | None = None, groups: int = 1):
        super().__init__(spec, batch, capacity, dtype, device, policy, rule_constants, groups)
        self.cursor: torch.Tensor | None = None
        self.filled: torch.Tensor | None = None
        self.merge_counts: torch.Tensor | None = None

    def rotates(self, q: torch.Tensor, record) -> bool:
        """Whether this call takes q and k unrotated, with their angle tables and positions as `rope`: a fixed-shape
        step of every row, the learned rule or no rule deciding, rotates them as it writes (kernels.step_write)."""
        return self.cursor is not None and self.decode_step(q, record) and self.policy is None and self.groups == 1

    def _resize(self, capacity: int) -> None:
        # plain tensors, even when grown in inference mode: a pooled cache is reset outside it
        with torch.inference_mode(False), torch.no_grad():
            super()._resize(capacity)

    def _compact(self, most: int) -> None:
        """In place: a captured graph holds these buffers; the slots after the live ones emptied."""
        buffers, live, pos, state = self._live_first(most)
        for n, buf in self.buffers.items():
            buf[..., :most, :] = buffers[n]
        self.empty_slots()
        for n, t in self.slot_state.items():
            t[:, :most] = state[n]
        self.live[:, :most], self.pos[:, :most] = live, pos
        self.end = most
        if self.cursor is not None:
            self.set_cursor(most)

    def update_live(self, keep_last: torch.Tensor, trigger: torch.Tensor) -> None:
        """note_drops alone: compaction is in place, so never while the calling step still reads the buffers (its
        caller asks between steps: make_room)."""
        self.note_drops(keep_last, trigger)

    def kept_in_place(self, every: int = 1) -> None:
        """With fixed shapes the decoder asks the compaction question between steps (a graph's step cannot)."""
        if self.cursor is None:
            super().kept_in_place(every)

    def append(self, new: dict[str, torch.Tensor], q_pos: torch.Tensor) -> None:
        if self.cursor is not None:
            raise RuntimeError("a fixed-shape compacted cache writes a step at its cursor (write_step)")
        super().append(new, q_pos)

    def write_token(self, q: torch.Tensor, new: dict[str, torch.Tensor], rope=None) -> tuple[torch.Tensor, StepView]:
        """Once the shapes are fixed: every write at the cursor in one kernel (rotating q and K there with rope), then
        the whole buffers, each row read up to the slot just written (the cursors move on at the step's end)."""
        if self.cursor is None:
            return super().write_token(q, new, rope)
        q = self.write_step(q, new, self.q_pos, rope)
        return q, StepView(self.buffers, self.live, self.pos, self.trig, self.filled.expand(q.shape[0]),
                           self.merge_counts)

    def check_room(self) -> None:
        """A fixed-shape step writes at the cursor without a bound on the device: refuse here when no slot is free
        (host counts only: make_room() before the step keeps one free)."""
        if self.end >= self.capacity:
            raise RuntimeError(f"compacted cache full ({self.capacity} slots): make_room() before a fixed-shape step")

    def write_step(self, q: torch.Tensor, new: dict[str, torch.Tensor], q_pos: torch.Tensor, rope=None):
        """A fixed-shape step's writes at slot `cursor` of every row (the new entries, the slot's position and live
        bit; q and K rotated with rope), one kernel (kernels.step_write): returns q (rotated with rope). The
        cursors move on at the step's end (FixedCompactDecodeCache.step_done), the host's `end` with advance()."""
        self.check_room()
        return kernels.step_write(q, new, self.buffers, self.cursor, rope, (self.live, self.pos, q_pos))

    def fix_shapes(self, marks: torch.Tensor | None = None) -> None:
        """From here on a one-token step of every row writes at the device-side cursor (= end) and reads the
        buffers up to it: nothing in the step depends on the host. marks: the two longs that hold this layer's
        cursor and filled count (FixedCompactDecodeCache keeps every layer's in one tensor; default: new)."""
        if self.cursor is None:
            marks = new_marks(2, self.device) if marks is None else marks
            self.cursor, self.filled = marks[:1], marks[1:2]
            self.merge_counts = merge_counts(self.buffers)
        self.set_cursor(self.end)

    def set_cursor(self, n: int) -> None:
        """The slot the next fixed-shape step writes, and what it reads (on the device, in place)."""
        self.cursor.fill_(n)
        self.filled.fill_(n + 1)

    def reset(self) -> None:
        super().reset()
        if self.cursor is not None:
            self.set_cursor(0)


class FixedCompactDecodeCache(CompactDecodeCache):
    """Every layer's cursor and filled count and each row's next position [B,1], on the device, are views of one
    tensor (`marks`), so that a step moves them all with one launch (step_done)."""

    def __init__(self, layers: list[FixedCompactCache]):
        super().__init__(layers)
        self.marks: torch.Tensor | None = None
        self.next_pos: torch.Tensor | None = None
        self.steps = 0  # fixed-shape steps since the last compaction check

    @property
    def shapes_fixed(self) -> bool:
        """Whether fix_shapes() has run: a one-token call of every row (no diagnostics) is now a fixed-shape step."""
        return self.next_pos is not None

    @property
    def allocations(self) -> int:
        """How often a layer's buffers were reallocated: a captured step is stale once this moves."""
        return sum(layer.allocations for layer in self.layers)

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """A fixed-shape step's positions come from the device, with no host check (the caller, models.decode
        .Decoder, keeps the count and checks the context); any other call is the plain cache's."""
        if self.shapes_fixed and idx.shape[1] == 1 and valid is None and plain:
            return self._place(self.next_pos.clone(), None, context, fixed=True)
        return super().begin(idx, context, positions, valid, plain)

    def end(self, step: Step) -> None:
        if step.fixed:
            self.step_done()
        elif self.shapes_fixed:
            if step.valid is not None:
                raise ValueError("a fixed-shape compacted cache takes rows of one length (no padding)")
            self.fix_shapes(self.layers[0].q_pos[:, -1:] + 1)  # several tokens counted on the host: follow

    def fix_shapes(self, next_pos: torch.Tensor) -> None:
        """After a call of several tokens (the prompt): one-token steps of every row keep their shapes from here
        (next_pos [B,1]: each row's next position; held on the device and moved on by the step itself)."""
        if any(layer.policy is not None for layer in self.layers):
            raise ValueError("fixed-shape decode serves the learned rule or a dense model, not an eviction policy")
        if self.marks is None:
            n = 2 * len(self.layers)
            self.marks = new_marks(n + next_pos.numel(), next_pos.device)
            self.next_pos = self.marks[n:].view(next_pos.shape)
        for i, layer in enumerate(self.layers):
            layer.fix_shapes(self.marks[2 * i:2 * i + 2])
        self.next_pos.copy_(next_pos)
        self.steps = 0

    def step_done(self) -> None:
        """A fixed-shape step wrote each layer's slot: every cursor, read length and next position moves on."""
        self.marks.add_(1)

    def advance(self, t: int = 1) -> None:
        """The host's count, after a fixed-shape step (t = 1) that the device already counted."""
        for layer in self.layers:
            layer.end += t
        self.steps += t

    def make_room(self) -> None:
        """Before a fixed-shape step (which asks the host nothing): every ALIGN steps, each layer compacts if
        worth it (one transfer asks all layers; a compaction then collects its layer's drop notes); a full layer
        compacts under COMPACT_BELOW live, else doubles (a reallocation: a captured graph must be captured
        again)."""
        full = [layer.end >= layer.capacity for layer in self.layers]
        if self.steps < ALIGN and not any(full):
            return
        self.steps = 0
        most = torch.stack([layer.live[:, :max(layer.end, 1)].sum(1).max() for layer in self.layers]).tolist()
        for layer, m in zip(self.layers, most):
            layer.maybe_compact(int(m))
            if layer.end >= layer.capacity:
                layer._resize(layer.capacity * 2)

    def reset(self) -> None:
        """Empty again for the next generation (the buffers and their addresses kept)."""
        super().reset()
        if self.next_pos is not None:
            self.next_pos.zero_()
        self.steps = 0
