"""The fixed sparse baselines that context pruning is compared with (docs/methods.md#fixed-sparse-baselines)."""
from __future__ import annotations

import torch

PATTERNS = ("dense", "local", "strided")


def pattern_allows(i: torch.Tensor, j: torch.Tensor, pattern: str, k: int) -> torch.Tensor:
    """Whether the query at position i may see the key at position j (shapes broadcast; the causal limit j <= i
    is applied by the attention itself). local: the k most recent tokens (self included). strided (Child et
    al.): j with floor(i/k) = floor(j/k), and the summary tokens k-1, 2k-1, ..."""
    if pattern == "dense":
        return torch.ones(torch.broadcast_shapes(i.shape, j.shape), dtype=torch.bool, device=i.device)
    if pattern == "local":
        return j > i - k
    if pattern == "strided":
        return (i // k == j // k) | (j % k == k - 1)
    raise ValueError(f"unknown pattern {pattern!r}")


def pattern_mask(t: int, s: int, pattern: str, k: int, device=None) -> torch.Tensor | None:
    """pattern_allows as a [T,S] bool mask for the last T of S positions; None when dense."""
    if pattern == "dense":
        return None
    i = torch.arange(s - t, s, device=device)[:, None]
    j = torch.arange(s, device=device)[None]
    return pattern_allows(i, j, pattern, k)
