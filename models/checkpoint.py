"""Model directories: config.json + model.safetensors + tokenizer.json + card.json.

Weights are read with safetensors only (never unpickled). Every problem with a directory raises
one CheckpointError that names the file and what is wrong with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from models.config import ConfigError, ModelConfig
from models.transformer import DecoderLM

CONFIG, WEIGHTS, TOKENIZER, CARD = "config.json", "model.safetensors", "tokenizer.json", "card.json"
FILES = (CONFIG, WEIGHTS, TOKENIZER, CARD)


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file."""


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer
    card: dict
    path: Path

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def code_version() -> str:
    """The git commit of this code, or 'unknown' outside a checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, write) -> None:
    """Write via a temporary file and rename, so an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_model_dir(out_dir: str | Path, model: DecoderLM, tokenizer: Tokenizer, card: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    card = dict(card or {})
    card.setdefault("code_version", code_version())
    card.setdefault("mixer", model.config.mixer)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _write_atomic(out / CONFIG, lambda p: model.config.save(p))
    _write_atomic(out / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write_atomic(out / TOKENIZER, lambda p: tokenizer.save(str(p)))
    _write_atomic(out / CARD, lambda p: p.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n", encoding="utf-8"))
    return out


def read_json(path: Path) -> dict:
    """A JSON object from a model directory file; CheckpointError when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _check_weights(path: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], cfg_path: Path) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: file {tuple(tensors[k].shape)} vs config {tuple(expected[k].shape)}"
              for k in sorted(set(tensors) & set(expected)) if tensors[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:5]) + (" ..." if len(shapes) > 5 else ""))
    if problems:
        raise CheckpointError(f"{path} does not match {cfg_path.name}: " + "; ".join(problems))


def load_model_dir(path: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (a model directory holds {', '.join(FILES)})")
    for name in FILES:
        if not (root / name).is_file():
            raise CheckpointError(f"{root / name} is missing (a model directory holds {', '.join(FILES)})")

    try:
        cfg = ModelConfig.from_dict(read_json(root / CONFIG))
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{root / CONFIG}: {e}") from None
    card = read_json(root / CARD)

    try:
        tensors = load_file(str(root / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{root / WEIGHTS} is not a readable safetensors file (corrupt or truncated?): {e}") from None

    with torch.device("meta"):
        expected = DecoderLM(cfg).state_dict()
    _check_weights(root / WEIGHTS, tensors, expected, root / CONFIG)
    broken = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:  # NaN or inf weights would only show up later as NaN logits
        raise CheckpointError(f"{root / WEIGHTS} holds NaN or infinite values in {', '.join(broken[:5])}"
                              f"{' ...' if len(broken) > 5 else ''}")

    try:
        tokenizer = Tokenizer.from_file(str(root / TOKENIZER))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{root / TOKENIZER} could not be loaded: {e}") from None
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise CheckpointError(f"{root / TOKENIZER} has {tokenizer.get_vocab_size()} tokens but "
                              f"{CONFIG} sets vocab_size={cfg.vocab_size}")

    model = DecoderLM(cfg)
    model.load_state_dict(tensors, strict=True)
    model.to(device).eval()
    return LoadedModel(model, tokenizer, card, root)
