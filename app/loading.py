"""How the app opens models: where and in what dtype (app_precision), with parameters that take no gradients.

No streamlit here: `make gpu-check` and the benchmarks open models the way the app does without it.
"""
from __future__ import annotations

from pathlib import Path

from kernels import settings
from models.checkpoint import LoadedModel, load_model_dir
from models.device import inference_dtype, resolve


def app_precision() -> dict:
    """Where and in what dtype the app runs models: MIXSCOPE_DEVICE (default auto: CUDA when present) and
    MIXSCOPE_DTYPE (default float32; bfloat16 trades exactness for speed: a bf16 model's whole-text forward and
    its decode round hidden states differently, so the Pruning and Generate pages may then disagree about a
    rare drop). Recorded in every figure's sidecar."""
    dev = resolve(settings.get("MIXSCOPE_DEVICE"))
    # (float32 by default on a GPU too: drop decisions and maps as the CPU computes them)
    dt = inference_dtype(dev, settings.get("MIXSCOPE_DTYPE"))
    return {"device": str(dev), "dtype": str(dt).removeprefix("torch.")}


def load_for_app(path: str | Path, max_weight_bytes: int | None = None, dtype: str | None = None) -> LoadedModel:
    """How the app (and `make gpu-check`, which has no streamlit) opens a model: where and in what dtype
    app_precision says (dtype: override it, e.g. "auto" for bf16 on a GPU, as the GPU benchmarks measure).
    Parameters without gradients: sessions share the model, and attributions take gradients at the embeddings.
    Never fetches (loading never does): a browser request must not run a download (a missing base is refused
    with its command). In serve mode every file read must resolve inside the models folder or a root, and the
    weights (a delta's and its base's together) within max_weight_bytes (default: the server's cap,
    MIXSCOPE_MAX_WEIGHTS_MB): models.checkpoint.load_model_dir checks each where it reads it."""
    where = app_precision()
    loaded = load_model_dir(path, device=where["device"], dtype=dtype or where["dtype"],
                            max_weight_bytes=max_weight_bytes)
    loaded.model.requires_grad_(False)
    return loaded
