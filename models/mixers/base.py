"""What every token mixer provides, and the registry that picks one by name."""
from __future__ import annotations

import torch
from torch import nn

from models.cache import LayerCache

MIXERS: dict[str, type["Mixer"]] = {}


def register(name: str):
    def add(cls):
        cls.name = name
        MIXERS[name] = cls
        return cls
    return add


class Mixer(nn.Module):
    """A token mixer. forward(x, cache, record, positions):

    x [B,T,d_m] is the layer-normed input. Without a cache it is the whole sequence; with one,
    x holds the T new positions, which are appended to the cache and mixed with the past.
    `record` is None unless diagnostics were asked for; then the mixer writes into it what the
    app shows ("attn": probabilities [B,H,T,S], or "mixing": an Extractor's [T,S] weights).
    `positions` ([T] or [B,T]) are the new tokens' positions, for rotary embeddings.
    """

    name = "?"
    out_names: tuple[str, ...] = ()  # output projection(s), counted apart from the mixer proper
    decodes_compacted = False  # can decode over context pruning's compacted cache (softmax attention can)
    replays_policies = False   # can run an eviction policy over a whole text (models.pruning.replay)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ConfigError when cfg cannot describe this mixer."""

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """Per-position state: name -> (*lead, width)."""
        raise NotImplementedError

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> LayerCache:
        return LayerCache(self.cache_spec(), batch, capacity, dtype, device,
                          track_alive=getattr(self, "pruning", None) is not None)

    def cache_numel_per_token(self) -> int:
        total = 0
        for shape in self.cache_spec().values():
            n = 1
            for size in shape:
                n *= size
            total += n
        return total
