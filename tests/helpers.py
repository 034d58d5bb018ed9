import torch

from models.config import ModelConfig
from models.mixers import MIXERS

ALL_MIXERS = list(MIXERS)
EXTRACTORS = ["she", "he", "we", "me"]
ATTENTION = [m for m in ALL_MIXERS if m not in EXTRACTORS]


def tiny_config(mixer: str, **overrides) -> ModelConfig:
    base = dict(mixer=mixer, vocab_size=61, context=24, d_model=16, n_layers=2, n_heads=4)
    base.update(overrides)
    return ModelConfig(**base)


def cached_logits(model, idx: torch.Tensor, chunks: list[int] | None = None):
    """idx fed through a fresh static cache in chunks (default: one token at a time): (logits, cache)."""
    from models.decode import Decoder
    dec, outs, at = Decoder(model, batch=idx.shape[0]), [], 0
    for n in chunks or [1] * idx.shape[1]:
        outs.append(dec.extend(idx[:, at:at + n]))
        at += n
    return torch.cat(outs, 1), dec.state


def randomize(module: torch.nn.Module, std: float = 0.3, seed: int = 0) -> None:
    """Fresh, large random weights: small paper-style inits would hide indexing mistakes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)
