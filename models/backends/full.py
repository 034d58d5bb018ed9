"""A whole sequence at once (training, scoring, the app's diagnostics): causal softmax attention, plus context
pruning's log I (the alpha-sigmoid while training, the step at inference) or a fixed local / strided pattern."""
from __future__ import annotations

import torch

from models.backends import LayerState, State, additive
from models.pruning.patterns import pattern_mask


def pattern_bias(mixer, b: int, t: int, s: int, dtype, device):
    """The local / strided baselines as (additive bias [1,1,T,S], keep [B,T,S]); (None, None) when dense."""
    fixed = pattern_mask(t, s, mixer.pattern, mixer.pattern_k, device)
    if fixed is None:
        return None, None
    return additive(fixed, dtype)[None, None], fixed.to(dtype)[None].expand(b, -1, -1)


class WholeSequence(State, LayerState):
    """No cache: every layer attends over the whole sequence at once. A model in training with context pruning
    hands each layer's term of the sparsity loss here, for this forward only (`prune_mass`); FULL, the state of a
    mixer called on its own, keeps none."""

    def __init__(self, n_layers: int = 0, collect: bool = False):
        self.layers = [self] * n_layers
        self.masses: list[torch.Tensor] | None = [] if collect else None

    length = 0  # an Extractor's window: nothing before this call

    def append(self, **new: torch.Tensor) -> dict[str, torch.Tensor]:
        """An Extractor's window over the whole sequence is the sequence itself (models.cache.LayerCache.append)."""
        return new

    def attend(self, mixer, x, q, k, v, record):
        if mixer.pruning is not None:
            if mixer.training:  # [B,T,T] each (log I in attention's dtype), and 0-dim
                log_i, keep, mass = mixer.pruning.log_keep(x, mass=True, log_dtype=q.dtype)
                if self.masses is not None:
                    self.masses.append(mass)
            else:
                log_i, keep = mixer.pruning.log_keep(x)
            if record is not None:  # r-wide each, in the rule's precision: what the Pruning page's score view reads
                record.q_int, record.k_int = mixer.pruning.q_int(x), mixer.pruning.keys(x)
            # log I is -inf above the diagonal, so it is the causal mask too: no path builds a mask over it (about
            # six kernels a layer, forward and backward); the Triton prefill skips the blocks above the diagonal,
            # and so does a training step on CUDA (PyTorch's memory-efficient kernel with its own causal mask,
            # kernels.efficient, where SDPA given the bias alone computed every block)
            return mixer.attend(q, k, v, log_i[:, None], record, keep, bias_is_causal=True)
        bias, keep = pattern_bias(mixer, q.shape[0], q.shape[2], k.shape[2], q.dtype, q.device)
        return mixer.attend(q, k, v, bias, record, keep)

    def prune_mass(self) -> torch.Tensor | None:
        """The layers' terms summed, when every layer made one (a model whose rule is on in every layer)."""
        if not self.masses or len(self.masses) != len(self.layers):
            return None
        return sum(self.masses)


FULL = WholeSequence()
