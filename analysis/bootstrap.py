"""The bootstrap over windows behind every report's interval, and the pooled perplexity cost (pure).

A resample draws the windows with replacement, so a window's tokens move together; each resample then pools its
windows' sums. Two runs compared on the same resample are compared on the same windows (a paired interval).
The matched report reads the draws as index arrays, the corpus report as counts; both come from one rng call, so
the same seed gives the same windows either way.
"""
from __future__ import annotations

import numpy as np


def draws(n_windows: int, resamples: int, seed: int = 0) -> np.ndarray:
    """[resamples, n_windows]: the windows each resample draws."""
    return np.random.default_rng(seed).integers(0, n_windows, size=(resamples, n_windows))


def counts(n_windows: int, resamples: int, seed: int = 0) -> np.ndarray:
    """[resamples, n_windows] float64: how many times each window is drawn in each resample (the draws of `draws`
    as weights: counts @ sums pools a resample)."""
    return np.stack([np.bincount(d, minlength=n_windows) for d in draws(n_windows, resamples, seed)]).astype(np.float64)


def interval(x: np.ndarray) -> tuple[float, float]:
    """The 95 % percentile interval of resampled values."""
    lo, hi = np.percentile(x, [2.5, 97.5])
    return float(lo), float(hi)


def cost(nll: np.ndarray, dense_nll: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Perplexity relative to the dense run, minus 1, from pooled sums (any shape, elementwise): exp((NLL - dense
    NLL) / tokens) - 1."""
    return np.exp((nll - dense_nll) / tokens) - 1
