"""One dataclass describes a model; it round-trips through JSON (config.json)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from models.adapters import KINDS
from models.errors import ConfigError
from models.mixers import MIXERS

__all__ = ["ConfigError", "ModelConfig"]


@dataclass
class ModelConfig:
    # --- the papers' settings -------------------------------------------------------------------
    mixer: str = "mha"          # registry name, see models.mixers.MIXERS (papers.md sections 1-2)
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
    # context pruning, papers.md section 3 (softmax mixers only)
    prune: bool = False         # adaptively sparse attention
    prune_r: int = 64           # width r of the interaction projections W^Qint, W^Kint
    prune_beta: float = 2.0     # initial beta: positive, so nothing is dropped at first
    # deviations from the paper's rule, off by default (models/pruning/interaction.py says why):
    prune_distance: bool = False  # add -lambda^l log(n - j) to x_{n,j} (a learned scalar per layer, starts at 0)
    prune_sinks: int = 0        # the first S positions of a text are never dropped (attention sinks)
    pattern: str = "dense"      # fixed sparse baselines: "local" (window of pattern_k) or "strided" (Child et al.)
    pattern_k: int = 64
    # adapters, papers.md section 4
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
        if self.d_head is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                  "set d_head explicitly")
            self.d_head = self.d_model // self.n_heads
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        self.validate()

    def validate(self) -> None:
        if self.mixer not in MIXERS:
            raise ConfigError(f"unknown mixer {self.mixer!r}; choose one of: {', '.join(MIXERS)}")
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "d_head", "d_ff", "prune_r",
                     "pattern_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name, allowed in (("norm", ("layernorm", "rmsnorm")), ("positions", ("learned", "rope")),
                              ("ffn", ("gelu", "gelu_tanh", "swiglu"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.positions == "rope" and self.d_head % 2:
            raise ConfigError(f"rotary positions need an even d_head, got {self.d_head}")
        if self.pattern not in ("dense", "local", "strided"):
            raise ConfigError(f"pattern must be dense, local or strided, got {self.pattern!r}")
        if not isinstance(self.prune_sinks, int) or isinstance(self.prune_sinks, bool) or self.prune_sinks < 0:
            raise ConfigError(f"prune_sinks must be a whole number >= 0, got {self.prune_sinks!r}")
        if self.pattern != "dense" and self.prune:
            raise ConfigError("a fixed sparse pattern and context pruning are alternatives; choose one")
        if self.adapter is not None:
            if self.adapter not in KINDS:
                raise ConfigError(f"adapter must be one of {', '.join(KINDS)} or null, got {self.adapter!r}")
            d = self.d_model // self.adapter_reduction if self.adapter_reduction > 0 else 0
            if d < 1:
                raise ConfigError("adapter bottleneck d_model/adapter_reduction = "
                                  f"{self.d_model}/{self.adapter_reduction} is below 1")
            if self.adapter != "adapter" and (self.d_model % self.phm_n or d % self.phm_n):
                raise ConfigError(f"phm_n={self.phm_n} must divide d_model={self.d_model} and the bottleneck {d}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        MIXERS[self.mixer].check_config(self)

    # --- JSON round trip -------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not valid JSON: {e}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from None
