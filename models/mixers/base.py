"""What every token mixer provides, and the registry that picks one by name."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.cache import LayerCache
from kernels.keep_rule import state_dtype

MIXERS: dict[str, type["Mixer"]] = {}


def register(name: str):
    def add(cls):
        cls.name = name
        MIXERS[name] = cls
        return cls
    return add


@dataclass
class LayerRecord:
    """What one layer shows the app during a diagnostic forward (DecoderLM.forward(diagnostics=True)); a field the
    layer's mixer has no such thing for stays None."""
    attention_maps: bool = True            # False: keep masks only (30 layers x 1k tokens of maps would be 1 GB)
    attn: torch.Tensor | None = None       # softmax attention probabilities [B,H,T,S]
    keep: torch.Tensor | None = None       # context pruning's visibility [B,T,S] (1: the query sees the key)
    mixing: torch.Tensor | None = None     # an Extractor's lag weights as a [T,S] mixing matrix
    slot_pos: torch.Tensor | None = None   # over a compacted cache: the position each key slot holds [B,S]
    q_int: torch.Tensor | None = None      # context pruning, whole sequence: x W^Qint [B,T,r], fp32 at least (the
    k_int: torch.Tensor | None = None      # scores x_{n,j} follow from these and the rule: ContextPruning.scores_of)


class Mixer(nn.Module):
    """A token mixer. forward(x, cache, record, positions):

    x [B,T,d_m] is the layer-normed input. Without a cache it is the whole sequence; with one,
    x holds the T new positions, which are appended to the cache and mixed with the past.
    `record` is None unless diagnostics were asked for; then it is the layer's LayerRecord and the mixer
    fills in what the app shows (attention probabilities and keep masks, or an Extractor's mixing matrix).
    `positions` ([T] or [B,T]) are the new tokens' positions, for rotary embeddings.
    """

    name = "?"
    out_names: tuple[str, ...] = ()  # output projection(s), counted apart from the mixer proper
    decodes_compacted = False  # can decode over context pruning's compacted cache (softmax attention can)
    replays_policies = False   # can run an eviction policy over a whole text (models.pruning.replay)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise ConfigError when cfg cannot describe this mixer."""

    def packable_projections(self) -> tuple | None:
        """The (weight [d_m,n,d_h], bias) pairs a fixed-shape decode step may run as one product (models.packing),
        when the mixer's projection is just their products; None otherwise."""
        return None

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """Per-position state: name -> (*lead, width)."""
        raise NotImplementedError

    def new_cache(self, batch: int, capacity: int, dtype: torch.dtype, device) -> LayerCache:
        return LayerCache(self.cache_spec(), batch, capacity, dtype, device,
                          track_alive=getattr(self, "pruning", None) is not None)

    def cache_bytes_per_token(self, dtype: torch.dtype) -> tuple[int, int]:
        """Decode-state bytes one position costs this layer in a model of `dtype`: every state it caches, the
        learned rule's K_int in the rule's precision (float32 in a bf16 model); and the same without K_int (what
        its dense twin caches). The one count the Generate and Pruning pages and the zoo table use."""
        own = dense = 0
        for name, shape in self.cache_spec().items():
            n = 1
            for size in shape:
                n *= size
            size = n * state_dtype(name, dtype).itemsize
            own += size
            dense += 0 if name == "k_int" else size
        return own, dense
