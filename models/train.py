"""Train a model from a config file into a model directory.

    python -m models.train --config configs/zoo/mha.json --out assets/models/mha
    torchrun --nproc_per_node 4 -m models.train --config ... --out ...     (DistributedDataParallel)

A config file holds {"base": "other.json" (optional), "model": {ModelConfig fields}, "train": {TrainConfig
fields}}; "base" is merged underneath. Batches depend only on (seed, step): every variant trained with the
same seed sees identical batches in identical order, and so does a resumed run. Training state is
checkpointed to OUT/train_state.safetensors; running the same command again resumes from it.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.adapters import set_trainable_params, trainable_params
from models import snapshots
from models.checkpoint import FILES, save_model_dir
from models.config import ConfigError, ModelConfig
from models.device import describe, resolve
from models.data import DataError, load_documents, load_tokens, manifest_sha256
from models.evaluate import encode_documents, score_documents
from models.files import file_sha256
from models.params import components, count_trainable
from kernels.alpha_sigmoid import alpha_schedule
from models.pruning import imitation, mean_sparsity, pair_count, sparsity_loss
from kernels.alpha_sigmoid import prefetch_schedule
from models.step_graph import GraphedLoss, schedule_alphas
from models.transformer import DecoderLM

log = logging.getLogger("models.train")
STATE = "train_state.safetensors"
LOG = "train_log.jsonl"


@dataclass
class TrainConfig:
    data: str = "data"
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 8
    checkpoint_interval: int = 100
    eval_stride: int = 256
    compile: bool = False  # torch.compile, CUDA only
    cuda_graph: bool = False  # each step's forward and backward replayed from CUDA graphs (models/step_graph.py);
                              # CUDA only, one process, not with compile or distill
    init_from: str | None = None  # a model directory to start from (fine-tuning; e.g. a dense base for pruning)
    gamma: float = 0.3            # context pruning: weight of the sparsity loss
    alpha_start: float = 1.0      # context pruning: alpha rises alpha_start -> alpha_end on a cosine over alpha_steps
    alpha_end: float = 8.0
    alpha_steps: int | None = None  # default: all steps
    freeze_base: bool = False     # train context pruning's parameters alone (the base model stays as it is)
    prune_init: str = "paper"     # "calibrated": scale W^Qint, W^Kint to the base's real inputs
                                  # (ContextPruning.calibrate);
                                  # "window": calibrated, then each layer starts as a recent window
                                  # (ContextPruning.init_window)
    prune_window: int = 100       # the window of prune_init "window"
    scalar_lr_mult: float = 1.0   # context pruning's scalars (beta, lambda) learn at lr x this (one number each:
                                  # they move slowly)
    distill: bool = False         # pruning, base frozen: KL to the same model with its rule off, not the corpus's
                                  # next tokens
    snapshots: int = 0            # save the trained tensors at step 0 and this many steps over the alpha schedule
                                  # (models/snapshots.py: the Pruning page's timeline)
    imitate: str | None = None    # "oracle" | "attention": fit the rule to that keep target from cached inputs of
                                  # the frozen dense model, no forward through the base (models/pruning/imitation.py)
    imitate_sparsity: float = 0.65  # the target's sparsity, per layer and window
    imitate_windows: int = 256    # training windows (of model.context tokens) cached and cycled through
    imitate_cache: str | None = None  # where the cache lives (default: <out>/imitation_cache); reused when the
                                      # recipe matches


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_config_file(path: str | Path, _seen=()) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: 'base' chain loops back on itself")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    unknown = set(raw) - {"base", "model", "train"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown)}; expected base, model, train")
    if "base" in raw:
        raw = _merge(read_config_file(path.parent / raw.pop("base"), (*_seen, path.resolve())), raw)
    return raw


def load_run_config(path: str | Path) -> tuple[ModelConfig, TrainConfig, dict]:
    raw = read_config_file(path)
    try:
        model_cfg = ModelConfig.from_dict(raw.get("model", {}))
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: model: {e}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(raw.get("train", {})) - known
    if unknown:
        raise ConfigError(f"{path}: train: unknown field(s) {sorted(unknown)}")
    tc = TrainConfig(**raw.get("train", {}))
    for name in ("steps", "batch_size", "log_interval", "eval_interval", "eval_batches", "checkpoint_interval"):
        if not isinstance(getattr(tc, name), int) or getattr(tc, name) < 1:
            raise ConfigError(f"{path}: train.{name} must be a positive integer, got {getattr(tc, name)!r}")
    if not 0 < tc.eval_stride <= model_cfg.context:
        raise ConfigError(f"{path}: train.eval_stride ({tc.eval_stride}) must be in "
                          f"[1, model.context={model_cfg.context}]")
    if tc.freeze_base and not model_cfg.prune:
        raise ConfigError(f"{path}: train.freeze_base trains context pruning alone, but model.prune is off")
    if tc.distill and not (tc.freeze_base and model_cfg.prune and model_cfg.adapter is None):
        raise ConfigError(f"{path}: train.distill learns a pruning rule against its own frozen base: it needs "
                          "model.prune, train.freeze_base and no adapter")
    if tc.prune_init not in ("paper", "calibrated", "window"):
        raise ConfigError(f"{path}: train.prune_init must be paper, calibrated or window, got {tc.prune_init!r}")
    if tc.prune_init == "window" and not (model_cfg.prune and model_cfg.prune_distance):
        raise ConfigError(f"{path}: train.prune_init window starts the rule's distance term as a recent window: it "
                          "needs model.prune and model.prune_distance")
    if "prune_window" in raw.get("train", {}) and tc.prune_init != "window":
        raise ConfigError(f"{path}: train.prune_window is the window of prune_init \"window\", but prune_init is "
                          f"{tc.prune_init!r}")
    if tc.prune_init == "window" and (isinstance(tc.prune_window, bool) or not isinstance(tc.prune_window, int)
                                      or not 1 <= tc.prune_window < model_cfg.context):
        raise ConfigError(f"{path}: train.prune_window must be an integer in [1, model.context={model_cfg.context}), "
                          f"got {tc.prune_window!r}")
    alphas = (tc.alpha_start, tc.alpha_end)
    if (not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in alphas)
            or not 1.0 <= alphas[0] <= alphas[1]):
        raise ConfigError(f"{path}: train needs numbers 1 <= alpha_start <= alpha_end, "
                          f"got {tc.alpha_start!r}, {tc.alpha_end!r}")
    if tc.warmup < 0 or tc.lr <= 0 or tc.min_lr < 0:
        raise ConfigError(f"{path}: train.lr, min_lr and warmup must be positive")
    if tc.cuda_graph and (tc.compile or tc.distill):
        raise ConfigError(f"{path}: train.cuda_graph captures the plain step: not with train.compile or train.distill")
    if tc.imitate is not None:
        _check_imitation(path, model_cfg, tc)
    return model_cfg, tc, raw


def _check_imitation(path, model_cfg: ModelConfig, tc: TrainConfig) -> None:
    if tc.imitate not in imitation.TARGETS:
        raise ConfigError(f"{path}: train.imitate must be one of {', '.join(imitation.TARGETS)}, got {tc.imitate!r}")
    if not (model_cfg.prune and tc.freeze_base and model_cfg.adapter is None and tc.init_from):
        raise ConfigError(f"{path}: train.imitate fits a pruning rule over a frozen base: it needs model.prune, "
                          "train.freeze_base, train.init_from and no adapter")
    if tc.distill or tc.cuda_graph or tc.compile:
        raise ConfigError(f"{path}: train.imitate trains from its cache: not with distill, cuda_graph or compile "
                          "(distil from its result in a second run)")
    s = tc.imitate_sparsity
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < 1:
        raise ConfigError(f"{path}: train.imitate_sparsity must be a number in (0, 1), got {s!r}")
    w = tc.imitate_windows
    if isinstance(w, bool) or not isinstance(w, int) or w < tc.batch_size:
        raise ConfigError(f"{path}: train.imitate_windows must be an integer of at least batch_size, got {w!r}")


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warmup, then cosine decay from lr to min_lr at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def batch_offsets(seed: int, step: int, n_tokens: int, context: int, batch_size: int) -> np.ndarray:
    """Start offsets of the batch for this step: a function of (seed, step) only."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - context - 1, size=batch_size)


def get_batch(tokens: np.ndarray, offsets: np.ndarray, context: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([tokens[o:o + context + 1] for o in offsets]).astype(np.int64)
    t = torch.from_numpy(rows).to(device)
    return t[:, :-1], t[:, 1:]


def param_groups(model: torch.nn.Module, weight_decay: float, scalar_lr_mult: float = 1.0) -> list[dict]:
    """Decay weight matrices only. Head embeddings and lag weights are what the analysis pages study, and
    decay would pull them towards zero (identical heads, a shrunken lag profile), so they are left alone.
    Context pruning's scalars (beta, lambda) form their own group at lr x scalar_lr_mult."""
    decay, no_decay, scalars = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 0 and ".pruning." in name:
            scalars.append(p)
            continue
        (no_decay if p.dim() < 2 or leaf in ("e_Q", "e_K", "e_V", "w_ext") else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if scalars:
        groups.append({"params": scalars, "weight_decay": 0.0, "lr_mult": scalar_lr_mult})
    return groups


def config_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def save_state(path: Path, model, opt, step: int, meta: dict) -> None:
    tensors = {f"model/{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    for idx, st in opt_state["state"].items():
        for k, v in st.items():
            tensors[f"opt/{idx}/{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    meta = dict(meta, step=step, param_groups=opt_state["param_groups"])
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"state": json.dumps(meta)})
    os.replace(tmp, path)


def load_state(path: Path, model, opt) -> dict:
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["state"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable training state ({e}); delete it to start over") from None
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt/"):
            _, idx, name = k.split("/", 2)
            state.setdefault(int(idx), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta.pop("param_groups")})
    torch.set_rng_state(tensors["rng/torch"])
    return meta


FINE_TUNE_FIELDS = {"context",  # shorter for a fine-tune of a rotary model; learned positions must match (shapes)
                    "prune", "prune_r", "prune_beta", "prune_distance", "prune_sinks", "pattern", "pattern_k",
                    "adapter", "adapter_reduction", "phm_n", "phm_rank"}  # config fields a fine-tune may change


def init_from(model: DecoderLM, model_cfg: ModelConfig, path: str, data_tokenizer) -> None:
    """Start from a trained model directory whose config matches except for FINE_TUNE_FIELDS; only the
    parameters those add (pruning, adapters) may be missing from it."""
    from models.checkpoint import load_model_dir
    base = load_model_dir(path)
    a, b = base.config.to_dict(), model_cfg.to_dict()
    differ = sorted(k for k in a if (k not in FINE_TUNE_FIELDS or (k == "context" and b["positions"] == "learned"))
                    and a[k] != b[k])
    if differ:
        raise ConfigError(f"init_from {path}: its config differs in "
                          f"{', '.join(f'{k} ({a[k]} vs {b[k]})' for k in differ)}")
    if base.tokenizer.to_str() != data_tokenizer.to_str():
        raise ConfigError(f"init_from {path}: its tokenizer.json is not the data directory's tokenizer")
    result = model.load_state_dict(base.model.state_dict(), strict=False)
    owner = components(model)
    missing = [k for k in result.missing_keys if owner.get(k) not in ("pruning", "adapters")]
    if missing or result.unexpected_keys:
        raise ConfigError(f"init_from {path}: weights do not fit (missing {missing[:4]}, "
                          f"unexpected {result.unexpected_keys[:4]})")


@contextmanager
def rule_off(model: DecoderLM):
    """The trainer's own model with every layer's pruning switched off: the dense base, the distillation teacher
    (train.distill). Only the trainer calls this; a loaded model is never changed so."""
    rules = [b.mixer.pruning for b in model.blocks]
    for b in model.blocks:
        b.mixer.pruning = None
    try:
        yield model
    finally:
        for b, rule in zip(model.blocks, rules):
            b.mixer.pruning = rule


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, mean over positions: how far pruning moves the next-token
    distribution away from the same model with its whole context."""
    wide = lambda z: z.float() if z.dtype in (torch.bfloat16, torch.float16) else z  # noqa: E731 (fp32 at least)
    log_s = F.log_softmax(wide(student_logits), dim=-1)
    log_t = F.log_softmax(wide(teacher_logits), dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean()


def calibrate_pruning(model: DecoderLM, idx: torch.Tensor) -> list[float]:
    """ContextPruning.calibrate of every layer on the inputs it really sees for the token batch idx; returns
    the per-layer RMS."""
    from models.transformer import evaluating
    seen: dict[int, torch.Tensor] = {}
    hooks = [b.ln_1.register_forward_hook(lambda mod, inp, out, k=k: seen.__setitem__(k, out.detach()))
             for k, b in enumerate(model.blocks)]
    try:
        with torch.no_grad(), evaluating(model):
            model(idx)
    finally:
        for h in hooks:
            h.remove()
    return [b.mixer.pruning.calibrate(seen[k]) for k, b in enumerate(model.blocks)]


class StopFlag:
    """SIGINT/SIGTERM only raise a flag; the loop stops at the next step boundary, so the saved state is
    never half an optimizer step."""

    def __init__(self):
        self.reason = None

    def __call__(self, signum, frame):
        self.reason = signal.Signals(signum).name


MODEL_FILES = (*FILES, LOG)  # what a finished run leaves (a model directory and its curve)


def graphed_loss(model: DecoderLM, tc: TrainConfig, dev: torch.device, world: int,
                 start: int = 0) -> GraphedLoss | None:
    """train.cuda_graph's GraphedLoss for this run's steps from `start` (a resumed run's forms are counted over
    the steps it has left), or None (with a warning) where its steps run eagerly: off CUDA, over several processes,
    or where a pruned step's keep structure would not take the Triton kernel (the reference's reads its table's
    range from the host: models/step_graph.py)."""
    import kernels
    if dev.type != "cuda" or world > 1:
        why = "one CUDA process"
    elif model.config.prune and kernels.backend_for("log_keep", torch.empty(0, device=dev)) != "triton":
        why = "the Triton keep kernel (MIXSCOPE_KERNELS=reference, or no Triton here)"
    else:
        schedule = (tc.alpha_steps or tc.steps, tc.alpha_start, tc.alpha_end)
        return GraphedLoss(model, schedule_alphas(tc.steps, *schedule)[start:] if model.config.prune else ())
    log.warning("train.cuda_graph needs %s: this run's steps run eagerly", why)
    return None


def check_out_dir(out: Path, overwrite: bool) -> None:
    """A run may write into a new or empty directory, resume an unfinished run there (its train_state says so),
    or replace a finished model only when asked (overwrite=True); nothing else is touched."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if (out / STATE).exists() or overwrite:
        return
    present = [name for name in MODEL_FILES if (out / name).exists()]
    if present:
        raise ConfigError(f"{out} already holds a model or a run ({', '.join(present)}) and no unfinished "
                          f"{STATE}: choose another --out, or pass --overwrite to replace it")


@dataclass
class _Run:
    """A run as resolved and checked: its config, where it writes, its processes and device, its data."""
    model_cfg: ModelConfig
    tc: TrainConfig
    raw: dict
    out: Path
    dev: torch.device
    world: int
    rank: int
    train_tokens: np.ndarray
    valid_tokens: np.ndarray
    tokenizer: object

    @property
    def main_proc(self) -> bool:
        return self.rank == 0

    @property
    def state_path(self) -> Path:
        return self.out / STATE

    @property
    def log_path(self) -> Path:
        return self.out / LOG


@dataclass
class _Counters:
    """Where a run stands: the next step, the tokens it has trained on and the time its steps took."""
    step: int = 0
    tokens_seen: int = 0
    elapsed: float = 0.0


@dataclass
class _Trainer:
    """The model and what trains it: the optimizer, the forward the steps call (compiled, or under
    DistributedDataParallel), train.cuda_graph's graphs, the autocast and the validation batches' offsets."""
    model: DecoderLM
    opt: torch.optim.Optimizer
    trainable: dict[str, torch.nn.Parameter]
    calibration: list[float] | None
    snapshot_at: set[int]
    n_pairs: int
    fwd: torch.nn.Module
    graphed: GraphedLoss | None
    autocast: torch.autocast
    valid_offsets: np.ndarray
    imitation: imitation.Cache | None = None


def train(config_path: str | Path, out: str | Path, device: str = "auto", stop_after: int | None = None,
          progress: bool = True, overwrite: bool = False) -> dict:
    """Train (or resume) and write the model directory; returns the card. stop_after: leave after that
    many steps of this run with the state saved, as an interruption would (used by tests). A directory that
    holds a finished model is refused unless overwrite (then the run starts over)."""
    run = _resolve_run(config_path, out, device, overwrite)
    model, opt, trainable, calibration = _build_model(run)
    counts, snapshot_at = _restore(run, model, opt, trainable, overwrite)
    trainer = _trainer(run, model, opt, trainable, calibration, snapshot_at, counts.step)
    trainer.imitation = _imitation_cache(run, model, progress) if run.tc.imitate else None
    status, recent, stopped = _step_loop(run, trainer, counts, stop_after, progress)
    if stopped:
        if run.main_proc:
            _checkpoint(run, trainer, counts)
            log.warning("stopped at step %d (%s); run the same command again to resume", counts.step, stopped)
        return {"status": "interrupted", "steps": counts.step}
    return _conclude(run, trainer, counts, status, recent)


def _resolve_run(config_path: str | Path, out: str | Path, device: str, overwrite: bool) -> _Run:
    """The config, the output directory, the processes and device, the data and its tokenizer, all checked."""
    model_cfg, tc, raw = load_run_config(config_path)
    out = Path(out)
    check_out_dir(out, overwrite)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if device == "auto" and torch.cuda.is_available():
        device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    dev = resolve(device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        if tc.batch_size % world:
            raise ConfigError(f"batch_size {tc.batch_size} does not split over {world} processes")

    train_tokens = load_tokens(tc.data, "train")
    valid_tokens = load_tokens(tc.data, "valid")
    from tokenizers import Tokenizer
    tok_path = Path(tc.data) / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_path))
    if tokenizer.get_vocab_size() > model_cfg.vocab_size:
        raise ConfigError(f"{tok_path} has {tokenizer.get_vocab_size()} tokens, "
                          f"more than vocab_size={model_cfg.vocab_size}")
    if min(train_tokens.size, valid_tokens.size) <= model_cfg.context + 1:
        raise DataError(f"{tc.data}: the train and valid splits need more than "
                        f"context+1={model_cfg.context + 1} tokens")
    return _Run(model_cfg, tc, raw, out, dev, world, rank, train_tokens, valid_tokens, tokenizer)


def _build_model(run: _Run) -> tuple[DecoderLM, torch.optim.Optimizer, dict[str, torch.nn.Parameter],
                                     list[float] | None]:
    """The model (initialised, or from train.init_from; context pruning calibrated as train.prune_init asks) on the
    run's device, what trains of it set trainable, its optimizer; and the calibration's per-layer RMS, or None."""
    model_cfg, tc, train_tokens = run.model_cfg, run.tc, run.train_tokens
    torch.manual_seed(tc.seed)  # same init for the same variant and seed
    model = DecoderLM(model_cfg)
    if tc.init_from:
        init_from(model, model_cfg, tc.init_from, run.tokenizer)
    calibration = None
    # on the first training batch (a function of the seed)
    if model_cfg.prune and tc.prune_init in ("calibrated", "window"):
        x0, _ = get_batch(train_tokens, batch_offsets(tc.seed, 0, train_tokens.size, model_cfg.context, tc.batch_size),
                          model_cfg.context, "cpu")
        calibration = calibrate_pruning(model, x0)
        log.info("pruning calibrated to input RMS %s", ", ".join(f"{r:.3f}" for r in calibration))
        if tc.prune_init == "window":
            for b in model.blocks:
                b.mixer.pruning.init_window(tc.prune_window)
    trainable = trainable_params(model, tc.freeze_base)
    set_trainable_params(model, trainable)
    if model_cfg.adapter:  # parameter-efficient: the base stays frozen
        log.info("training %d tensors (adapters, LayerNorms%s)", len(trainable), ", pruning" if model_cfg.prune else "")
    model = model.to(run.dev)
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay, tc.scalar_lr_mult), lr=tc.lr,
                            betas=(tc.beta1, tc.beta2), fused=run.dev.type == "cuda")
    return model, opt, trainable, calibration


def _restore(run: _Run, model: DecoderLM, opt: torch.optim.Optimizer, trainable: dict[str, torch.nn.Parameter],
             overwrite: bool) -> tuple[_Counters, set[int]]:
    """The output directory made ready: a replaced run's files removed (overwrite), an unfinished run's state
    loaded into model and opt, its curve and snapshots cut back to that state. Returns where the run stands and
    the steps that take a snapshot."""
    tc, out, main_proc = run.tc, run.out, run.main_proc
    out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = run.state_path, run.log_path
    snapshot_at = set(snapshots.snapshot_steps(tc.steps, tc.alpha_steps, tc.snapshots))
    if snapshot_at:   # (before anything is deleted: a refusal loses nothing)
        snapshots.check_size(trainable, len(snapshot_at))
    if overwrite and main_proc:  # start over: nothing of the replaced model or run is kept
        for name in (STATE, *MODEL_FILES):
            (out / name).unlink(missing_ok=True)
    counts = _Counters()
    if state_path.exists():
        meta = load_state(state_path, model, opt)
        if meta["config_hash"] != config_hash(run.raw):
            raise ConfigError(f"{state_path} was written by a different config; delete it to start over")
        counts = _Counters(meta["step"], meta["tokens_seen"], meta["elapsed_s"])
        if main_proc:
            log.info("resuming %s from step %d", out, counts.step)
    start = counts.step
    if main_proc:  # the curve and the snapshots keep exactly the steps the state has seen
        lines = log_path.read_text().splitlines() if log_path.exists() and start else []
        log_path.write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= start))
        snapshots.clear(out, after=start if start else -1)   # (another run's, or past the state: written again)
    return counts, snapshot_at


def _trainer(run: _Run, model: DecoderLM, opt: torch.optim.Optimizer, trainable: dict[str, torch.nn.Parameter],
             calibration: list[float] | None, snapshot_at: set[int], start: int) -> _Trainer:
    """What the steps call around the model: the compiled or distributed forward, train.cuda_graph's graphs for
    the steps from `start`, the autocast, and the validation batches' offsets."""
    model_cfg, tc, dev, world = run.model_cfg, run.tc, run.dev, run.world
    n_pairs = pair_count(model_cfg.n_layers, model_cfg.context)
    fwd = model
    if tc.compile and dev.type == "cuda":
        fwd = torch.compile(model)
    graphed = graphed_loss(model, tc, dev, world, start) if tc.cuda_graph else None
    if world > 1:  # MHE-ADD's e^K gets no gradient by construction (docs/methods.md), hence unused parameters
        fwd = torch.nn.parallel.DistributedDataParallel(fwd, find_unused_parameters=model_cfg.mixer == "mhe-add")
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    ctx = model_cfg.context
    valid_offsets = np.linspace(0, run.valid_tokens.size - ctx - 2, tc.eval_batches * tc.batch_size).astype(np.int64)
    return _Trainer(model, opt, trainable, calibration, snapshot_at, n_pairs, fwd, graphed, autocast, valid_offsets)


@torch.no_grad()
def _valid_loss(run: _Run, t: _Trainer) -> float:
    model, tc = t.model, run.tc
    model.eval()
    losses = []
    for i in range(0, len(t.valid_offsets), tc.batch_size):
        x, y = get_batch(run.valid_tokens, t.valid_offsets[i:i + tc.batch_size], run.model_cfg.context, run.dev)
        with t.autocast:
            losses.append(float(model(x, targets=y).loss))
    model.train()
    return float(np.mean(losses))


@torch.no_grad()
def _valid_sparsity(run: _Run, t: _Trainer) -> float:
    """Sparsity at inference (step function) on the first valid batch as the reports and pages average it: per
    query the share of its earlier tokens dropped, mean over queries 1..T-1, rows and layers."""
    model = t.model
    model.eval()
    x, _ = get_batch(run.valid_tokens, t.valid_offsets[:run.tc.batch_size], run.model_cfg.context, run.dev)
    keeps = [d.keep for d in model(x, diagnostics=True, attention_maps=False).diagnostics]
    model.train()
    return float(torch.stack([mean_sparsity(k.float(), count_first=False).mean() for k in keeps]).mean())


def _checkpoint(run: _Run, t: _Trainer, counts: _Counters) -> None:
    save_state(run.state_path, t.model, t.opt, counts.step, {"config_hash": config_hash(run.raw),
                                                             "tokens_seen": counts.tokens_seen,
                                                             "elapsed_s": counts.elapsed})


def _snapshot(run: _Run, t: _Trainer, counts: _Counters) -> None:
    """The trained tensors at this step (before its update), once: a resumed run keeps what it wrote."""
    tc, step = run.tc, counts.step
    if run.main_proc and step in t.snapshot_at and not snapshots.path_of(run.out, step).exists():
        alpha = (alpha_schedule(step, tc.alpha_steps or tc.steps, tc.alpha_start, tc.alpha_end)
                 if run.model_cfg.prune else None)
        snapshots.save(run.out, t.trainable, step, {"alpha": alpha, "tokens_seen": counts.tokens_seen,
                                                    "config_hash": config_hash(run.raw)})


def _record(run: _Run, entry: dict) -> None:
    if run.main_proc:
        with run.log_path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


def _step_loop(run: _Run, t: _Trainer, counts: _Counters, stop_after: int | None,
               progress: bool) -> tuple[str, list[float], str | None]:
    """The steps from counts.step on (counts moves with them), each logged, evaluated and checkpointed at its
    interval, until the last, a divergence, a signal or stop_after. Returns the status, the last log_interval
    losses and why the run stopped early (None: it did not)."""
    tc, model_cfg, main_proc = run.tc, run.model_cfg, run.main_proc
    start = counts.step
    stop = StopFlag()
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if run.world == 1 else {}

    t.model.train()
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {model_cfg.mixer}", disable=not (progress and main_proc),
               file=sys.stderr, dynamic_ncols=True)
    recent: list[float] = []
    status = "ok"
    t_last, tok_last = time.perf_counter(), counts.tokens_seen
    try:
        while counts.step < tc.steps:
            if stop_after is not None and counts.step - start >= stop_after:
                stop.reason = f"stop_after={stop_after}"
            if stop.reason:
                break
            _snapshot(run, t, counts)
            t0 = time.perf_counter()
            lr = lr_at(counts.step, tc)
            loss_value, mass, kl_value = _train_step(run, t, counts.step, lr)
            counts.step += 1
            counts.tokens_seen += tc.batch_size * model_cfg.context
            counts.elapsed += time.perf_counter() - t0
            step = counts.step
            recent = (recent + [loss_value])[-tc.log_interval:]
            if not math.isfinite(loss_value):
                status = f"diverged: loss {loss_value} at step {step}"
                _record(run, {"step": step, "kind": "train", "loss": loss_value, "lr": lr})
                break
            if step % tc.log_interval == 0 or step == tc.steps:
                now = time.perf_counter()
                rate = (counts.tokens_seen - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, counts.tokens_seen
                entry = {"step": step, "kind": "train", "loss": loss_value, "lr": lr, "tokens": counts.tokens_seen,
                         "tokens_per_s": rate, "elapsed_s": counts.elapsed}
                if tc.distill:
                    entry["kl"] = kl_value
                if model_cfg.prune:
                    entry |= {"alpha": t.model.blocks[0].mixer.pruning.alpha,
                              "kept_fraction_soft": float(mass.detach()) * 2 / t.n_pairs}
                _record(run, entry)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:.0f}")
            if step % tc.eval_interval == 0 or step == tc.steps:
                entry = {"step": step, "kind": "valid", "loss": _valid_loss(run, t), "tokens": counts.tokens_seen}
                if model_cfg.prune:
                    # (older logs hold "sparsity", a pair share)
                    entry["query_sparsity"] = _valid_sparsity(run, t)
                _record(run, entry)
            if main_proc and step % tc.checkpoint_interval == 0 and step < tc.steps:
                _checkpoint(run, t, counts)
            bar.update(1)
    finally:
        bar.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return status, recent, stop.reason


def _imitation_cache(run: _Run, model: DecoderLM, progress: bool) -> imitation.Cache:
    """train.imitate's cache of the dense model's layer inputs and targets on imitate_windows training windows
    (drawn by the seed), built where missing (every process reads it; the main one writes it)."""
    tc, ctx = run.tc, run.model_cfg.context
    path = Path(tc.imitate_cache) if tc.imitate_cache else run.out / "imitation_cache"
    starts = np.random.default_rng([tc.seed, 7]).choice(run.train_tokens.size - ctx, tc.imitate_windows,
                                                        replace=False)
    windows = np.stack([run.train_tokens[s:s + ctx] for s in np.sort(starts)]).astype(np.int64)
    if run.main_proc:
        with torch.no_grad(), rule_off(model):
            was = model.training
            model.eval()
            imitation.build_cache(model, windows, path, tc.imitate, float(tc.imitate_sparsity),
                                  file_sha256(Path(tc.init_from) / "model.safetensors"), progress)
            model.train(was)
    if run.world > 1:
        torch.distributed.barrier()
    return imitation.Cache(path, tc.imitate_windows)


def _imitation_step(run: _Run, t: _Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """train.imitate's loss on the cached windows of `step` (this process's share) and the rule's mass."""
    tc = run.tc
    chosen = imitation.order(tc.imitate_windows, step, tc.batch_size, tc.seed)[run.rank::run.world]
    x, until = t.imitation.batch(chosen, run.dev)
    return imitation.imitation_loss([b.mixer.pruning for b in t.model.blocks], x, until)


def _train_step(run: _Run, t: _Trainer, step: int, lr: float) -> tuple[float, torch.Tensor | None, float | None]:
    """One optimizer step on the batch of `step` at learning rate lr. Returns the LM loss (the global batch's), the
    pruning mass (None without pruning) and the distillation KL (None without train.distill)."""
    tc, dev, ctx, pruning, model = run.tc, run.dev, run.model_cfg.context, run.model_cfg.prune, t.model
    kl_value = None
    for g in t.opt.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)
    offsets = batch_offsets(tc.seed, step, run.train_tokens.size, ctx, tc.batch_size)[run.rank::run.world]
    x, y = get_batch(run.train_tokens, offsets, ctx, dev)
    if pruning:
        if dev.type == "cuda":  # the next steps' alpha-sigmoid tables in one batched build
            prefetch_schedule(step, tc.alpha_steps or tc.steps, tc.alpha_start, tc.alpha_end, dev)
        model.set_alpha(alpha_schedule(step, tc.alpha_steps or tc.steps, tc.alpha_start, tc.alpha_end))
    if t.imitation is not None:  # the logged loss is then the imitation loss
        lm_loss, mass = _imitation_step(run, t, step)
        loss = lm_loss
    elif t.graphed is not None:  # (autocast inside the capture, with its weight cache off; no distill)
        lm_loss, mass = t.graphed(x, y)
        loss = lm_loss if not pruning else lm_loss + sparsity_loss(mass, tc.gamma, t.n_pairs)
    else:
        with t.autocast:
            res = t.fwd(x, targets=y)
            lm_loss, mass = res.loss, res.prune_mass
            loss = lm_loss
            if tc.distill:  # the target: the same model with its whole context
                with torch.no_grad(), rule_off(model):
                    teacher = t.fwd(x).logits
                loss = distill_loss(res.logits, teacher)
                kl_value = float(loss.detach())
            del res  # (its logits hold the step's graph too)
            if pruning:  # L = L_lm + gamma / (L_layers n (n-1)) sum_layers sum_{j<k} I_{k,j}
                loss = loss + sparsity_loss(mass, tc.gamma, t.n_pairs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    t.opt.step()
    t.opt.zero_grad(set_to_none=True)
    # the logged loss is the LM loss alone (the sparsity term is logged apart). Nothing holds the step's
    # autograd graph past here: under train.cuda_graph a form's capture can follow an eager step, and the
    # parameters' AccumulateGrad nodes that graph kept alive are tied to the default stream, which cannot
    # join a capture (a backward capture on an H200 failed so; pytorch/pytorch#64339)
    loss, mass = lm_loss.detach(), None if mass is None else mass.detach()
    del lm_loss
    if run.world > 1:  # log the global batch's loss, not this process's share
        torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
    return float(loss), mass, kl_value


def _conclude(run: _Run, t: _Trainer, counts: _Counters, status: str, recent: list[float]) -> dict:
    """A run that ended (finished or diverged): its last snapshot, and on the main process the test evaluation and
    the model directory, the training state removed; then the processes' group closed. Returns the card."""
    if status == "ok":
        _snapshot(run, t, counts)   # (the last step's, when it is one)
    card = {}
    if run.main_proc:
        pruned_ok = run.model_cfg.prune and status == "ok"
        extra = {"final_valid_query_sparsity": _valid_sparsity(run, t)} if pruned_ok else {}
        if t.calibration is not None:
            extra["prune_calibration_rms"] = t.calibration
        if t.imitation is not None:  # what the rule was fitted to: tokens_seen counts every pass over the cache
            extra["imitation"] = t.imitation.meta | {"windows": t.imitation.windows,
                                                     "distinct_tokens": t.imitation.windows * run.model_cfg.context}
        if t.graphed is not None:  # which forms of the step this run (since its last resume) replayed from graphs
            extra["cuda_graph"] = {"captured": sorted(t.graphed.graphs), "failed": t.graphed.failed}
        card = finish(t.model, run.tokenizer, run.out, run.model_cfg, run.tc, run.raw, counts.step, counts.tokens_seen,
                      counts.elapsed, recent, status, run.dev, _valid_loss(run, t) if status == "ok" else float("nan"),
                      extra)
        run.state_path.unlink(missing_ok=True)
    if run.world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return card


def finish(model, tokenizer, out, model_cfg, tc, raw, step, tokens_seen, elapsed, recent, status, dev, v_loss,
           extra: dict) -> dict:
    test = {"perplexity": float("nan"), "tokens": 0}
    if status == "ok":
        docs = encode_documents(tokenizer, load_documents(tc.data, "test"))
        test = score_documents(model.float(), docs, tc.eval_stride)
    data = Path(tc.data)
    card = {
        "status": status, "config": model_cfg.to_dict(), "train": dataclasses.asdict(tc),
        "config_hash": config_hash(raw),
        "data": {"dir": str(tc.data), "manifest_sha256": manifest_sha256(data),
                 "test_sha256": file_sha256(data / "test.txt")},
        "steps": step, "tokens_seen": tokens_seen, "wall_time_s": elapsed,
        "train_tokens_per_s": tokens_seen / elapsed if elapsed else None,
        "device": describe(dev), "torch": torch.__version__, "seed": tc.seed,
        "final_train_loss": float(np.mean(recent)) if recent else None, "final_valid_loss": v_loss,
        "test_perplexity": test["perplexity"], "test_tokens": test["tokens"], "eval_stride": tc.eval_stride,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": count_trainable(model, tc.freeze_base)["total"],
    } | extra
    save_model_dir(out, model.cpu(), tokenizer, card)
    return card


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.train")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="model directory to write (and resume in)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--overwrite", action="store_true", help="replace a finished model in --out (default: refuse)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        card = train(args.config, args.out, args.device, overwrite=args.overwrite)
    except (ConfigError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if card.get("status") == "interrupted":
        return 130
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{args.out}: {card['status']}, test perplexity {card['test_perplexity']:.3f}, "
              f"{card['train_tokens_per_s']:.0f} tokens/s", file=sys.stderr)
    return 0 if card.get("status", "ok") == "ok" else 3


if __name__ == "__main__":
    raise SystemExit(main())
