"""Interventions on the learned rule (docs/methods.md) and activation patching, over a whole text in one forward.

Forcing a decision edits the gates sigma(x_{n,j}) of one layer before the keep structure I is formed from them:
kept, token j's gate is 1 at every later query; dropped from query a, its gate is 0 there (and so, I being a product,
j is gone for every query from a on). Everything else is the rule's own: the forced layer's other tokens, and every
later layer's decisions, are recomputed on the hidden states the change produced, which is how a forced decision can
change later drops. With nothing forced the forward is the model's own; with every token kept at every layer it is
the same weights with the rule off.

Patching replaces, at chosen positions, one layer's states by a donor run's (the dense twin: the same weights with the
rule off, or the dense base a delta was trained from). Two sites: the residual stream entering the block (the pruned
model continues from the donor's states there), or the token mixer's output in the block (before any adapter and
the residual add: what that layer's attention alone contributed, everything else the model's own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.backends import LayerState, State
from models.pruning.interaction import drop_records
from models.pruning.replay import Replay
from models.scoring import head_logprobs
from models.transformer import evaluating


@dataclass(frozen=True)
class Force:
    """One forced decision: token `token` at layer `layer` (and every later layer when `onward`) kept at every
    later query (keep), or dropped from query `at` on (default token + 1, the first query that could drop it)."""
    layer: int
    token: int
    keep: bool
    at: int | None = None
    onward: bool = False

    def first_query(self) -> int:
        """The first query the force changes: a kept token's next, a dropped one's `at`."""
        return self.token + 1 if self.keep or self.at is None else self.at

    def applies(self, layer: int) -> bool:
        return layer == self.layer or (self.onward and layer > self.layer)


def check_forces(forces: list[Force], n_layers: int, t: int) -> None:
    for f in forces:
        if not 0 <= f.layer < n_layers:
            raise ValueError(f"layer {f.layer}: the model has layers 0-{n_layers - 1}")
        if not 0 <= f.token < t - 1:
            raise ValueError(f"token {f.token}: a decision about a token is made by later queries, so it must be one "
                             f"of positions 0-{t - 2} of this {t}-token text")
        if not f.keep and not f.token < f.first_query() < t:
            raise ValueError(f"drop token {f.token} from query {f.first_query()}: the query must come after the token "
                             f"and within the text (positions {f.token + 1}-{t - 1})")


def edit_gates(sig: torch.Tensor, forces: list[Force]) -> torch.Tensor:
    """The gates [B,T,T] (query n, key j) with each force applied: a kept token's column is 1 below the diagonal,
    a dropped one's 0 from its first query on. A copy: the rule's own gates are left as they are."""
    sig = sig.clone()
    for f in forces:
        j = f.token
        if f.keep:
            sig[..., j + 1:, j] = 1
        else:
            sig[..., f.first_query():, j] = 0
    return sig


class LayerIntervention(LayerState):
    """Stands in for one layer's cache in DecoderLM.forward: the whole-sequence backend with this layer's forced
    gates; keeps the query that dropped each token [T] (-1: never), not the [T,T] keep matrix."""

    def __init__(self, forces: list[Force]):
        self.forces = forces
        self.dropped_at: torch.Tensor | None = None

    def attend(self, mixer, x, q, k, v, record):
        if mixer.pruning is None:
            raise ValueError("an intervention forces the learned rule's decisions: this model does not prune")
        if q.shape[0] != 1:
            raise ValueError("an intervention reads one text at a time (batch 1)")
        edit = (lambda sig: edit_gates(sig, self.forces)) if self.forces else None
        log_i, keep = mixer.pruning.log_keep(x, edit)
        self.dropped_at = drop_records(keep > 0.5)[0][0]
        return mixer.attend(q, k, v, log_i[:, None], record, keep)


class Intervention(State):
    """The `cache` argument of DecoderLM.forward that runs the learned rule with forced decisions in every layer."""

    def __init__(self, forces: list[Force], n_layers: int):
        self.layers = [LayerIntervention([f for f in forces if f.applies(i)]) for i in range(n_layers)]


@dataclass
class Run:
    """One forward over a text: the final hidden states [T, d_m] (the head applied in chunks by the caller), the
    log-probabilities of ids[1:] [T-1], and per layer the query that dropped each token [L, T] (-1: held to the end)."""
    hidden: torch.Tensor
    logprobs: torch.Tensor
    dropped_at: torch.Tensor


def _run(model, ids: list[int], cache, **patch) -> Run:

    model.check_fits(len(ids))
    x = torch.tensor([ids], device=model.wte.weight.device)
    with evaluating(model):
        hidden = model(x, cache=cache, hidden_only=True, **patch).hidden[0]
    lp = head_logprobs(model, hidden[:-1], x[0, 1:])
    # [L, T]: a replay's layers keep one row per KV group ([R, T]); the twin's (nothing evicted) are all -1
    return Run(hidden, lp, torch.stack([layer.dropped_at.reshape(-1, len(ids)).amax(0) for layer in cache.layers]))


@torch.no_grad()   # (not inference_mode: callers compute on what comes back)
def forced(model, ids: list[int], forces: list[Force] = ()) -> Run:
    """The pruned model over ids with `forces` applied (none: the model's own forward)."""
    check_forces(list(forces), model.config.n_layers, len(ids))
    return _run(model, ids, Intervention(list(forces), model.config.n_layers))


# what a patch replaces: the block's input, or its token mixer's output; each the DecoderLM.forward argument that
# hands it over (no hook: app sessions share the model)
SITES = {"residual": "residual", "mixer": "mixer_out"}


def _at(site: str, layer: int, fn) -> dict:
    """The DecoderLM.forward argument that applies fn to layer `layer`'s states at `site` and passes the rest on."""
    return {SITES[site]: lambda i, h: fn(h) if i == layer else h}


def _check_site(model, layer: int, site: str) -> None:
    if site not in SITES:
        raise ValueError(f"site {site!r}: patch the 'residual' stream entering a block or its 'mixer' output")
    if not 0 <= layer < model.config.n_layers:
        raise ValueError(f"layer {layer}: the model has layers 0-{model.config.n_layers - 1}")


@torch.no_grad()
def residuals(model, ids: list[int], layer: int, rule: bool = True, site: str = "residual") -> torch.Tensor:
    """One layer's states [T, d_m] at `site`: the residual stream entering block `layer`, or that block's token mixer
    output; of the model as it runs (rule True) or, for a pruned model, of the same weights with the rule off (its
    dense twin)."""

    _check_site(model, layer, site)
    kept = {}

    def keep(x):
        kept["x"] = x[0].clone()
        return x

    model.check_fits(len(ids))
    x = torch.tensor([ids], device=model.wte.weight.device)
    cache = None if rule else _twin(model)
    with evaluating(model):
        model(x, cache=cache, hidden_only=True, **_at(site, layer, keep))
    return kept["x"]


@torch.no_grad()
def patched(model, ids: list[int], layer: int, positions: list[int], donor: torch.Tensor, rule: bool = True,
            site: str = "residual") -> Run:
    """The pruned model over ids with layer `layer`'s states at `site` (the residual stream entering the block, or the
    block's mixer output) replaced at `positions` by the donor's (a [T, d_m] from `residuals`, of the dense twin or
    the dense base, at the same site); its rule runs on what follows. With rule False the same weights run with the
    rule off (the dense twin), so the pruned model's own states (residuals(model, ...)) can be patched into its
    twin."""
    t = len(ids)
    _check_site(model, layer, site)
    if not positions or any(not 0 <= p < t for p in positions):
        raise ValueError(f"positions must be within the text (0-{t - 1})")
    if tuple(donor.shape) != (t, model.config.d_model):
        raise ValueError(f"the donor's states are {tuple(donor.shape)}, not [{t}, {model.config.d_model}]: the donor "
                         "must read the same text with the same width")
    at = torch.tensor(sorted(set(positions)), device=donor.device)

    def patch(x):
        x = x.clone()
        x[0, at] = donor[at].to(x.dtype)
        return x

    cache = Intervention([], model.config.n_layers) if rule else _twin(model)
    return _run(model, ids, cache, **_at(site, layer, patch))


def _twin(model):
    return Replay(None, model.config.n_layers)   # (nothing evicted: the same weights with the rule off)


@torch.no_grad()
def twin_run(model, ids: list[int]) -> Run:
    """The pruned model's dense twin over ids (the same weights, the rule off; nothing is dropped)."""
    return _run(model, ids, _twin(model))
