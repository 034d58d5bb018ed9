"""Adapters for parameter-efficient fine-tuning (COMPACTER, Karimi Mahabadi et al., arXiv 2106.04647),
docs/methods.md#adapters-and-compacter.

Adapter (Houlsby): A(x) = U(GeLU(D(x))) + x, D: k -> d, U: d -> k, after the mixer and after the
feed-forward sub-layer, before the residual add. A PHM layer's weight is W = sum_i A_i (x) B_i with
A_i n x n and B_i (k/n) x (d/n); LPHM factors B_i = s_i t_i^T (rank r). The forward never builds W:
with x cut into n blocks X [n, k/n], y = sum_i A_i^T (X B_i), i.e. sum_i A_i^T (X s_i) t_i^T.

Kinds: "adapter" (plain linear projections), "phm" (PHM-ADAPTER: full B_i, A_i per layer),
"compacter" (LPHM projections, one set of A_i shared by every adapter in the model), "compacter++"
(COMPACTER after the feed-forward sub-layer only).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.pruning.interaction import ContextPruning

KINDS = ("adapter", "phm", "compacter", "compacter++")


def xavier(*shape: int, fan_in: int, fan_out: int) -> nn.Parameter:
    """Xavier-uniform with gain sqrt(2) (the reference code's init for s_i, t_i and B_i)."""
    bound = math.sqrt(2.0) * math.sqrt(6.0 / (fan_in + fan_out))
    return nn.Parameter(torch.empty(*shape).uniform_(-bound, bound))


def new_A(n: int, std: float = 1e-4) -> nn.Parameter:
    """The A_i [n, n, n], N(0, 1e-4) as in the reference code."""
    return nn.Parameter(torch.randn(n, n, n) * std)


class PHMLinear(nn.Module):
    """k -> d through sum_i A_i (x) B_i; B_i full ([n, k/n, d/n]) or low rank (s_i [n, k/n, r], t_i [n, d/n, r]).
    shared_A (the A_i) may be a Parameter shared with other layers (COMPACTER: one for the whole model)."""

    def __init__(self, k: int, d: int, n: int, rank: int | None, shared_A: nn.Parameter | None = None):
        super().__init__()
        if k % n or d % n:
            raise ValueError(f"PHM needs n={n} to divide both {k} and {d}")
        self.k, self.d, self.n, self.rank = k, d, n, rank
        self.shared = shared_A is not None
        if shared_A is None:
            self.A = new_A(n)
        else:
            object.__setattr__(self, "_shared_A", shared_A)  # held, not registered: the model owns the shared tensor
        if rank is None:
            self.B = xavier(n, k // n, d // n, fan_in=k // n, fan_out=d // n)
        else:
            self.s = xavier(n, k // n, rank, fan_in=k // n, fan_out=rank)
            self.t = xavier(n, d // n, rank, fan_in=d // n, fan_out=rank)
        self.bias = nn.Parameter(torch.zeros(d))

    @property
    def A_i(self) -> torch.Tensor:
        """[n, n, n]: this layer's own A or the model's shared one."""
        return self._shared_A if self.shared else self.A

    def factors(self) -> torch.Tensor:
        """B_i [n, k/n, d/n]."""
        return self.B if self.rank is None else self.s @ self.t.transpose(1, 2)

    def weight(self) -> torch.Tensor:
        """The materialised W [k, d] = sum_i kron(A_i, B_i) (for merging and for tests)."""
        return sum(torch.kron(self.A_i[i], self.factors()[i]) for i in range(self.n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.unflatten(-1, (self.n, self.k // self.n))                          # [..., a, p]
        if self.rank is None:
            z = torch.einsum("...ap,ipq->...iaq", xb, self.B)                      # X B_i
        else:
            xs = torch.einsum("...ap,ipr->...iar", xb, self.s)                     # X s_i
            z = torch.einsum("...iar,iqr->...iaq", xs, self.t)                     # (X s_i) t_i^T
        y = torch.einsum("...iaq,iab->...bq", z, self.A_i)                        # sum_i A_i^T (.)
        return y.flatten(-2) + self.bias


class Adapter(nn.Module):
    """x -> U(GeLU(D(x))) + x, with D, U plain linear or PHM/LPHM layers."""

    def __init__(self, k: int, d: int, kind: str, n: int = 4, rank: int = 1, shared_A: nn.Parameter | None = None):
        super().__init__()
        if kind == "adapter":
            self.down, self.up = nn.Linear(k, d), nn.Linear(d, k)
            for lin in (self.down, self.up):  # near the identity at first
                nn.init.normal_(lin.weight, std=1e-3)
                nn.init.zeros_(lin.bias)
        elif kind == "phm":
            self.down, self.up = PHMLinear(k, d, n, None), PHMLinear(d, k, n, None)
        else:
            self.down, self.up = PHMLinear(k, d, n, rank, shared_A), PHMLinear(d, k, n, rank, shared_A)
        self.merged: tuple[torch.Tensor, ...] | None = None

    def adapter_params(self) -> dict[str, nn.Parameter]:
        return dict(self.named_parameters())  # a shared A_i is the model's, not this adapter's

    def merge(self) -> None:
        """Inference: build the two weight matrices once (exact) instead of the PHM sums every call."""
        with torch.no_grad():
            if isinstance(self.down, PHMLinear):
                self.merged = (self.down.weight(), self.down.bias.clone(), self.up.weight(), self.up.bias.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged is not None and not self.training:
            wd, bd, wu, bu = self.merged
            return F.gelu(x @ wd + bd) @ wu + bu + x
        return self.up(F.gelu(self.down(x))) + x


def adapter_parameter_formula(kind: str, layers: int, k: int, d: int, n: int = 4) -> int:
    """The paper's weight counts (no biases) for L decoder layers, r = 1."""
    if kind == "adapter":
        return 2 * layers * (2 * k * d)
    if kind == "phm":
        return 4 * layers * (k * d // n + n**3)
    if kind == "compacter":
        return 4 * layers * (k + d) + n**3
    if kind == "compacter++":
        return 2 * layers * (k + d) + n**3
    raise ValueError(kind)


NORMS = (nn.LayerNorm, nn.RMSNorm)


def get_adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """What a parameter-efficient fine-tune trains, found by structure (as torchtune's get_adapter_params): every
    module's own adapter_params() (the adapters, COMPACTER's shared A_i on the model, context pruning's
    W^Qint, W^Kint, beta) and the norms. Names are the model's qualified parameter names."""
    def own(module):
        if hasattr(module, "adapter_params"):
            return module.adapter_params()
        return dict(module.named_parameters(recurse=False)) if isinstance(module, NORMS) else {}
    return _collect(model, own)


def _collect(model: nn.Module, own) -> dict[str, nn.Parameter]:
    """own(module) -> {name: parameter} for every module, under the model's qualified names."""
    return {f"{prefix}.{name}" if prefix else name: p
            for prefix, module in model.named_modules() for name, p in own(module).items()}


def trainable_params(model: nn.Module, freeze_base: bool = False) -> dict[str, nn.Parameter]:
    """The one answer to "which parameters train": with an adapter in the config, get_adapter_params; with
    freeze_base (a training choice, on the card as train.freeze_base), context pruning's parameters alone;
    otherwise every parameter. The trainer, the parameter counts, the Models table and the adapter table ask here."""
    if model.config.adapter:
        return get_adapter_params(model)
    if freeze_base:
        return _collect(model, lambda m: m.adapter_params() if isinstance(m, ContextPruning) else {})
    return dict(model.named_parameters())


def set_trainable_params(model: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """requires_grad on exactly these parameters, off on every other."""
    chosen = {id(p) for p in params.values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in chosen)


def freeze_for_adapters(model: nn.Module) -> list[str]:
    """Freeze the base for a parameter-efficient fine-tune; returns the names of what trains."""
    params = get_adapter_params(model)
    set_trainable_params(model, params)
    return list(params)
