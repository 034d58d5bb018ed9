"""One layer's slots in the compacted decode cache (docs/methods.md#the-compacted-cache): where each
token's entries sit, how the slots grow, and how they are compacted.

K, V and K_int sit in padded buffers [batch, *lead, capacity, width], with a live-slot mask, each slot's position
and its drop note (`trig`: the position of the query that dropped it, on the device). A new token goes into a free
slot of its own row (a dropped one is reused); when the fullest row's live count falls under COMPACT_BELOW of the
padded length in use, the rows are compacted (a stable gather of the live slots) and the buffers shrink; when a row
is full, capacity doubles. Rows advance independently, so prompts of different lengths share one batch. The drop
notes are collected into `drops` (one host transfer) when asked for, and before slots are reused or compacted away.
Who decides what drops is the layer state's (models.pruning.compact_cache.CompactCache).
"""
from __future__ import annotations

import torch

from kernels.keep_rule import state_dtype

COMPACT_BELOW = 0.9
ALIGN = 16  # capacities are multiples of this


def round_up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def first(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the slot indices where mask is True first, each group in slot order (a stable sort)."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


class Slots:
    """`batch` rows of slots, of which [0, end) are looked at; `slot_state`: a policy's per-slot tensors [batch,
    capacity, ...], moved with the slots (its owner fills it in)."""

    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int, dtype, device):
        self.batch, self.device = batch, device
        self.capacity = round_up(capacity)
        self.buffers = {n: torch.zeros(batch, *s[:-1], self.capacity, s[-1], dtype=state_dtype(n, dtype),
                                       device=device) for n, s in spec.items()}
        self.live = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
        self.pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # -1: empty slot
        self.trig = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # dropper's position
        self.end = 0  # padded length in use: slots [0, end) are looked at
        self.compactions = 0
        self.allocations = 0  # reallocations of the buffers (growth or shrinking)
        self.drops: list[torch.Tensor] = []  # rows [batch, position, trigger position], collected by flush()
        self.steps_since_check = 0
        self.slot_state: dict[str, torch.Tensor] = {}

    def _resize(self, capacity: int) -> None:
        """New buffers of `capacity` slots holding the first min(end, capacity) of the old."""
        self.allocations += 1
        keep = min(self.end, capacity)
        for n, buf in self.buffers.items():
            new = torch.zeros(*buf.shape[:-2], capacity, buf.shape[-1], dtype=buf.dtype, device=buf.device)
            new[..., :keep, :] = buf[..., :keep, :]
            self.buffers[n] = new
        live = torch.zeros(self.batch, capacity, dtype=torch.bool, device=self.device)
        pos = torch.full((self.batch, capacity), -1, dtype=torch.long, device=self.device)
        trig = torch.full((self.batch, capacity), -1, dtype=torch.long, device=self.device)
        live[:, :keep], pos[:, :keep], trig[:, :keep] = self.live[:, :keep], self.pos[:, :keep], self.trig[:, :keep]
        self.live, self.pos, self.trig, self.capacity = live, pos, trig, capacity
        for n, t in self.slot_state.items():
            grown = torch.zeros(self.batch, capacity, *t.shape[2:], dtype=t.dtype, device=t.device)
            grown[:, :keep] = t[:, :keep]
            self.slot_state[n] = grown

    def flush(self) -> None:
        """Move the drop notes (slot -> position of the query that dropped it) to `drops`, on the host."""
        noted = self.trig[:, :self.end] >= 0
        if noted.any():
            b, s = noted.nonzero(as_tuple=True)
            self.drops.append(torch.stack([b, self.pos[b, s], self.trig[b, s]], 1).cpu())
            self.trig[:, :self.end].masked_fill_(noted, -2)  # collected

    def drop_table(self) -> torch.Tensor:
        """[n, 3] rows (batch row, position dropped, position of the query that dropped it)."""
        self.flush()
        return torch.cat(self.drops) if self.drops else torch.zeros(0, 3, dtype=torch.long)

    def append(self, new: dict[str, torch.Tensor], q_pos: torch.Tensor) -> None:
        """A decode step with every row real: the new token ([B, *lead, 1, w] per name) goes into slot `end`
        of each row. Nothing here waits for the device."""
        if self.end == self.capacity:
            self._resize(self.capacity * 2)
        e = self.end
        for n, value in new.items():
            self.buffers[n][..., e:e + 1, :] = value
        self.live[:, e:e + 1] = True
        self.pos[:, e:e + 1] = q_pos
        self.end = e + 1

    def insert(self, new: dict[str, torch.Tensor], q_pos: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Write each valid new token ([B, *lead, T, w] per name) into a free slot of its own row (valid None:
        every row is real)."""
        t = q_pos.shape[1]
        if valid is None:
            if t == 1:
                return self.append(new, q_pos)
            valid = torch.ones_like(q_pos, dtype=torch.bool)
        self.flush()  # free slots may hold drop notes not collected yet
        free = ~self.live  # never used, or dropped: a dropped token's slot is reused
        need = int(valid.sum(1).max())
        while int(free.sum(1).min()) < need:  # a row without room: double
            self._resize(self.capacity * 2)
            free = ~self.live
        # the k-th valid new token of a row takes that row's k-th free slot (lowest first)
        rank = valid.long().cumsum(1) - 1                                         # [B, T]
        order = first(free)
        slot = torch.gather(order, 1, rank.clamp_min(0))                          # [B, T]
        b_idx = torch.arange(self.batch, device=self.device)[:, None].expand(-1, t)
        rows, cols = b_idx[valid], slot[valid]
        for n, value in new.items():
            buf = self.buffers[n]
            # move the slot axis next to batch so (row, slot) pairs index it directly
            moved = buf.movedim(-2, 1)                                            # [B, cap, *lead, w]
            moved[rows, cols] = value.movedim(-2, 1)[valid]
        self.live[rows, cols] = True
        self.pos[rows, cols] = q_pos[valid]
        for t in self.slot_state.values():  # a reused slot starts afresh
            t[rows, cols] = 0
        self.end = max(self.end, int(cols.max()) + 1 if len(cols) else 0)

    def view(self) -> dict[str, torch.Tensor]:
        return {n: buf[..., :self.end, :] for n, buf in self.buffers.items()}

    def _check_every(self, every: int) -> None:
        """One more step: every `every` of them, ask whether to compact (the question waits for the device)."""
        self.steps_since_check += 1
        if self.steps_since_check >= every:
            self.maybe_compact()

    def maybe_compact(self, most: int | None = None) -> None:
        """Compact when the fullest row's live count (`most`, read here when not given) is under COMPACT_BELOW
        of the padded length in use."""
        self.steps_since_check = 0
        if self.end == 0:
            return
        most = int(self.live[:, :self.end].sum(1).max()) if most is None else most
        if most >= COMPACT_BELOW * self.end:
            return
        self.flush()  # dropped slots are about to go
        self._compact(most)
        self.compactions += 1

    def _compact(self, most: int) -> None:
        """Each row's live slots first, into new tensors, never in place (the step that asked still attends over
        views of the old), which then shrink to `most` slots and room to grow."""
        buffers, live, pos, state = self._live_first(most)
        self.buffers, self.live, self.pos, self.slot_state = buffers, live, pos, state
        self.trig = torch.full_like(pos, -1)
        self.end = self.capacity = most
        self._resize(round_up(max(most, 1) + ALIGN))

    def empty_slots(self) -> None:
        """Every slot free, in place (the buffers' contents are left: nothing reads a slot that is not live)."""
        self.live.fill_(False)
        self.pos.fill_(-1)
        self.trig.fill_(-1)
        for t in self.slot_state.values():
            t.zero_()

    def _live_first(self, most: int):
        """Each row's first `most` live slots, in slot order (a stable gather), as new tensors: the buffers, the
        live mask, the positions (-1 where a row has fewer) and the policy's slot state."""
        order = first(self.live[:, :self.end])[:, :most]                          # [B, most]

        def gather(t, axis):  # t's slot axis `axis`, moved next to batch for the gather and back
            moved = t[..., :self.end, :].movedim(-2, 1) if axis == -2 else t[:, :self.end]
            idx = order.view(*order.shape, *([1] * (moved.dim() - 2))).expand(-1, -1, *moved.shape[2:])
            got = torch.gather(moved, 1, idx)
            return got.movedim(1, -2) if axis == -2 else got
        live = gather(self.live, 1)
        return ({n: gather(buf, -2) for n, buf in self.buffers.items()}, live,
                gather(self.pos, 1).masked_fill(~live, -1), {n: gather(t, 1) for n, t in self.slot_state.items()})

    def nbytes(self) -> int:
        """Bytes allocated for the state now (buffers at their capacity, live mask, positions)."""
        return (sum(b.numel() * b.element_size() for b in self.buffers.values())
                + self.live.numel() + (self.pos.numel() + self.trig.numel()) * self.pos.element_size()
                + sum(t.numel() * t.element_size() for t in self.slot_state.values()))
