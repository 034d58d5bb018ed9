"""One dataclass describes a model; it round-trips through JSON (config.json).

A config read from a model directory is untrusted (a browser user may add one on a shared server): every field is
checked by type and range before anything uses it (ModelConfig.validate: a string where a number belongs, a bool
where an int belongs, NaN, a value past LIMITS), and one read from JSON must also fit the memory budget
(ModelConfig.check_size: the parameters it builds, counted without building the model, in float32 within
MIXSCOPE_MEMORY_MB, and in bfloat16 at least within a weights cap when one is given). Each refusal is a ConfigError
naming the field (and, read from a file, the file).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kernels import settings
from models.adapters import KINDS
from models.errors import ConfigError
from models.files import parse_json, read_bounded
from models.mixers import MIXERS

__all__ = ["ConfigError", "LIMITS", "MAX_CONFIG_BYTES", "ModelConfig"]

# The largest value each whole-number field takes (and every one is >= 1, prune_sinks >= 0). Generous for the models
# this app opens (SmolLM2: 30 layers, d_model 576, vocabulary 49,152; the largest open decoders have ~126 layers,
# d_model 16,384, d_ff 53,248, vocabularies of 256 k), and small enough that what loops over layers or heads before a
# model is built (a listing, a page's plan) stays cheap; the memory budget bounds the product of them (check_size).
LIMITS = {"vocab_size": 2**20, "context": 2**20, "d_model": 2**16, "n_layers": 128, "n_heads": 256, "d_head": 2**12,
          "d_ff": 2**18, "n_kv_heads": 256, "prune_r": 2**12, "pattern_k": 2**20, "prune_sinks": 2**20,
          "adapter_reduction": 2**16, "phm_n": 64, "phm_rank": 64}
# float fields: (lowest, highest, whether the lowest itself is allowed); all must be finite
FLOATS = {"dropout": (0.0, 1.0, True), "ln_eps": (0.0, 1.0, False), "init_std": (0.0, 10.0, True),
          "extractor_init_std": (0.0, 10.0, True), "head_embed_std": (0.0, 10.0, True),
          "prune_beta": (-1e4, 1e4, True), "rope_theta": (0.0, 1e12, False)}
BOOLS = ("extractor_out", "prune", "prune_distance", "ffn_bias", "attn_bias", "tie_embeddings")
CHOICES = {"norm": ("layernorm", "rmsnorm"), "positions": ("learned", "rope"), "ffn": ("gelu", "gelu_tanh", "swiglu"),
           "pattern": ("dense", "local", "strided")}
OPTIONAL = ("d_head", "d_ff", "n_kv_heads")   # whole numbers that may be null (derived, or the mixer's default)
MAX_CONFIG_BYTES = 64 * 2**10   # a config.json is ~1 KB; a larger one is refused unread


def _show(value) -> str:
    """A value as a message quotes it: short (a hostile config may hold a megabyte string or a 4,000-digit int)."""
    try:
        text = repr(value)
    except ValueError:   # an int past Python's digit limit for str()
        return "a number too large to print"
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class ModelConfig:
    # --- the papers' settings -------------------------------------------------------------------
    mixer: str = "mha"          # registry name, see models.mixers.MIXERS (docs/methods.md)
    vocab_size: int = 8192
    context: int = 256          # l: max positions, and the Extractors' number of lag weights
    d_model: int = 128          # d_m
    n_layers: int = 4
    n_heads: int = 8            # n
    d_head: int | None = None   # d_h; default d_model // n_heads
    d_ff: int | None = None     # feed-forward width; default 4 * d_model
    dropout: float = 0.0
    ln_eps: float = 1e-5
    init_std: float = 0.02      # embeddings, feed-forward, attention projections (GPT-2)
    extractor_init_std: float = 0.01  # Extractor paper: all weights N(0, 0.01)
    head_embed_std: float = 0.02      # MHE head embeddings: small random, heads must differ
    extractor_out: bool = True  # the Extractors' optional output projection W^out
    # context pruning, docs/methods.md#adaptively-sparse-attention (softmax mixers only)
    prune: bool = False         # adaptively sparse attention
    prune_r: int = 64           # width r of the interaction projections W^Qint, W^Kint
    prune_beta: float = 2.0     # initial beta: positive, so nothing is dropped at first
    # deviations from the paper's rule, off by default (models/pruning/interaction.py says why):
    prune_distance: bool = False  # add -lambda^l log(n - j) to x_{n,j} (a learned scalar per layer, starts at 0)
    prune_sinks: int = 0        # the first S positions of a text are never dropped (attention sinks)
    pattern: str = "dense"      # fixed sparse baselines: "local" (window of pattern_k) or "strided" (Child et al.)
    pattern_k: int = 64
    # adapters, docs/methods.md#adapters-and-compacter
    adapter: str | None = None  # None | adapter | phm | compacter | compacter++
    adapter_reduction: int = 32  # bottleneck d = d_model / reduction
    phm_n: int = 4              # n of the PHM layers (A_i are n x n)
    phm_rank: int = 1           # r of COMPACTER's LPHM factors

    # --- architecture options for imported models (GPT-2, Llama); the defaults are the zoo's decoder ---
    n_kv_heads: int | None = None  # gqa: key/value heads (default n_heads // 2)
    norm: str = "layernorm"     # layernorm | rmsnorm
    positions: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    ffn: str = "gelu"           # gelu | gelu_tanh | swiglu
    ffn_bias: bool = True
    attn_bias: bool = False     # biases on W_Q, W_K, W_V, W_O (GPT-2; mha and gqa only)
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        self._check_types()   # (before any arithmetic: "AAAA" * 200_000_000 is a 800 MB string, not an error)
        if self.d_head is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                  "set d_head explicitly")
            self.d_head = self.d_model // self.n_heads
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        self.validate()

    def _check_types(self) -> None:
        """Every field's type, and each whole number's range (LIMITS), each float's (FLOATS): what arithmetic on
        the fields needs first. d_head, d_ff and n_kv_heads may still be None here."""
        if not isinstance(self.mixer, str) or self.mixer not in MIXERS:
            raise ConfigError(f"unknown mixer {_show(self.mixer)}; choose one of: {', '.join(MIXERS)}")
        for name, most in LIMITS.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            least = 0 if name == "prune_sinks" else 1
            if not isinstance(value, int) or isinstance(value, bool):
                kind = "a whole number >= 0" if least == 0 else "a positive integer"
                raise ConfigError(f"{name} must be {kind}" + (" or null" if name in OPTIONAL else "")
                                  + f", got {_show(value)}")
            if value < least:
                raise ConfigError(f"{name} must be " + ("a whole number >= 0" if least == 0 else "a positive integer")
                                  + f", got {_show(value)}")
            if value > most:
                raise ConfigError(f"{name} must be at most {most:,}, got {_show(value)}")
        for name, (low, high, closed) in FLOATS.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"{name} must be a number, got {_show(value)}")
            value = float(value)
            if not math.isfinite(value) or value > high or value < low or (value == low and not closed):
                interval = f"{'[' if closed else '('}{low:g}, {high:g}" + (")" if name == "dropout" else "]")
                raise ConfigError(f"{name} must be in {interval}, got {_show(value)}")
            setattr(self, name, value)
        for name in BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {_show(getattr(self, name))}")
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {_show(value)}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or self.adapter not in KINDS):
            raise ConfigError(f"adapter must be one of {', '.join(KINDS)} or null, got {_show(self.adapter)}")

    def validate(self) -> None:
        self._check_types()
        if self.n_kv_heads is not None and self.n_kv_heads > self.n_heads:
            raise ConfigError(f"n_kv_heads must be at most n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.positions == "rope" and self.d_head % 2:
            raise ConfigError(f"rotary positions need an even d_head, got {self.d_head}")
        if self.pattern != "dense" and self.prune:
            raise ConfigError("a fixed sparse pattern and context pruning are alternatives; choose one")
        if self.adapter is not None:
            d = self.d_model // self.adapter_reduction if self.adapter_reduction > 0 else 0
            if d < 1:
                raise ConfigError("adapter bottleneck d_model/adapter_reduction = "
                                  f"{self.d_model}/{self.adapter_reduction} is below 1")
            if self.adapter != "adapter" and (self.d_model % self.phm_n or d % self.phm_n):
                raise ConfigError(f"phm_n={self.phm_n} must divide d_model={self.d_model} and the bottleneck {d}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        MIXERS[self.mixer].check_config(self)

    # --- size: what the config builds, before anything is built ---------------------------------------
    def param_count(self) -> int:
        """The parameters DecoderLM(self) holds, counted without building it (_param_count): the same cost at any
        n_layers, nothing allocated."""
        return _param_count(tuple(sorted(self.to_dict().items())))

    def check_size(self, weights_cap: int | None = None, budget: int | None = None) -> None:
        """Refuse (ConfigError naming the field that weighs most) a config whose parameters in float32 pass the
        memory budget (default: MIXSCOPE_MEMORY_MB, as models.memory.memory_budget reads it), or, given weights_cap
        (bytes: a server's MIXSCOPE_MAX_WEIGHTS_MB), whose weights pass it even stored in bfloat16 (2 bytes a
        parameter, the smallest storage type a model directory holds)."""
        try:
            params, per_layer, positions = _param_count(tuple(sorted(self.to_dict().items())), parts=True)
        except Exception as e:  # noqa: BLE001 - fields in range that still cannot build a model (a mixer's own rule)
            raise ConfigError(f"these fields do not describe a model that can be built ({type(e).__name__})") from None
        budget = _memory_budget() if budget is None else budget
        embeddings = params - per_layer * self.n_layers - positions   # (and the final norm, the shared A_i)
        weighs = max((per_layer * self.n_layers, "n_layers", self.n_layers),
                     (embeddings, "vocab_size", self.vocab_size), (positions, "context", self.context))
        others = ", ".join(f"{k}={getattr(self, k):,}" for k in ("d_model", "n_layers", "vocab_size", "context")
                           if k != weighs[1])
        what = f"{weighs[1]}={weighs[2]:,} (with {others}) builds {params:,} parameters"
        if 4 * params > budget:
            raise ConfigError(f"{what}: {4 * params / 2**30:,.1f} GB in float32, over the {budget / 2**30:,.1f} GB "
                              "memory budget (MIXSCOPE_MEMORY_MB)")
        if weights_cap is not None and 2 * params > weights_cap:
            raise ConfigError(f"{what}: at least {2 * params / 2**20:,.1f} MiB of weights even in bfloat16; this "
                              f"server opens weights files of at most {weights_cap / 2**20:,.1f} MiB "
                              "(MIXSCOPE_MAX_WEIGHTS_MB)")

    # --- JSON round trip -------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, weights_cap: int | None = None) -> "ModelConfig":
        """A config from a JSON object (config.json, a card's config, a training config's model section): every
        field checked (validate), and its size (check_size) against the memory budget and weights_cap."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(_show(k) for k in set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        cfg = cls(**data)
        cfg.check_size(weights_cap)
        return cfg

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, weights_cap: int | None = None) -> "ModelConfig":
        return cls.from_dict(parse_json(text, ConfigError), weights_cap)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, weights_cap: int | None = None) -> "ModelConfig":
        """A config.json (at most MAX_CONFIG_BYTES, a regular file), checked as from_dict checks it; a refusal names
        the file and the field."""
        path = Path(path)
        try:
            return cls.from_json(read_bounded(path, MAX_CONFIG_BYTES, ConfigError), weights_cap)
        except (ConfigError, TypeError) as e:
            message = str(e)
            raise ConfigError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def _memory_budget() -> int:
    """models.memory.memory_budget()'s bytes (MIXSCOPE_MEMORY_MB), read here from the setting itself: models.memory
    plans with models.transformer, which imports this module (tests/test_hostile_models.py checks they agree)."""
    return int(settings.get("MIXSCOPE_MEMORY_MB") * 2 ** 20)


@functools.lru_cache(maxsize=256)
def _param_count(items: tuple, parts: bool = False):
    """ModelConfig.param_count of the config with these fields; parts: (total, per layer, learned positions).
    In closed form for what models.transformer builds around the mixer (embeddings, feed-forward, norms), the mixer
    and the adapters built once on the meta device (nothing allocated): the same cost at any n_layers.
    tests/test_hostile_models.py checks it against DecoderLM's own count."""
    import torch

    from models.adapters import Adapter, new_A
    cfg = ModelConfig(**dict(items))
    d, ff = cfg.d_model, cfg.d_ff
    with torch.device("meta"):
        mixer = sum(p.numel() for p in MIXERS[cfg.mixer](cfg).parameters())   # (context pruning's included)
        adapters = shared = 0
        if cfg.adapter:
            a = new_A(cfg.phm_n) if cfg.adapter in ("compacter", "compacter++") else None   # one for the model
            one = Adapter(d, d // cfg.adapter_reduction, cfg.adapter, cfg.phm_n, cfg.phm_rank, a)
            per_adapter = sum(p.numel() for p in one.parameters() if p is not a)
            adapters = per_adapter * (1 if cfg.adapter == "compacter++" else 2)   # (COMPACTER++: feed-forward only)
            shared = 0 if a is None else a.numel()
    gated = cfg.ffn == "swiglu"
    ffn = d * ff * (3 if gated else 2) + ((ff * (2 if gated else 1) + d) if cfg.ffn_bias else 0)
    norm = d * (2 if cfg.norm == "layernorm" else 1)
    per_layer = mixer + ffn + 2 * norm + adapters
    positions = cfg.context * d if cfg.positions == "learned" else 0
    total = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + positions + norm + shared + cfg.n_layers * per_layer
    return (total, per_layer, positions) if parts else total
