"""Parameter counts by component, for model cards, the app and the result tables.

A parameter's component is decided by the module that owns it (an Adapter, context pruning, a norm, the
feed-forward, the token mixer or its output projection, the embeddings), never by its name."""
from __future__ import annotations

from torch import nn

from models.adapters import NORMS, Adapter, trainable_params
from models.mixers.base import Mixer
from models.pruning import ContextPruning
from models.transformer import FeedForward

COMPONENTS = ("embeddings", "mixer", "mixer_out", "pruning", "feed_forward", "norms", "adapters")
MODEL_LEVEL = {"lm_head": "embeddings", "adapter_A": "adapters"}  # parameters held by DecoderLM itself


def _own_component(module: nn.Module) -> str | None:
    for kind, component in ((Adapter, "adapters"), (ContextPruning, "pruning"), (NORMS, "norms"),
                            (FeedForward, "feed_forward"), (Mixer, "mixer"), (nn.Embedding, "embeddings")):
        if isinstance(module, kind):
            return component
    return None


def components(model: nn.Module) -> dict[str, str]:
    """Qualified parameter name -> component."""
    out: dict[str, str] = {}

    def walk(module: nn.Module, prefix: str, inherited: str | None) -> None:
        component = _own_component(module) or inherited
        for name, _ in module.named_parameters(recurse=False):
            if isinstance(module, Mixer) and name in module.out_names:
                c = "mixer_out"
            else:
                c = component or MODEL_LEVEL.get(name)
            if c is None:
                raise ValueError(f"parameter {prefix}{name} belongs to no known component")
            out[prefix + name] = c
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.", component)

    walk(model, "", None)
    return out


def count_parameters(model: nn.Module, trainable_only: bool = False) -> dict[str, int]:
    """Counts per component plus 'total'. 'mixer' is the token mixer without its output
    projection (the papers' "attention parameters"); 'mixer_out' is W_O / W^out; 'pruning' the interaction
    projections and beta of context pruning. trainable_only: what has requires_grad now."""
    owner = components(model)
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        counts[owner[name]] += p.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    return counts


def count_trainable(model: nn.Module, freeze_base: bool = False) -> dict[str, int]:
    """Counts per component of what a fine-tune of this model trains (models.adapters.trainable_params)."""
    owner, chosen = components(model), trainable_params(model, freeze_base)
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in chosen.items():
        counts[owner[name]] += p.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    return counts
