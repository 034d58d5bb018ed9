"""log p of the next tokens, defined once for everything that scores text (evaluation, replays, reports, pages)."""
from __future__ import annotations

import torch

# positions per log-softmax: a float32 copy of [T, V] logits never exists whole (8k x 50k: 1.6 GB), and the
# temporaries stay small (64 x 49,152 floats: 12 MB; 512 at a time took 0.1-0.2 s longer per 512-token text on
# SmolLM2 on a 2-core CPU; the values are the same whatever the chunk)
CHUNK = 64


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """log p(targets[..., i]) under logits[..., i, :]: [..., T, V], [..., T] -> [..., T], in float32 at least
    (bf16 logits are promoted, float64 ones kept), `chunk` positions at a time."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(targets.shape, dtype=dtype, device=logits.device)
    for s in range(0, logits.shape[-2], chunk):
        part = logits[..., s:s + chunk, :].to(dtype).log_softmax(-1)
        out[..., s:s + chunk] = part.gather(-1, targets[..., s:s + chunk, None]).squeeze(-1)
    return out
