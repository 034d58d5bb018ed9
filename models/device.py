"""Where models run: one answer for every CLI, the app and the benchmarks.

`--device auto` means the first CUDA device when there is one, else the CPU. On CUDA, inference runs in
bfloat16 (the Triton kernels' tensor-core path) unless the caller asks for float32 or the GPU has no bf16;
on the CPU it stays float32 (the reference path, and the numbers the zoo's cards were measured with).
"""
from __future__ import annotations

import argparse

import torch

CHOICES = ("auto", "cpu", "cuda")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(ValueError):
    pass


def resolve(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' (or a torch.device) -> a device that exists here."""
    if isinstance(device, torch.device):
        device = str(device)
    device = (device or "auto").strip().lower()
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
                              "use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise DeviceError(f"device type {dev.type!r} is not supported: use auto, cpu, cuda or cuda:N")
    return dev


def inference_dtype(device: torch.device, dtype: str | torch.dtype | None = "auto") -> torch.dtype:
    """The dtype a model is loaded in for inference on `device` ('auto': bf16 on a CUDA GPU that has it)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if DTYPES[dtype or "auto"] is not None:
        return DTYPES[dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def describe(device: torch.device) -> str:
    """A human name for the device: the GPU's name, or the CPU with its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def add_arguments(ap: argparse.ArgumentParser, dtype: str | None = "auto") -> None:
    """--device, and --dtype with this default unless None, for a CLI that runs a model. Commands that
    measure perplexity default to float32 (comparable with the cards); generation to auto."""
    ap.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    if dtype is not None:
        ap.add_argument("--dtype", default=dtype, choices=list(DTYPES),
                        help=f"model dtype (default {dtype}; auto: bfloat16 on a GPU, float32 on the CPU)")
