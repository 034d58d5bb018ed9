"""log p of the next tokens, defined once for everything that scores text (evaluation, replays, reports, pages), and
what scoring costs in memory, so a command refuses before it starts rather than running out part way."""
from __future__ import annotations

import torch

from kernels import settings

# positions per log-softmax: a float32 copy of [T, V] logits never exists whole (8k x 50k: 1.6 GB), and the
# temporaries stay small (64 x 49,152 floats: 12 MB; 512 at a time took 0.1-0.2 s longer per 512-token text on
# SmolLM2 on a 2-core CPU; the values are the same whatever the chunk)
CHUNK = 64
# the interpreter, torch, numpy and pandas beside the weights (a bare `import torch, pandas, plotly` holds ~350 MB)
RUNTIME_BYTES = 512 * 2 ** 20
MARGIN = 1.25      # what forward_bytes does not count: allocator slack, rotary tables, small temporaries


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


def memory_budget() -> int:
    """Bytes a command or page plans for in all (weights, runtime and working memory): MIXSCOPE_MEMORY_MB, default
    4,096 (read at each call, so a test or an operator can change it)."""
    return int(settings.get("MIXSCOPE_MEMORY_MB") * 2 ** 20)


def weights_bytes(model) -> int:
    """The loaded model's parameters and buffers, in their own dtypes."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def forward_bytes(cfg, rows: int, t: int, chunk: int = CHUNK) -> int:
    """Estimated working memory of one inference forward over rows x t tokens in float32 with the head applied
    `chunk` positions at a time (head_logprobs) and no attention maps recorded. Layers run one after another, so one
    layer's activations are live at once: per token the residual stream and its norm, q/k/v with their rotated
    copies, the attention output, the feed-forward's d_ff-wide tensors; per row the [t, t] masks a mask-using model
    builds (context pruning's log I, keep, scores and additive mask; a fixed pattern's bias), and one [t, t] boolean
    causal mask (SDPA's CPU kernel attends in blocks: no [heads, t, t] scores); an Extractor's FFT buffers; the
    head's [rows, chunk, vocab] logits with their log-softmax. Times MARGIN."""
    d, heads = cfg.d_model, cfg.n_heads * cfg.d_head
    per_token = 4 * d + 4 * cfg.d_ff + 5 * heads
    if cfg.mixer in ("me", "we", "he", "she"):
        per_token += 8 * d                                     # complex spectra of 2t positions per channel
    square = t * t                                             # the causal mask, one byte a cell
    if cfg.prune:
        square += rows * 4 * 4 * t * t
    elif cfg.pattern != "dense":
        square += 2 * 4 * t * t
    head = 3 * rows * min(chunk, t) * cfg.vocab_size
    return int(MARGIN * (4 * rows * t * per_token + square + 4 * head))
