"""The compacted decode cache of context pruning (docs/methods.md#the-compacted-cache): one layer's
state over its slots (models.pruning.slots), and the whole model's.

The layer state is what attention asks (models.backends.compacted): where this call's tokens sit (`q_pos`,
`valid`, set by CompactDecodeCache.begin), what the learned rule reads (`rule_constants`) or which eviction policy
decides, and the bookkeeping of what the step dropped: the live mask, a drop note per dropped slot (the position of
the query that dropped it, on the device) and, for scoring, the share of its earlier tokens each query saw.

A decode step (one new token per row, every row real) takes a fast path with no host synchronisation: the token
goes into slot `end` of every row (write_token), each dropped slot is noted in `trig`, and whether to compact is
asked only every ALIGN steps. The fixed-shape form of this cache, whose steps a CUDA graph can replay, is
models.pruning.fixed_compact.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from models.backends import LayerState, State, Step, check_fits, compacted
from models.pruning import eviction
from models.pruning.slots import ALIGN, Slots


class StepView(NamedTuple):
    """What a decode step reads once its token is written: the buffers (`past`), live mask, positions and drop
    notes of the slots it looks at; with fixed shapes each row's read length [B] and the decode kernel's
    workspace (None: the slots given are all read)."""
    past: dict
    live: torch.Tensor
    pos: torch.Tensor
    trig: torch.Tensor
    lengths: torch.Tensor | None = None
    merge_counts: torch.Tensor | None = None


class CompactCache(Slots, LayerState):
    """One layer's compacted cache. groups > 1 (a per-KV-group policy): `batch` rows are (batch row, group) pairs,
    row b * groups + g, each holding its own slots of one group's K/V (models.backends.compacted.by_group)."""

    check_every = ALIGN  # a decode step asks whether to compact every this many steps

    def __init__(self, spec: dict[str, tuple[int, ...]], batch: int, capacity: int, dtype, device, policy=None,
                 rule_constants: dict | None = None, groups: int = 1):
        super().__init__(spec, batch, capacity, dtype, device)
        self.groups = groups
        # a heuristic eviction policy (models.pruning.policies) and its per-slot state, kept with the slots
        self.policy = policy
        self.slot_state = policy.state(batch, self.capacity, device) if policy is not None else {}
        self.seen: torch.Tensor | None = None  # set to zeros [B] to count the earlier tokens each decode query saw
        # set by the model before each call: positions [B,T] and validity [B,T] of the new tokens
        self.q_pos: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        # the learned rule's decode constants (ContextPruning.decode_constants), held here, never on the model
        self.rule_constants = rule_constants

    def attend(self, mixer, x, q, k, v, record, rope=None):
        """The attention backend over this cache (models.backends.compacted); rope: see `rotates`."""
        return compacted.attend(mixer, self, x, q, k, v, record, rope)

    def decode_step(self, q: torch.Tensor, record) -> bool:
        """Whether this call is a decode step of every row (one new token each, no padding, no diagnostics): the
        fast path of models.backends.compacted."""
        return q.shape[2] == 1 and self.valid is None and record is None

    @property
    def length(self) -> int:  # positions seen by the longest row (the model's context check)
        return int(self.pos.max()) + 1 if self.end else 0

    def write_token(self, q: torch.Tensor, new: dict[str, torch.Tensor], rope=None) -> tuple[torch.Tensor, StepView]:
        """A decode step's write: the new token ([B, *lead, 1, w] per name) into slot `end` of each row. Returns q
        and what the step reads (the slots up to `end`). rope: only a fixed-shape step takes one."""
        self.append(new, self.q_pos)
        e = self.end
        return q, StepView(self.view(), self.live[:, :e], self.pos[:, :e], self.trig[:, :e])

    def note_drops(self, keep_last: torch.Tensor, trigger: torch.Tensor) -> None:
        """keep_last [B, end]: what each row keeps after its newest token; trigger [B, end]: the position of the
        query that dropped each slot. Notes the drops on the device."""
        was = self.live[:, :self.end]
        self.trig[:, :self.end] = eviction.drops(self.trig[:, :self.end], was, keep_last, trigger)
        self.live[:, :self.end] = was & keep_last

    def update_live(self, keep_last: torch.Tensor, trigger: torch.Tensor) -> None:
        """note_drops, then compacts if worth it."""
        self.note_drops(keep_last, trigger)
        self._check_every(1)

    def count_seen(self, attended: torch.Tensor) -> None:
        """attended [B, end]: the slots this decode query attended over, itself included (evaluation only).
        Adds the share of its earlier tokens it saw (1 for the first token, which has none)."""
        if self.seen is not None:
            q = self.q_pos[:, 0]
            self.seen += torch.where(q > 0, (attended.sum(1) - 1) / q.clamp_min(1), 1.0)

    def update_kept(self, keep: torch.Tensor, q_pos: torch.Tensor, every: int = 1) -> None:
        """update_live for a decode step whose keep [B, end] is already within the live slots and whose
        queries q_pos [B, 1] dropped whatever went: eviction.drops' rule, where with keep within live the slots that
        went are live ^ keep (two fewer operations per layer and step)."""
        used = slice(0, self.end)
        trig = self.trig[:, used]
        trig.copy_(torch.where(self.live[:, used] ^ keep, q_pos, trig))
        self.live[:, used] = keep
        self.kept_in_place(every)

    def kept_in_place(self, every: int = 1) -> None:
        """What is left of update_kept once keep is written over `live` and the drops noted in `trig` (by it, or by
        the decode kernel: kernels.compact_decode with prune["trig"]): the compaction question, asked every `every`
        steps."""
        self._check_every(every)

    def reset(self) -> None:
        """Empty again for the next generation (the buffers kept)."""
        self.empty_slots()
        self.end, self.compactions, self.steps_since_check, self.drops = 0, 0, 0, []
        self.seen = None


class CompactDecodeCache(State):
    """The whole model's compacted cache: one CompactCache per block."""

    def __init__(self, layers: list[CompactCache]):
        self.layers = layers

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """Rows advance on their own: positions [B,T] give each row's positions for its new tokens, and valid
        [B,T] marks the real ones (False: padding of a shorter row, neither stored nor allowed to drop anything;
        None: all real)."""
        if positions is None:
            raise ValueError("the compacted cache needs positions [B,T] for the new tokens")
        check_fits(int(positions.max() if valid is None else positions[valid].max()) + 1, context, "positions")
        return self._place(positions, valid, context)

    def _place(self, positions: torch.Tensor, valid: torch.Tensor | None, context: int, fixed: bool = False) -> Step:
        for layer in self.layers:  # each layer's own record of where this call's tokens sit
            layer.q_pos, layer.valid = positions, valid
        return Step(positions.clamp(0, context - 1), fixed, valid)

    def reset(self) -> None:
        """Empty again for the next generation."""
        for layer in self.layers:
            layer.reset()

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
