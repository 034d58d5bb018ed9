"""The learned rule of context pruning as pure functions (docs/methods.md; Anagnostidis et al., arXiv
2305.15805): the survival rule, the distance term, the gates, the keep structure I and log I, the sparsity mass,
and the precision the rule runs in. The kernels restate these and their references call them; the model's layer
(models.pruning.interaction.ContextPruning) holds the parameters and calls the same functions, so every path
computes one rule.

    x_{n,j} = (Q_int)_n . (K_int)_j / sqrt(r) + beta  [- lambda log(n - j)]
    I_{k,j} = prod_{n=j+1..k} sigma(x_{n,j}) (j < k),  I_{k,k} = 1,  I_{k,j} = 0 (j > k)
"""
from __future__ import annotations

import torch

from kernels.alpha_sigmoid import P_FLOOR, alpha_sigmoid

# The rule's precision, whatever the model's: its parameters, Q_int / K_int (and the K_int a cache keeps) and the
# scores x_{n,j} are float32 at least (float64 in a float64 model), never bf16 / fp16, so a bf16 model's full
# forward and its decode paths compare the same numbers (a drop is permanent: one near-zero score rounded two ways
# cascades). 2dr+2 parameters and r-wide products a layer: cheap next to attention.
HALF = (torch.bfloat16, torch.float16)
LOG_FLOOR = P_FLOOR  # log(I) is taken of max(I, 1e-40) (docs/methods.md#the-keep-structure-i): finite, never NaN


def survives(x: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor, valid: torch.Tensor | None = None,
             sinks: int = 0) -> torch.Tensor:
    """The survival rule at inference, for one query against each key (shapes broadcast): key j outlives
    query n when x_{n,j} > 0; a query never drops its own or a later position, nor one of the first `sinks`;
    a padding row (valid False) drops nothing. Every cache path uses this rule (the Triton decode kernel
    restates it, tested equal)."""
    keep = (x > 0) | (key_pos >= q_pos) | (key_pos < sinks)
    return keep if valid is None else keep | ~valid


def rule_dtype(dtype: torch.dtype) -> torch.dtype:
    """The rule's precision in a model of `dtype`: float32 for a half-precision model, else the model's."""
    return torch.float32 if dtype in HALF else dtype


def state_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a decode cache keeps a named state in: the rule's K_int in rule_dtype, the rest in the model's."""
    return rule_dtype(dtype) if name == "k_int" else dtype


def widen(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in HALF else x


def distance_term(lam: torch.Tensor, key_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """-lambda log(n - j) for query position n and key position j (shapes broadcast); 0 where j >= n, whose
    decision the rule fixes anyway (a query never drops itself or a later position)."""
    return -lam * (q_pos - key_pos).clamp_min(1).to(lam.dtype).log()


def gates(x: torch.Tensor, alpha: float, sinks: int = 0) -> torch.Tensor:
    """sigma_alpha(x_{n,j}) for scores x [..., T, T] (the step at alpha = inf), the first `sinks` keys held at 1."""
    sig = alpha_sigmoid(x, alpha)
    if sinks:
        sig = torch.cat([torch.ones_like(sig[..., :sinks]), sig[..., sinks:]], dim=-1)
    return sig


def below_diagonal(t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(later: n > j, causal: n >= j), [T, T] bool each."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return causal.tril(-1), causal


def log_keep_from_gates(sig: torch.Tensor, masks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates sigma(x_{n,j}) [B,T,T] -> (log I, I), -inf / 0 above the diagonal (ContextPruning.log_keep).
    masks: below_diagonal's, when the caller has them ([T,T] each: 64 MB at 8k tokens)."""
    later, causal = masks or below_diagonal(sig.shape[-1], sig.device)
    zero = torch.zeros((), dtype=sig.dtype, device=sig.device)
    log_i = torch.where(later, sig.clamp_min(LOG_FLOOR).log(), zero).cumsum(dim=1)  # sum over j < n <= k
    return log_i.masked_fill(~causal, float("-inf")), keep_from_gates(sig, (later, causal))


def keep_from_gates(sig: torch.Tensor, masks=None) -> torch.Tensor:
    """I_{k,j} = prod_{n=j+1..k} sig_{n,j} below the diagonal, 1 on it, 0 above ([..., T, T] -> [..., T, T]);
    masks as in log_keep_from_gates."""
    later, causal = masks or below_diagonal(sig.shape[-1], sig.device)
    one, zero = torch.ones((), dtype=sig.dtype, device=sig.device), torch.zeros((), dtype=sig.dtype, device=sig.device)
    return torch.where(causal, torch.where(later, sig, one).cumprod(dim=-2), zero)


def keep_mass(keep: torch.Tensor) -> torch.Tensor:
    """sum_{j<k} I_{k,j} of one layer, batch mean: this layer's term of the sparsity loss."""
    return keep.tril(-1).sum((1, 2)).mean()
