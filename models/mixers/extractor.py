"""Extractors (Zhe Chen, arXiv 2308.07661; docs/methods.md#extractors): drop-in replacements for attention.

Weights are indexed by lag i - j; w_ext[0] is the paper's w^ext_1 (lag 0, the token itself).
  SHE: x_ext_i = sum_{j<=i} x_j W^ext_{i-j+1}          (a d x d matrix per lag)
  WE:  x_ext_i = sum_{j<=i} x_j * w^ext_{i-j+1}        (a d-vector per lag)
  HE:  WE over X' = X W^in_ext
  then X_adj = (X W^adj) * X_ext and the optional output X_adj W^out.
  ME:  x_out_i = sum_{j<=i} x_j w^ext_{i-j+1}          (a scalar per lag), nothing else.
The decode state is the window of past inputs of the lag sum (X' for HE).
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from models.errors import ConfigError
from models.mixers.base import Mixer, register


def normal(*shape: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * std)


class Extractor(Mixer):
    lag_shape: tuple[str, ...] = ()  # per-lag weight shape, in units of d_model ("d")
    in_projection = False            # HE: project before the lag sum
    adjust = True                    # all but ME

    @classmethod
    def check_config(cls, cfg):
        if cfg.prune:
            raise ConfigError(f"context pruning needs softmax attention; {cfg.mixer} is an Extractor")
        if cfg.positions != "learned" or cfg.attn_bias:
            raise ConfigError(f"{cfg.mixer} is an Extractor: rotary positions and attention biases do not apply")

    def __init__(self, cfg):
        super().__init__()
        d, std = cfg.d_model, cfg.extractor_init_std
        self.d_model = d
        self.w_ext = normal(cfg.context, *(d for _ in self.lag_shape), std=std)
        if self.in_projection:
            self.W_in_ext = normal(d, d, std=std)
        if self.adjust:
            self.W_adj = normal(d, d, std=std)
            if cfg.extractor_out:
                self.W_out = normal(d, d, std=std)

    @property
    def out_names(self):
        return ("W_out",) if hasattr(self, "W_out") else ()

    def cache_spec(self):
        return {"x": (self.d_model,)}

    def forward(self, x, cache=None, record=None, positions=None):  # positions: order is in the lags already
        src = x @ self.W_in_ext if self.in_projection else x
        start = 0
        if cache is not None:
            start = cache.length
            src = cache.append(x=src)["x"]
        y = kernels.lag_conv(src, self.w_ext, start)
        if self.adjust:
            y = (x @ self.W_adj) * y
            if hasattr(self, "W_out"):
                y = y @ self.W_out
        if record is not None:
            record.mixing = self.mixing_matrix(src.shape[1], start)
        return y

    def lag_profile(self) -> dict[str, torch.Tensor]:
        """Per-lag summary over channels: 'rms' (size of the lag's weights), 'mean' (signed) and 'fro' (the Frobenius
        norm of the lag's weights: SHE's d x d matrix, the norm of d x_ext_i / d x_j)."""
        w = self.w_ext.detach().flatten(1) if self.w_ext.dim() > 1 else self.w_ext.detach().unsqueeze(1)
        return {"rms": w.pow(2).mean(1).sqrt(), "mean": w.mean(1), "fro": w.norm(dim=1)}

    def mixing_matrix(self, s: int, start: int = 0, summary: str = "mean") -> torch.Tensor:
        """The lag weights laid out as a causal Toeplitz matrix [S-start, S]: entry (i, j) = profile[i - j]."""
        prof = self.lag_profile()[summary]
        lag = torch.arange(start, s, device=prof.device).unsqueeze(1) - torch.arange(s, device=prof.device)
        return torch.where(lag >= 0, prof[lag.clamp(min=0)], torch.zeros((), dtype=prof.dtype, device=prof.device))


@register("she")
class SHE(Extractor):
    lag_shape = ("d", "d")


@register("he")
class HE(Extractor):
    lag_shape = ("d",)
    in_projection = True


@register("we")
class WE(Extractor):
    lag_shape = ("d",)


@register("me")
class ME(Extractor):
    adjust = False
