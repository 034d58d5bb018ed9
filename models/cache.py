"""Static (preallocated) decode state, gpt-fast style: no reallocation while generating. Its fixed-shape form, whose
one-token steps a CUDA graph can replay, is models.fixed_shape."""
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

    def attend(self, mixer, x, q, k, v, record):
        """The attention backend over this cache (models.backends.static); Extractors read the buffers alone."""
        return static.attend(mixer, self, x, q, k, v, record)

    def buffers_device(self) -> torch.device:
        return next(iter(self.buffers.values())).device

    def nbytes(self) -> int:
        """Bytes holding live positions (what the state costs now, not what was reserved)."""
        return sum(buf[..., :self.length, :].numel() * buf.element_size() for buf in self.buffers.values())

    def allocated_bytes(self) -> int:
        """Bytes reserved for the state (every buffer at its capacity, and the step mask of a pruned model)."""
        held = sum(buf.numel() * buf.element_size() for buf in self.buffers.values())
        return held + (self.alive.numel() if self.alive is not None else 0)


class DecodeCache(State):
    """The whole model's decode state: one LayerCache per block."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    def begin(self, idx, context, positions=None, valid=None, plain=True) -> Step:
        """The new tokens follow what the cache holds."""
        t, start = idx.shape[1], self.length
        check_fits(start + t, context, "positions")
        return Step(torch.arange(start, start + t, device=idx.device))

    def reset(self) -> None:
        """Empty again, to be reused by the next generation (the buffers keep their memory; what is left in
        them is never read, since every read stops at the length)."""
        for layer in self.layers:
            layer.length = 0
            if layer.alive is not None:
                layer.alive.fill_(True)

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
