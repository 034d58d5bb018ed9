"""The compacted decode cache of context pruning (papers.md section 3, "inference data structure").

Per layer: K, V and K_int in padded buffers [batch, *lead, capacity, width] plus a live-slot mask and
each slot's position. A new token goes into a free slot of its own row; a dropped token only clears its
live bit; when the fullest row's live count falls under 0.9 of the padded length in use, the rows are
compacted (a stable gather of the live slots) and the buffers shrink; when a row is full, capacity
doubles. Rows advance independently, so prompts of different lengths share one batch.
"""
from __future__ import annotations

import torch

COMPACT_BELOW = 0.9
ALIGN = 16  # capacities are multiples of this


def _round_up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the slot indices where mask is True first, each group in slot order (a stable sort)."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


class CompactCache:
    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int, dtype, device):
        self.batch, self.device = batch, device
        self.capacity = _round_up(capacity)
        self.buffers = {n: torch.zeros(batch, *s[:-1], self.capacity, s[-1], dtype=dtype, device=device) for n, s in spec.items()}
        self.live = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
        self.pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # -1: empty slot
        self.end = 0  # padded length in use: slots [0, end) are looked at
        self.compactions = 0
        self.drops: list[torch.Tensor] = []  # rows [batch, position, trigger position]
        # set by the model before each call: positions [B,T] and validity [B,T] of the new tokens
        self.q_pos: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    @property
    def length(self) -> int:  # positions seen by the longest row (the model's context check)
        return int(self.pos.max()) + 1 if self.end else 0

    def _resize(self, capacity: int) -> None:
        keep = min(self.end, capacity)
        for n, buf in self.buffers.items():
            new = torch.zeros(*buf.shape[:-2], capacity, buf.shape[-1], dtype=buf.dtype, device=buf.device)
            new[..., :keep, :] = buf[..., :keep, :]
            self.buffers[n] = new
        live = torch.zeros(self.batch, capacity, dtype=torch.bool, device=self.device)
        pos = torch.full((self.batch, capacity), -1, dtype=torch.long, device=self.device)
        live[:, :keep], pos[:, :keep] = self.live[:, :keep], self.pos[:, :keep]
        self.live, self.pos, self.capacity = live, pos, capacity

    def insert(self, new: dict[str, torch.Tensor], q_pos: torch.Tensor, valid: torch.Tensor) -> None:
        """Write each valid new token ([B, *lead, T, w] per name) into a free slot of its own row."""
        t = q_pos.shape[1]
        free = ~self.live  # never used, or dropped: a dropped token's slot is reused
        need = int(valid.sum(1).max())
        while int(free.sum(1).min()) < need:  # a row without room: double
            self._resize(self.capacity * 2)
            free = ~self.live
        # the k-th valid new token of a row takes that row's k-th free slot (lowest first)
        rank = valid.long().cumsum(1) - 1                                         # [B, T]
        order = _first(free)
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
        self.end = max(self.end, int(cols.max()) + 1 if len(cols) else 0)

    def view(self) -> dict[str, torch.Tensor]:
        return {n: buf[..., :self.end, :] for n, buf in self.buffers.items()}

    def update_live(self, keep_last: torch.Tensor, trigger: torch.Tensor) -> None:
        """keep_last [B, end]: what each row keeps after its newest token; trigger [B, end]: the position
        of the query that dropped each slot (or -1). Records the drops, then compacts if worth it."""
        was = self.live[:, :self.end]
        gone = was & ~keep_last
        if gone.any():
            b, s = gone.nonzero(as_tuple=True)
            self.drops.append(torch.stack([b, self.pos[b, s], trigger[b, s]], 1).cpu())
        self.live[:, :self.end] = was & keep_last
        self.maybe_compact()

    def maybe_compact(self) -> None:
        if self.end == 0:
            return
        most = int(self.live[:, :self.end].sum(1).max())
        if most >= COMPACT_BELOW * self.end:
            return
        # stable gather of each row's live slots to the front, into new tensors, never in place: the step
        # that triggered this still attends over views of the old buffers
        order = _first(self.live[:, :self.end])[:, :most]                          # [B, most]
        for n, buf in self.buffers.items():
            moved = buf[..., :self.end, :].movedim(-2, 1)                          # [B, end, *lead, w]
            idx = order.view(*order.shape, *([1] * (moved.dim() - 2))).expand(-1, -1, *moved.shape[2:])
            self.buffers[n] = torch.gather(moved, 1, idx).movedim(1, -2)
        self.live = torch.gather(self.live[:, :self.end], 1, order)
        self.pos = torch.gather(self.pos[:, :self.end], 1, order).masked_fill(~self.live, -1)
        self.end = self.capacity = most
        self._resize(_round_up(max(most, 1) + ALIGN))  # shrink, with room to grow
        self.compactions += 1

    def nbytes(self) -> int:
        """Bytes allocated for the state now (buffers at their capacity, live mask, positions)."""
        return (sum(b.numel() * b.element_size() for b in self.buffers.values())
                + self.live.numel() + self.pos.numel() * self.pos.element_size())

    def drop_table(self) -> torch.Tensor:
        """[n, 3] rows (batch row, position dropped, position of the query that dropped it)."""
        return torch.cat(self.drops) if self.drops else torch.zeros(0, 3, dtype=torch.long)


class CompactDecodeCache:
    def __init__(self, layers: list[CompactCache]):
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def live_tokens(self) -> int:
        return sum(int(layer.live.sum()) for layer in self.layers)
