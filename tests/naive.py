"""Naive implementations written straight from the papers' equations (docs/methods.md), with Python loops
over batch, heads and positions. Deliberately slow and literal: the mixers are tested against these."""
from __future__ import annotations

import math

import torch


def attend_one_head(Q, K, V):
    """H = softmax(Q K^T / sqrt(d_h) + causal mask) V, one position at a time. Q, K, V [T, d_h]."""
    t, d_h = Q.shape
    out = torch.zeros_like(V)
    for i in range(t):
        scores = torch.stack([Q[i] @ K[j] / math.sqrt(d_h) for j in range(i + 1)])
        a = torch.exp(scores - scores.max())
        a = a / a.sum()
        out[i] = sum(a[j] * V[j] for j in range(i + 1))
    return out


def attention(mixer, x):
    """x [B,T,d_m] -> [B,T,d_m] for any attention variant, from its parameters."""
    name = mixer.name
    n, d_h = mixer.n_heads, mixer.d_head
    outs = []
    for xb in x:
        heads = []
        for i in range(n):
            if name in ("mha", "sha"):
                Q, K, V = xb @ mixer.W_Q[:, i], xb @ mixer.W_K[:, i], xb @ mixer.W_V[:, i]
            elif name == "gqa":  # query head i reads key/value head i // (n / n_kv)
                g = i // (n // mixer.kv_heads)
                Q, K, V = xb @ mixer.W_Q[:, i], xb @ mixer.W_K[:, g], xb @ mixer.W_V[:, g]
            elif name == "mqa":
                Q, K, V = xb @ mixer.W_Q[:, i], xb @ mixer.W_K[:, 0], xb @ mixer.W_V[:, 0]
            elif name == "skv":
                Q, K = xb @ mixer.W_Q[:, i], xb @ mixer.W_KV[:, i]
                V = K
            elif name == "el-att":
                Q, K = xb @ mixer.W_Q[:, i], xb[:, i * d_h:(i + 1) * d_h]
                V = K
            elif name in ("mhe-add", "mhe-mul"):
                Q, K, V = xb @ mixer.W_Q[:, 0], xb @ mixer.W_K[:, 0], xb @ mixer.W_V[:, 0]
                if name == "mhe-add":
                    psi = lambda A, e: A + e  # noqa: E731
                else:
                    psi = lambda A, e: A * (e + 1)  # noqa: E731
                Q, K, V = psi(Q, mixer.e_Q[i]), psi(K, mixer.e_K[i]), psi(V, mixer.e_V[i])
            else:
                raise ValueError(name)
            heads.append(attend_one_head(Q, K, V))
        outs.append(torch.cat(heads, dim=-1) @ mixer.W_O)
    return torch.stack(outs)


def extractor(mixer, x):
    """x [B,T,d] -> [B,T,d] for SHE/HE/WE/ME, from its parameters (w_ext[k] is the paper's w_{k+1})."""
    name = mixer.name
    outs = []
    for xb in x:
        src = xb @ mixer.W_in_ext if name == "he" else xb
        t = xb.shape[0]
        ext = torch.zeros(t, xb.shape[1], dtype=x.dtype)
        for i in range(t):
            for j in range(i + 1):
                if name == "she":
                    ext[i] += src[j] @ mixer.w_ext[i - j]
                else:  # we, he: element-wise; me: scalar
                    ext[i] += src[j] * mixer.w_ext[i - j]
        if name == "me":
            outs.append(ext)
            continue
        adj = (xb @ mixer.W_adj) * ext
        outs.append(adj @ mixer.W_out if hasattr(mixer, "W_out") else adj)
    return torch.stack(outs)


def mixer_output(mixer, x):
    return extractor(mixer, x) if mixer.name in ("she", "he", "we", "me") else attention(mixer, x)
