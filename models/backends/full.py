"""A whole sequence at once (training, scoring, the app's diagnostics): causal softmax attention, plus context
pruning's log I (the alpha-sigmoid while training, the step at inference) or a fixed local / strided pattern."""
from __future__ import annotations

import torch

from models.backends import additive
from models.pruning import pattern_mask


def pattern_bias(mixer, b: int, t: int, s: int, dtype, device):
    """The local / strided baselines as (additive bias [1,1,T,S], keep [B,T,S]); (None, None) when dense."""
    fixed = pattern_mask(t, s, mixer.pattern, mixer.pattern_k, device)
    if fixed is None:
        return None, None
    return additive(fixed, dtype)[None, None], fixed.to(dtype)[None].expand(b, -1, -1)


class FullSequence:
    """The backend of a forward without a cache."""

    def attend(self, mixer, x, q, k, v, record):
        if mixer.pruning is not None:
            if mixer.training:  # with the sparsity loss's term, read by DecoderLM.forward after the blocks
                # [B,T,T] each (log I in attention's dtype), and 0-dim
                log_i, keep, mixer.prune_mass = mixer.pruning.log_keep(x, mass=True, log_dtype=q.dtype)
            else:
                log_i, keep = mixer.pruning.log_keep(x)
            if record is not None:  # r-wide each, in the rule's precision: what the Pruning page's score view reads
                record.q_int, record.k_int = mixer.pruning.q_int(x), mixer.pruning.keys(x)
            # log I is -inf above the diagonal, so it is the causal mask too: where a gradient is needed (SDPA with
            # the bias, kernels.attention) nothing need build a causal mask and fill the bias with it (about six
            # kernels a layer, forward and backward); without one the Triton prefill takes causal=True, with which
            # it skips the blocks above the diagonal.
            sdpa = torch.is_grad_enabled() and any(t.requires_grad for t in (log_i, q, k, v))
            return mixer.attend(q, k, v, log_i[:, None], record, keep, causal=not sdpa)
        bias, keep = pattern_bias(mixer, q.shape[0], q.shape[2], k.shape[2], q.dtype, q.device)
        return mixer.attend(q, k, v, bias, record, keep)


FULL = FullSequence()
