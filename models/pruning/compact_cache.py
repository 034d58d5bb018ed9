"""The compacted decode cache of context pruning (papers.md section 3, "inference data structure").

Per layer: K, V and K_int in padded buffers [batch, *lead, capacity, width] plus a live-slot mask and
each slot's position. A new token goes into a free slot of its own row; a dropped token only clears its
live bit; when the fullest row's live count falls under 0.9 of the padded length in use, the rows are
compacted (a stable gather of the live slots) and the buffers shrink; when a row is full, capacity
doubles. Rows advance independently, so prompts of different lengths share one batch.

A decode step (one new token per row, every row real) takes a fast path with no host synchronisation: the
token goes into slot `end` of every row, each dropped slot notes the position of the query that dropped it in
`trig` (on the device), and whether to compact is asked only every ALIGN steps. The notes are collected into
`drops` (one host transfer) when asked for, and before slots are reused or compacted away.

Fixed shapes (`fixed=True`, then `fix_shapes()` after the prompt; models.graphs replays such steps from a CUDA
graph): a decode step writes at a device-side `cursor`, attends over the whole buffers with the kernel stopping
at the cursor, and asks the host nothing; compaction moves the live slots to the front of the same buffers (their
addresses, which a captured graph holds, never change) and is asked for by the caller between steps
(`make_room`, `maybe_compact`); the buffers only grow, by doubling, which a captured graph must follow
(`allocations` counts it).
"""
from __future__ import annotations

import torch

import kernels
from kernels.keep_rule import state_dtype
from models.backends import LayerState, State, Step, check_fits, compacted
from models.cache import merge_counts

COMPACT_BELOW = 0.9
ALIGN = 16  # capacities are multiples of this


def _round_up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the slot indices where mask is True first, each group in slot order (a stable sort)."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


class CompactCache(LayerState):
    check_every = ALIGN  # a decode step asks whether to compact every this many steps
    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int, dtype, device, policy=None,
                 rule_constants: dict | None = None, groups: int = 1, fixed: bool = False):
        # groups > 1 (a per-KV-group policy): `batch` rows are (batch row, group) pairs, row b * groups + g, each
        # holding its own slots of one group's K/V (models.backends.compacted.by_group)
        self.batch, self.device, self.groups = batch, device, groups
        self.capacity = _round_up(capacity)
        self.buffers = {n: torch.zeros(batch, *s[:-1], self.capacity, s[-1], dtype=state_dtype(n, dtype),
                                       device=device) for n, s in spec.items()}
        self.live = torch.zeros(batch, self.capacity, dtype=torch.bool, device=device)
        self.pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # -1: empty slot
        self.trig = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)  # dropper's position
        self.end = 0  # padded length in use: slots [0, end) are looked at
        self.compactions = 0
        self.drops: list[torch.Tensor] = []  # rows [batch, position, trigger position], collected by flush()
        self.steps_since_check = 0
        # a heuristic eviction policy (models.pruning.policies) and its per-slot state, kept with the slots
        self.policy = policy
        self.slot_state = policy.state(batch, self.capacity, device) if policy is not None else {}
        self.seen: torch.Tensor | None = None  # set to zeros [B] to count the earlier tokens each decode query saw
        # set by the model before each call: positions [B,T] and validity [B,T] of the new tokens
        self.q_pos: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        # the learned rule's decode constants (ContextPruning.decode_constants), held here, never on the model
        self.rule_constants = rule_constants
        # fixed shapes: compaction in place, capacity never shrinks; `cursor` (the device's `end`, the slot a step
        # writes) and `filled` (cursor + 1, what the step reads) set by fix_shapes
        self.fixed, self.cursor, self.filled, self.allocations = fixed, None, None, 0
        self.packed: dict | None = None  # fixed shapes: the block's packed projections (models.packing)
        self.merge_counts: torch.Tensor | None = None  # fixed shapes: the decode kernel's (models.cache.merge_counts)

    def attend(self, mixer, x, q, k, v, record, rope=None):
        """The attention backend over this cache (models.backends.compacted); rope: see `rotates`."""
        return compacted.attend(mixer, self, x, q, k, v, record, rope)

    def decode_step(self, q: torch.Tensor, record) -> bool:
        """Whether this call is a decode step of every row (one new token each, no padding, no diagnostics): the
        fast path of models.backends.compacted."""
        return q.shape[2] == 1 and self.valid is None and record is None

    def rotates(self, q: torch.Tensor, record) -> bool:
        """Whether this call takes q and k unrotated, with their angle tables and positions as `rope`: a fixed-shape
        step of every row, the learned rule or no rule deciding, rotates them as it writes (kernels.step_write)."""
        return self.cursor is not None and self.decode_step(q, record) and self.policy is None and self.groups == 1

    @property
    def length(self) -> int:  # positions seen by the longest row (the model's context check)
        return int(self.pos.max()) + 1 if self.end else 0

    def _resize(self, capacity: int) -> None:
        if self.fixed:  # plain tensors, even when grown in inference mode: a pooled cache is reset outside it
            with torch.inference_mode(False), torch.no_grad():
                return self._reallocate(capacity)
        self._reallocate(capacity)

    def _reallocate(self, capacity: int) -> None:
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

    def append(self, new: dict[str, torch.Tensor], q_pos: torch.Tensor) -> None:
        """A decode step with every row real: the new token ([B, *lead, 1, w] per name) goes into slot `end`
        of each row. Nothing here waits for the device."""
        if self.cursor is not None:
            raise RuntimeError("a fixed-shape compacted cache writes a step at its cursor (write_step)")
        if self.end == self.capacity:
            self._resize(self.capacity * 2)
        e = self.end
        for n, value in new.items():
            self.buffers[n][..., e:e + 1, :] = value
        self.live[:, e:e + 1] = True
        self.pos[:, e:e + 1] = q_pos
        self.end = e + 1

    def check_room(self) -> None:
        """A fixed-shape step writes at the cursor without a bound on the device: refuse here when no slot is free
        (host counts only: make_room() before the step keeps one free)."""
        if self.end >= self.capacity:
            raise RuntimeError(f"compacted cache full ({self.capacity} slots): make_room() before a fixed-shape step")

    def write_step(self, q: torch.Tensor, new: dict[str, torch.Tensor], q_pos: torch.Tensor, rope=None):
        """A fixed-shape step's writes at slot `cursor` of every row (the new entries, the slot's position and live
        bit; q and K rotated with rope), one kernel (kernels.step_write): returns q (rotated with rope). The
        cursors move on at the step's end (CompactDecodeCache.step_done), the host's `end` with advance()."""
        self.check_room()
        return kernels.step_write(q, new, self.buffers, self.cursor, rope, (self.live, self.pos, q_pos))

    def fix_shapes(self, marks: torch.Tensor | None = None) -> None:
        """From here on a one-token step of every row writes at the device-side cursor (= end) and reads the
        buffers up to it: nothing in the step depends on the host. marks: the two longs that hold this layer's
        cursor and filled count (CompactDecodeCache keeps every layer's in one tensor; default: new)."""
        if not self.fixed:
            raise ValueError("fix_shapes() needs a cache built with fixed=True (compaction in place)")
        if self.cursor is None:
            if marks is None:
                with torch.inference_mode(False):  # a plain tensor: reset() may run outside inference mode
                    marks = torch.zeros(2, dtype=torch.long, device=self.device)
            self.cursor, self.filled = marks[:1], marks[1:2]
            self.merge_counts = merge_counts(self.buffers)
        self.set_cursor(self.end)

    def set_cursor(self, n: int) -> None:
        """The slot the next fixed-shape step writes, and what it reads (on the device, in place)."""
        self.cursor.fill_(n)
        self.filled.fill_(n + 1)

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
        for t in self.slot_state.values():  # a reused slot starts afresh
            t[rows, cols] = 0
        self.end = max(self.end, int(cols.max()) + 1 if len(cols) else 0)

    def view(self) -> dict[str, torch.Tensor]:
        return {n: buf[..., :self.end, :] for n, buf in self.buffers.items()}

    def update_live(self, keep_last: torch.Tensor, trigger: torch.Tensor, every: int = 1) -> None:
        """keep_last [B, end]: what each row keeps after its newest token; trigger [B, end]: the position
        of the query that dropped each slot. Notes the drops on the device, then compacts if worth it, asking
        only every `every` calls (the question waits for the device). A fixed-shape cache compacts in place, so
        never here, while the calling step still reads the buffers: its caller asks between steps (make_room)."""
        was = self.live[:, :self.end]
        gone = was & ~keep_last
        self.trig[:, :self.end] = torch.where(gone, trigger, self.trig[:, :self.end])
        self.live[:, :self.end] = was & keep_last
        if not self.fixed:
            self._check_every(every)

    def _check_every(self, every: int) -> None:
        self.steps_since_check += 1
        if self.steps_since_check >= every:
            self.maybe_compact()

    def count_seen(self, attended: torch.Tensor) -> None:
        """attended [B, end]: the slots this decode query attended over, itself included (evaluation only).
        Adds the share of its earlier tokens it saw (1 for the first token, which has none)."""
        if self.seen is not None:
            q = self.q_pos[:, 0]
            self.seen += torch.where(q > 0, (attended.sum(1) - 1) / q.clamp_min(1), 1.0)

    def update_kept(self, keep: torch.Tensor, q_pos: torch.Tensor, every: int = 1) -> None:
        """update_live for a decode step whose keep [B, end] is already within the live slots and whose
        queries q_pos [B, 1] dropped whatever went (two fewer operations per layer and step). With fixed shapes
        keep covers every slot and the caller asks about compaction (a graph's step cannot)."""
        used = slice(None) if self.cursor is not None else slice(0, self.end)
        trig = self.trig[:, used]
        trig.copy_(torch.where(self.live[:, used] ^ keep, q_pos, trig))
        self.live[:, used] = keep
        self.kept_in_place(every)

    def kept_in_place(self, every: int = 1) -> None:
        """What is left of update_kept once keep is written over `live` and the drops noted in `trig` (by it, or by
        the decode kernel: kernels.compact_decode with prune["trig"]): the compaction question, asked every `every`
        steps (with fixed shapes the decoder asks it between steps)."""
        if self.cursor is None:
            self._check_every(every)

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
        buffers, live, pos, state = self._live_first(most)
        if self.fixed:  # in place: a captured graph holds these buffers; the slots after the live ones emptied
            for n, buf in self.buffers.items():
                buf[..., :most, :] = buffers[n]
            self.empty_slots()
            for n, t in self.slot_state.items():
                t[:, :most] = state[n]
            self.live[:, :most], self.pos[:, :most] = live, pos
            self.end = most
            if self.cursor is not None:
                self.set_cursor(most)
        else:  # new tensors, never in place: the step that triggered this still attends over views of the old
            self.buffers, self.live, self.pos, self.slot_state = buffers, live, pos, state
            self.trig = torch.full_like(pos, -1)
            self.end = self.capacity = most
            self._resize(_round_up(max(most, 1) + ALIGN))  # shrink, with room to grow
        self.compactions += 1

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
        order = _first(self.live[:, :self.end])[:, :most]                          # [B, most]

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

    def drop_table(self) -> torch.Tensor:
        """[n, 3] rows (batch row, position dropped, position of the query that dropped it)."""
        self.flush()
        return torch.cat(self.drops) if self.drops else torch.zeros(0, 3, dtype=torch.long)


class CompactDecodeCache(State):
    def __init__(self, layers: list[CompactCache]):
        self.layers = layers
        # fixed shapes: every layer's cursor and filled count and each row's next position [B,1], on the device,
        # views of one tensor (`marks`) so that a step moves them all with one launch (step_done)
        self.marks: torch.Tensor | None = None
        self.next_pos: torch.Tensor | None = None
        self.steps = 0  # fixed-shape steps since the last compaction check

    @property
    def allocations(self) -> int:
        """How often a layer's buffers were reallocated: a captured step is stale once this moves."""
        return sum(layer.allocations for layer in self.layers)

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """Rows advance on their own: positions [B,T] give each row's positions for its new tokens, and valid
        [B,T] marks the real ones (False: padding of a shorter row, neither stored nor allowed to drop anything;
        None: all real). A one-token call of every row after fix_shapes (no diagnostics) is a fixed-shape step:
        the positions come from the device, with no host check (the caller, models.decode.Decoder, keeps the
        count and checks the context)."""
        fixed = self.next_pos is not None and idx.shape[1] == 1 and valid is None and plain
        if fixed:
            positions = self.next_pos.clone()
        elif positions is None:
            raise ValueError("the compacted cache needs positions [B,T] for the new tokens")
        else:
            check_fits(int(positions.max() if valid is None else positions[valid].max()) + 1, context, "positions")
        for layer in self.layers:  # each layer's own record of where this call's tokens sit
            layer.q_pos, layer.valid = positions, valid
        return Step(positions.clamp(0, context - 1), fixed, valid)

    def end(self, step: Step) -> None:
        if step.fixed:
            self.step_done()
        elif self.next_pos is not None:
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
            with torch.inference_mode(False):  # a plain tensor: reset() may run outside inference mode
                self.marks = torch.zeros(n + next_pos.numel(), dtype=torch.long, device=next_pos.device)
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
        """Empty again for the next generation (fixed shapes: the buffers and their addresses are kept)."""
        for layer in self.layers:
            layer.empty_slots()
            layer.end, layer.compactions, layer.steps_since_check, layer.drops = 0, 0, 0, []
            layer.seen = None
            if layer.cursor is not None:
                layer.set_cursor(0)
        if self.next_pos is not None:
            self.next_pos.zero_()
        self.steps = 0

    @property
    def length(self) -> int:
        return self.layers[0].length

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:  # the compacted buffers are what is allocated
        return self.nbytes()

    def live_tokens(self) -> float:
        """Tokens held over all layers (per-group rows: the mean over a layer's groups)."""
        n = float(sum(float(layer.live.sum()) / layer.groups for layer in self.layers))
        return int(n) if n.is_integer() else n
