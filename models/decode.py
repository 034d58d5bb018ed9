"""One decode engine: a model, its decode state, and the calls that feed it: a prefill of each row's prompt, then
one token per row per step. Generation (models.generate: stream, generate_batch), token-by-token scoring
(models.evaluate), the decode benchmarks and the tests drive it, so positions, padding, the policy's prompt
feeding and the drop bookkeeping are written once.

state "static": the preallocated cache (gpt-fast style), rows of one length; "compacted": context pruning's
cache (what the learned rule or an eviction `policy` drops is freed), rows of any lengths. The observer half
(`new_drops`, `live`, `allocated_bytes`) reads what the last call left without changing the next one.
"""
from __future__ import annotations

from typing import Sequence

import torch

import kernels
from models import graphs as graphs_module
from models import packing


def pick_state(model, cache: str) -> str:
    """"auto": the compacted cache for a context-pruned attention model (what it drops is freed), else static."""
    if cache not in ("auto", "static", "compacted"):
        raise ValueError(f"cache must be auto, static or compacted, got {cache!r}")
    compactable = model.blocks[0].mixer.decodes_compacted
    if cache == "compacted" and not compactable:
        raise ValueError(f"the compacted cache serves attention mixers, not {model.config.mixer}")
    if cache == "auto":
        return "compacted" if compactable and model.config.prune else "static"
    return cache


class Decoder:
    """Decode state for `batch` rows of `model` (put it in inference mode around the calls: models.transformer
    .evaluating). capacity: the static cache's length (default the context); the compacted cache's first
    capacity (it grows by doubling). ragged (compacted only): every call carries a padding mask, even when all
    rows take part (the path where rows may differ in length and sit steps out: generate_batch); otherwise a
    step of all rows takes the decode fast path. count_seen: the compacted cache counts, per decode query, the
    share of its earlier tokens it attended over (scoring's sparsity). fixed: the state's fixed-shape form
    (models.fixed_shape), whose shapes are fixed after the first call: one-token steps then keep every shape and
    ask the host nothing (the compacted cache compacting or growing between steps: before_fixed_step); graphs:
    those steps replayed from a CUDA graph (models.graphs)."""

    def __init__(self, model, batch: int = 1, state: str = "static", policy=None, capacity: int | None = None,
                 ragged: bool = False, count_seen: bool = False, fixed: bool = False, graphs: bool = False):
        if policy is not None:
            state = "compacted"  # a policy evicts from compacted slots
        if state not in ("static", "compacted"):
            raise ValueError(f"state must be static or compacted, got {state!r}")
        if ragged and state != "compacted":
            raise ValueError("rows of different lengths need the compacted cache")
        self.model, self.kind, self.policy, self.batch, self.ragged = model, state, policy, batch, ragged
        self.device = model.wte.weight.device
        self.fixed, self._captured = fixed or graphs, None
        why = self.fixed and (graphs_module.refusal(model, state, policy)
                              or ragged and "fixed-shape decode takes rows of one length (not ragged)")
        if why:
            raise ValueError(why)
        if graphs:
            if self.device.type != "cuda":
                raise ValueError("CUDA graphs need the model on a CUDA device")
            capacity = graphs_module.capacity_bucket(capacity or model.config.context, model.config.context)
            self._captured = graphs_module.checkout(model, batch, capacity, state)
            self.state = self._captured.state
        elif state == "compacted":
            self.state = model.new_compact_cache(batch=batch, capacity=capacity or 16, policy=policy, fixed=self.fixed)
            if count_seen:
                for layer in self.state.layers:
                    layer.seen = torch.zeros(layer.batch, device=self.device)  # a row per group, if per group
        else:
            self.state = model.new_cache(batch=batch, capacity=capacity, fixed=self.fixed)
        if self.fixed:  # one product for q, k, v and one for gate and up in each fixed-shape step
            packing.attach(model, self.state)
        self.lengths = [0] * batch            # tokens fed per row (on the host)
        self._next = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # the same, on the device (compacted)
        self.kernel_paths: dict[str, str] = {}  # op -> the path the kernel dispatch took, over all calls
        self._collected = [0] * len(self.state.layers)
        self._group_drops: dict[tuple[int, int, int], tuple[int, int]] = {}  # per group: (groups, last trigger)

    def _call(self, idx: torch.Tensor, valid: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """idx [B,T] at each row's next positions; valid [B,T] (compacted only: False is padding) -> logits.
        Positions are kept on the device: a step copies nothing from the host."""
        t = idx.shape[1]
        fixed = self.fixed and self.state.shapes_fixed
        with kernels.record_paths() as paths:  # per call: interleaved decoders must not share a recorder
            if fixed and t == 1:  # a fixed-shape step: positions (and slots) from the device; the host's count follows
                if self.kind == "compacted":
                    self.before_fixed_step()
                out = self.model(idx, cache=self.state, last_only=last_only)
                self.state.advance(1)
            elif self.kind == "compacted":
                pos = (self.state.next_pos if fixed else self._next) + torch.arange(t, device=self.device)
                out = self.model(idx, cache=self.state, positions=pos, valid=valid, last_only=last_only)
                if not fixed:
                    self._next = self._next + (t if valid is None else valid.long().sum(1, keepdim=True))
            else:  # the static cache keeps its own length
                out = self.model(idx, cache=self.state, last_only=last_only)
        if self.fixed and not self.state.shapes_fixed:  # from the first call on (a prefill, or an extend)
            if self.kind == "static":
                self.state.fix_shapes()
            else:
                self.state.fix_shapes(self._next)
        self.kernel_paths.update(paths)
        return out.logits

    def before_fixed_step(self) -> None:
        """What a fixed-shape compacted step cannot ask the host, asked before it: the context check, and
        whether a layer should compact or grow."""
        self.model.check_fits(max(self.lengths) + 1, "positions")
        self.state.make_room()

    def prefill(self, prompts: Sequence[Sequence[int]], last_only: bool = True) -> torch.Tensor:
        """Each row's prompt in one call (rows of different lengths: ragged, padded at the end). A policy that
        evicts as each token arrives reads the prompt one token per call, as decoding would. Returns each row's
        last-token logits [B,V] (last_only) or every position's [B,T,V] (padding positions undefined)."""
        if len(prompts) != self.batch or any(len(p) == 0 for p in prompts):
            raise ValueError(f"prefill takes {self.batch} prompt(s) of at least one token each")
        if any(self.lengths):
            raise ValueError("prefill starts a decoder; feed more tokens with step()")
        lens = [len(p) for p in prompts]
        width = max(lens)
        if min(lens) != width and not self.ragged:
            raise ValueError("prompts of different lengths need a ragged decoder (the compacted cache)")
        idx = torch.zeros(self.batch, width, dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            idx[r, :len(p)] = torch.tensor([int(t) for t in p], device=self.device)
        if self.policy is not None and not self.policy.at_prompt_end:
            if min(lens) != width:
                raise ValueError(f"{self.policy.method} reads a prompt one token per call: give rows of one length")
            steps = [self.step(idx[:, i]) for i in range(width)]
            return steps[-1] if last_only else torch.stack(steps, 1)
        valid = None
        if self.ragged:
            valid = torch.arange(width, device=self.device)[None] < torch.tensor(lens, device=self.device)[:, None]
        logits = self._call(idx, valid, last_only=last_only and valid is None)
        self.lengths = lens
        if last_only and valid is not None:
            return logits[torch.arange(self.batch, device=self.device), torch.tensor(lens, device=self.device) - 1]
        return logits[:, -1] if last_only else logits

    def extend(self, idx: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """T more tokens for every row (idx [B,T]) in one call -> logits [B,T,V] ([B,1,V] with last_only)."""
        logits = self._call(idx.to(self.device), None, last_only)
        self.lengths = [n + idx.shape[1] for n in self.lengths]
        return logits

    def step(self, tokens: torch.Tensor, active: Sequence[bool] | None = None) -> torch.Tensor:
        """One token per row (tokens [B]) -> logits [B,V]. active (a ragged decoder; on the host): the rows that
        take part (the others' tokens are padding, neither stored nor counted)."""
        rows = [True] * self.batch if active is None else [bool(a) for a in active]
        valid = None
        if self.ragged:
            valid = torch.tensor(rows, device=self.device)[:, None]
        elif not all(rows):
            raise ValueError("rows that sit a step out need a ragged decoder (the compacted cache)")
        tokens = tokens.to(self.device).view(self.batch, 1)
        if self._captured is not None and self.kind == "compacted" and self.state.shapes_fixed:
            self.before_fixed_step()  # (a replay runs no Python; an eager step asks again, which costs nothing)
        if self._captured is not None:
            if self.kind == "static" and self.lengths[0] + 1 > self.state.capacity:
                raise ValueError(f"cache full: {self.lengths[0]} + 1 positions exceed capacity {self.state.capacity}")
            logits, replayed = self._captured.step(self.model, tokens,
                                                   lambda tok: self._call(tok, None, last_only=True)[:, 0])
            if replayed:  # no Python ran inside, so count and note here
                self.state.advance(1)
                self.kernel_paths.update(self._captured.paths)
        else:
            logits = self._call(tokens, valid, last_only=True)[:, 0]
        self.lengths = [n + a for n, a in zip(self.lengths, rows)]
        return logits

    @property
    def graph_failed(self) -> str | None:
        """Why the CUDA graph could not be captured (this decoder then stepped eagerly); None otherwise."""
        return None if self._captured is None else self._captured.failed

    def close(self) -> None:
        """Give a captured graph and its cache back for the next generation of this model (graphs only)."""
        if self._captured is not None:
            graphs_module.give_back(self.model, self._captured)
            self._captured = self.state = None  # the cache is the pool's again: this decoder must not touch it

    # the observer: what the last call left (each reading waits for the device: call it after timing)

    def new_drops(self) -> list[tuple[int, int, int, int]]:
        """Drops since the last call of this method: (layer, row, position, position of the query that dropped
        it); compacted only (the static cache frees nothing). Under a per-KV-group policy a token counts as
        dropped once every group of the layer has dropped it (the query that took it from the last group).
        Reading them moves the notes to the host."""
        if self.kind != "compacted":
            return []
        out = []
        for li, layer in enumerate(self.state.layers):
            layer.flush()
            g = layer.groups
            for rec in layer.drops[self._collected[li]:]:
                for r, p, t in rec.tolist():
                    if g == 1:
                        out.append((li, r, p, t))
                        continue
                    key = (li, r // g, p)  # notes come in batches, not in step order: the latest trigger wins
                    count, last = self._group_drops.get(key, (0, -1))
                    self._group_drops[key] = (count + 1, max(last, t))
                    if count + 1 == g:
                        out.append((li, r // g, p, max(last, t)))
            self._collected[li] = len(layer.drops)
        return out

    def live(self, row: int = 0) -> tuple[float, ...]:
        """Per layer: tokens of `row` still visible to its next query (per-KV-group policy: the mean over the
        layer's groups, so that times the layer's bytes per token is what it holds)."""
        n = self.lengths[row]
        if self.kind == "compacted":  # one transfer for all layers
            per = [layer.live[row * layer.groups:(row + 1) * layer.groups].sum() / layer.groups
                   if layer.groups > 1 else layer.live[row].sum() for layer in self.state.layers]
            return tuple(torch.stack(per).tolist())
        if self.model.config.prune:  # the static cache with the step mask: nothing is freed
            return tuple(int(layer.alive[row, :n].sum()) for layer in self.state.layers)
        return (n,) * len(self.state.layers)

    def allocated_bytes(self) -> int:
        return self.state.allocated_bytes()

    def seen_share(self) -> float:
        """count_seen: the summed share of earlier tokens each decode query saw, over layers and rows."""
        return float(sum(layer.seen.sum() / layer.groups for layer in self.state.layers))
