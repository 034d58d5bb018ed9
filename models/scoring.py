"""log p of the next tokens, defined once for everything that scores text (evaluation, replays, reports, pages), the
head applied a chunk of positions at a time. What scoring costs in memory is planned in models.memory."""
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


def head_log_softmax(model, hidden: torch.Tensor, chunk: int = CHUNK):
    """(start, log-softmax of the head's logits [..., chunk, V]) over the final hidden states [..., T, d_model],
    `chunk` positions at a time, in float32 at least: only one chunk's logits exist at once (SmolLM2 at 8,192
    tokens: 12 MB a row instead of 1.6 GB)."""
    w = model.output_weight().t()
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    for s in range(0, hidden.shape[-2], chunk):
        yield s, (hidden[..., s:s + chunk, :] @ w).to(dtype).log_softmax(-1)


def head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """target_logprobs of the logits the model's head gives the final hidden states (DecoderLM.forward with
    hidden_only): [..., T, d_model], [..., T] -> [..., T], the head in chunks (head_log_softmax)."""
    out = torch.empty(targets.shape, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    for s, part in head_log_softmax(model, hidden, chunk):
        out[..., s:s + chunk] = part.gather(-1, targets[..., s:s + chunk, None]).squeeze(-1)
    return out


def head_kl(model, before: torch.Tensor, after: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """KL(p_before || p_after) of the next-token distributions the head gives two runs' final hidden states
    ([..., T, d_model] each -> [..., T], in nats), the head in chunks (head_log_softmax)."""
    out = torch.empty(before.shape[:-1], dtype=torch.promote_types(before.dtype, torch.float32), device=before.device)
    for (s, a), (_, b) in zip(head_log_softmax(model, before, chunk), head_log_softmax(model, after, chunk)):
        out[..., s:s + chunk] = (a.exp() * (a - b)).sum(-1).clamp_min(0)   # (>= 0; rounding can dip below)
    return out
