"""Parameter counts by component, for model cards and the app."""
from __future__ import annotations

from torch import nn

COMPONENTS = ("embeddings", "mixer", "mixer_out", "pruning", "feed_forward", "norms", "adapters")


def component_of(name: str, model: nn.Module) -> str:
    """Which component a parameter (by its qualified name) belongs to."""
    parts = name.split(".")
    if "adapter" in name:
        return "adapters"
    if "pruning" in parts:
        return "pruning"
    if parts[0] in ("wte", "wpe", "lm_head"):
        return "embeddings"
    if "mixer" in parts:
        mixer = model.get_submodule(".".join(parts[: parts.index("mixer") + 1]))
        return "mixer_out" if parts[-1] in mixer.out_names else "mixer"
    if "ffn" in parts:
        return "feed_forward"
    if parts[0].startswith("ln") or (len(parts) > 2 and parts[2].startswith("ln")):
        return "norms"
    raise ValueError(f"parameter {name} belongs to no known component")


def count_parameters(model: nn.Module, trainable_only: bool = False) -> dict[str, int]:
    """Counts per component plus 'total'. 'mixer' is the token mixer without its output
    projection (the papers' "attention parameters"); 'mixer_out' is W_O / W^out; 'pruning' the interaction
    projections and beta of context pruning."""
    counts = dict.fromkeys(COMPONENTS, 0)
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        counts[component_of(name, model)] += p.numel()
    counts["total"] = sum(counts[c] for c in COMPONENTS)
    return counts
