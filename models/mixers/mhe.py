"""Head embeddings, MHE-ADD and MHE-MUL (Xue & Aletras, arXiv 2310.07911; docs/methods.md#head-embeddings).

One shared W^Q, W^K, W^V in R^{d_m x d_h}; head i attends with psi(Q, e_i^Q), psi(K, e_i^K), psi(V, e_i^V).
Both are computed exactly from the single shared K and V (the identities in docs/methods.md), so their decode
cache is one head wide, and the kernels apply each head's query and output maps.
"""
from __future__ import annotations

import torch
from torch import nn

from models.mixers.attention import Attention, projection
from models.mixers.base import register


class MHE(Attention):
    """Head embeddings: one shared W^Q, W^K, W^V; head i sees psi(Q, e_i^Q), psi(K, e_i^K), psi(V, e_i^V).

    Computed exactly from the single shared K and V (docs/methods.md#head-embeddings), so the cache is one head.
    """

    n_groups = property(lambda self: 1)

    def __init__(self, cfg):
        super().__init__(cfg, cfg.n_heads)
        d_m, n, d_h = cfg.d_model, cfg.n_heads, cfg.d_head
        self.W_Q = projection(d_m, 1, d_h, cfg.init_std)
        self.W_K = projection(d_m, 1, d_h, cfg.init_std)
        self.W_V = projection(d_m, 1, d_h, cfg.init_std)
        # small random, not zero: identical heads would stay identical
        self.e_Q = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)
        self.e_K = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)
        self.e_V = nn.Parameter(torch.randn(n, d_h) * cfg.head_embed_std)

    def projections(self):  # one shared Q head: the kernel applies each head's map (head_maps)
        return (self.W_Q, None), (self.W_K, None), (self.W_V, None)


@register("mhe-mul")
class MHEMul(MHE):
    """psi(A, e) = A * (e + 1). Q~_i K~_i^T = Q diag(g_i) K^T, g_i = (1+e_i^Q)(1+e_i^K);
    A_i V~_i = (A_i V) diag(1+e_i^V)."""

    def query_scale(self) -> torch.Tensor:
        """g_i [n, d_h]: the effective per-head diagonal query scaling."""
        return (1 + self.e_Q) * (1 + self.e_K)

    def head_maps(self):
        return {"q_mul": self.query_scale(), "o_mul": 1 + self.e_V}


@register("mhe-add")
class MHEAdd(MHE):
    """psi(A, e) = A + e. (Q+e_i^Q)(K+e_i^K)^T differs from (Q+e_i^Q)K^T by a constant per softmax row,
    so e^K has no effect (zero gradient; kept because the paper counts it); A_i (V+e_i^V) = A_i V + e_i^V."""

    def head_maps(self):
        return {"q_add": self.e_Q, "o_add": self.e_V}
