"""The fixed sparse baselines that context pruning is compared with (papers.md section 3)."""
from __future__ import annotations

import torch


def pattern_mask(t: int, s: int, pattern: str, k: int, device=None) -> torch.Tensor | None:
    """The fixed sparse baselines (papers.md section 3) as a [T,S] bool mask for the last T of S positions
    (True = may attend; the causal limit is applied by the attention itself). local: the k most recent
    tokens (self included). strided (Child et al.): token i sees j when floor(i/k) = floor(j/k), and the
    summary tokens k-1, 2k-1, ..."""
    if pattern == "dense":
        return None
    i = torch.arange(s - t, s, device=device)[:, None]
    j = torch.arange(s, device=device)[None]
    if pattern == "local":
        return j > i - k
    if pattern == "strided":
        return (i // k == j // k) | (j % k == k - 1)
    raise ValueError(f"unknown pattern {pattern!r}")
