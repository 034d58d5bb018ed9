"""Fitting the learned rule to a keep target from cached inputs of the frozen dense model (train.imitate).

The rule of one layer (W^Qint, W^Kint, beta, lambda: models.pruning.interaction) sees only that layer's normed
input x. Over a frozen base those inputs, and a target of what the layer should keep, follow from the dense model
alone, so they can be computed once per window and cached; fitting the rule to them then needs no forward or
backward through the base (the end-to-end distillation of train.distill needs both at every step).

Two targets, each a per-layer keep structure T_{k,j} in {0, 1} that is monotone like I (a token once dropped
stays dropped), stored as the last query that still sees each token, `until[l, j]` (k <= until: kept):

- "oracle": the hindsight oracle (models.pruning.policies.Oracle) stepping through the window over the layer's
  dense attention, all heads summed (one decision per layer, as the rule takes), at the budget whose sparsity is
  nearest the target; it evicts after the query at its step attended, so that query still sees the token.
- "attention": keep token j while some later query still attends to it above a threshold (the largest weight
  over heads), with the threshold bisected per layer and window so the layer's sparsity is the target: j is kept
  up to the last query that needs it.

The loss acts on the rule's own keep structure I_{k,j} under the alpha-sigmoid, over the pairs j < k that a rule
decides (the sinks are held anyway): binary cross-entropy -[T log I + (1 - T) log(1 - I)], mean over pairs and
layers, with I floored at 1e-40 and 1 - I at 1e-6. The result is the paper's rule with its distance term and sinks,
usable wherever the rule is.

Cache: shards of `SHARD` windows, each a safetensors file holding x [n, L, T, d_model] in float16,
until [n, L, T] int16 and the window's token ids [n, T] int32, beside `meta.json` (target, sparsity, window,
layers, width, the base's weights hash, bytes per token). 2 L d_model + 2 L + 4 bytes a token: 34.6 KB for
SmolLM2-135M (30 layers of 576), 17.7 MB a 512-token window. Shards are written whole under a temporary name and
renamed, so an interrupted build resumes at the first missing shard.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

import kernels
from models.backends import LayerState, State
from models.files import write_atomic
from models.pruning import policies
from kernels.keep_rule import LOG_FLOOR
from models.pruning.interaction import mean_sparsity
from models.pruning.replay import evict

TARGETS = ("oracle", "attention")
FLOOR = math.log(LOG_FLOOR)
SHARD = 16            # windows a shard holds
META = "meta.json"


def bytes_per_token(n_layers: int, d_model: int) -> int:
    """x in float16, until in int16, the id in int32."""
    return 2 * n_layers * d_model + 2 * n_layers + 4


def keep_target(until: torch.Tensor) -> torch.Tensor:
    """until [..., T] (the last query that sees each token) -> T_{k,j} [..., T, T] bool, causal: k <= until_j."""
    t = until.shape[-1]
    k = torch.arange(t, device=until.device)
    return (k[:, None] <= until[..., None, :]) & (k[:, None] >= k[None, :])


def until_from_dropped(dropped_at: torch.Tensor, t: int) -> torch.Tensor:
    """A policy's dropped_at (the step whose query still attended before it evicted; -1: never) -> until."""
    return torch.where(dropped_at < 0, t - 1, dropped_at)


def oracle_until(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """scores [h, T, T] (one layer's raw q.k scores, all heads) -> until [T] of the hindsight oracle at the budget
    whose sparsity over a T-token window is nearest `sparsity`, one decision for the layer."""
    t = scores.shape[-1]
    policy = policies.make("oracle", policies.budget_for("oracle", sparsity, t))
    _, dropped_at = evict(policy, t, scores[None].float(), None, scores.device)
    return until_from_dropped(dropped_at[0], t)


def attention_until(probs: torch.Tensor, sparsity: float, steps: int = 40) -> torch.Tensor:
    """probs [h, T, T] (one layer's causal attention) -> until [T]: token j kept up to the last query whose largest
    weight on it over heads exceeds a threshold, the threshold bisected (in log space) so the sparsity, averaged as
    the reports average it, is nearest `sparsity`."""
    t = probs.shape[-1]
    need = probs.amax(0).float()                                     # [T, T]: query n's largest weight on key j
    n = torch.arange(t, device=probs.device)

    def until_at(tau: float) -> torch.Tensor:
        over = (need > tau) | (n[:, None] == n[None, :])             # a query always sees itself
        return torch.where(over, n[:, None], -1).amax(0)            # the last query that needs j

    def sparsity_at(tau: float) -> float:
        return float(mean_sparsity(keep_target(until_at(tau)).float(), count_first=False))

    lo, hi = -30.0, 0.0                                               # log10 of the threshold: 1e-30 .. 1
    for _ in range(steps):
        mid = (lo + hi) / 2
        if sparsity_at(10 ** mid) < sparsity:
            lo = mid
        else:
            hi = mid
    return until_at(10 ** hi)


class _LayerTarget(LayerState):
    """A layer of the dense model that attends as usual (causal) and notes its input x and its target."""

    def __init__(self, target: str, sparsity: float):
        self.target, self.sparsity = target, sparsity
        self.x = self.until = None

    def attend(self, mixer, x, q, k, v, record):
        if q.shape[0] != 1:
            raise ValueError("the imitation target is taken one window at a time (batch 1)")
        scores = kernels.reference.attention_scores(q, k, scale=mixer.scale, **mixer.head_maps())[0]   # [h,T,T]
        if self.target == "oracle":
            self.until = oracle_until(scores, self.sparsity)
        else:
            t = scores.shape[-1]
            causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()
            self.until = attention_until(scores.float().masked_fill(~causal, -math.inf).softmax(-1), self.sparsity)
        self.x = x[0]
        return mixer.attend(q, k, v, None, record, causal=True)


class _Targets(State):
    def __init__(self, n_layers: int, target: str, sparsity: float):
        self.layers = [_LayerTarget(target, sparsity) for _ in range(n_layers)]


@torch.inference_mode()
def window_targets(model, ids: torch.Tensor, target: str, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One window ids [T] through the dense model (its rule, if any, off: the caller's) -> (x [L, T, d] of each
    layer's attention input, until [L, T])."""
    if target not in TARGETS:
        raise ValueError(f"imitation target must be one of {', '.join(TARGETS)}, got {target!r}")
    state = _Targets(model.config.n_layers, target, sparsity)
    model(ids[None], cache=state)
    return torch.stack([s.x for s in state.layers]), torch.stack([s.until for s in state.layers])


def check_meta(path: Path, meta: dict) -> None:
    """A cache directory holds shards of one recipe: refuse to mix in another."""
    if (path / META).exists():
        have = json.loads((path / META).read_text())
        if {k: have.get(k) for k in meta} != meta:
            raise ValueError(f"{path} holds an imitation cache of another recipe ({have}); give another directory")


def build_cache(model, windows: np.ndarray, path: str | Path, target: str, sparsity: float, base_sha256: str,
                progress: bool = True) -> dict:
    """Cache x and the target of every window (windows [N, T] token ids) under `path`, SHARD windows a file;
    shards already there are kept (a resumed build). Returns the meta."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    meta = {"target": target, "sparsity": sparsity, "window": int(windows.shape[1]), "layers": cfg.n_layers,
            "d_model": cfg.d_model, "base_weights_sha256": base_sha256}
    check_meta(path, meta)
    write_atomic(path / META, lambda p: p.write_text(json.dumps(
        meta | {"bytes_per_token": bytes_per_token(cfg.n_layers, cfg.d_model)}, indent=1) + "\n"))
    shards = math.ceil(len(windows) / SHARD)
    dev = model.wte.weight.device
    with tqdm(total=len(windows), desc=f"imitation cache ({target})", disable=not progress) as bar:
        for s in range(shards):
            part = windows[s * SHARD:(s + 1) * SHARD]
            out = path / f"shard_{s:05d}.safetensors"
            if not out.exists():
                xs, untils = zip(*(window_targets(model, torch.as_tensor(w, device=dev).long(), target, sparsity)
                                   for w in _ticking(part, bar)))
                tensors = {"x": torch.stack(xs).half().cpu().contiguous(),
                           "until": torch.stack(untils).to(torch.int16).cpu().contiguous(),
                           "ids": torch.as_tensor(part.astype(np.int32))}
                write_atomic(out, lambda p, t=tensors: save_file(t, str(p)))
            else:
                bar.update(len(part))
    return meta | {"windows": len(windows)}


def _ticking(items, bar):
    for item in items:
        yield item
        bar.update(1)


class Cache:
    """A built cache, read a batch of windows at a time (memory-mapped shards)."""

    def __init__(self, path: str | Path, windows: int):
        self.path = Path(path)
        self.meta = json.loads((self.path / META).read_text())
        self.files = [self.path / f"shard_{s:05d}.safetensors" for s in range(math.ceil(windows / SHARD))]
        missing = [f.name for f in self.files if not f.exists()]
        if missing:
            raise ValueError(f"{self.path}: the imitation cache lacks {len(missing)} shard(s) ({missing[0]}, ...)")
        self.windows = windows

    def batch(self, indices, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` -> (x [L, B, T, d] float32, until [L, B, T] long) on device."""
        xs, untils = [], []
        for i in indices:
            with safe_open(str(self.files[i // SHARD]), framework="pt") as f:
                xs.append(f.get_slice("x")[i % SHARD])
                untils.append(f.get_slice("until")[i % SHARD])
        x = torch.stack(xs).transpose(0, 1).to(device=device, dtype=torch.float32)
        return x, torch.stack(untils).transpose(0, 1).to(device=device, dtype=torch.long)


def order(windows: int, step: int, batch: int, seed: int) -> np.ndarray:
    """The windows of a step: epochs of seeded permutations, read in order (a resumed run reads the same)."""
    first = step * batch
    out = []
    while len(out) < batch:
        epoch, at = divmod(first + len(out), windows)
        perm = np.random.default_rng([seed, epoch]).permutation(windows)
        out.extend(perm[at:at + batch - len(out)].tolist())
    return np.asarray(out)


def imitation_loss(rules, x: torch.Tensor, until: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rules: each layer's ContextPruning (in training mode, alpha set); x [L, B, T, d]; until [L, B, T] ->
    (the binary cross-entropy of I against the target, mean over layers and decided pairs; the sparsity mass
    sum over layers of sum_{j<k} I_{k,j}, batch mean, as the trainer logs it)."""
    t = x.shape[2]
    j = torch.arange(t, device=x.device)
    decided = (j[:, None] > j[None, :])                                        # [k, j]: j < k
    losses, mass = [], x.new_zeros(())
    for rule, xl, ul in zip(rules, x, until):
        cols = decided & (j[None, :] >= rule.sinks)
        log_i, keep, m = rule.log_keep(xl, mass=True)
        want = keep_target(ul)                                                   # [B, k, j]
        log_drop = torch.log1p(-keep.clamp(max=1 - 1e-6))
        # log I at most as low as log 1e-40 (one floored gate's): a pair several gates dropped would otherwise count
        # once per gate and a few such pairs outweigh all the rest
        bce = -torch.where(want, log_i.clamp_min(FLOOR), log_drop)
        losses.append(bce[:, cols].mean())
        mass = mass + m
    return torch.stack(losses).mean(), mass
