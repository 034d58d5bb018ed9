"""Packed projections for fixed-shape decode steps (models.decode.Decoder with fixed or graphs).

At batch 1 a step replayed from a CUDA graph costs about its kernel count (models.graphs). q, k and v are three
products of one input, and SwiGLU's gate and up two more; with their weights side by side each group is one
product (gpt-fast's wqkv and w1/w3 packing): two kernels a layer fewer for attention, one for the feed-forward.

The packed copies are not put on the model, which app sessions share and whose state dict stays as it is: they
are kept here per model and handed to a fixed-shape decode state's layers (`layer.packed`). A decoder's start
refills them in place from the weights as they are then, so a captured graph keeps reading the same addresses
and a weight trained since is read as it is now. They cost memory: one more copy of the packed weights (for
SmolLM2-135M, 70 M parameters), for as long as the model lives.
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

_lock = threading.Lock()
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (where its weights live, [per layer])


def sources(block) -> dict[str, tuple]:
    """What one block packs: "qkv", the mixer's (weight [d_m,n,d_h], bias) pairs (Attention.projections), when
    there are two or more; "gate_up", SwiGLU's (weight [d_ff,d_m], bias) pairs."""
    out = {}
    proj = getattr(block.mixer, "projections", lambda: None)()
    if proj is not None and len(proj) > 1:
        out["qkv"] = proj
    if block.ffn.gate is not None:
        out["gate_up"] = ((block.ffn.gate.weight, block.ffn.gate.bias), (block.ffn.up.weight, block.ffn.up.bias))
    return out


def _biases(pairs, flat) -> list[torch.Tensor] | None:
    if all(b is None for _, b in pairs):
        return None
    return [torch.zeros(flat(w).shape[-1], dtype=w.dtype, device=w.device) if b is None else b.flatten()
            for w, b in pairs]


def _fill(layer: dict | None, src: dict[str, tuple]) -> dict:
    """The packed weights of one block, written into `layer`'s tensors when given (same shapes), else new."""
    out = {}
    for name, pairs in src.items():
        if name == "qkv":  # x @ [W_Q | W_K | W_V], each flattened to [d_m, n d_h]
            parts, dim, shapes = [w.flatten(1) for w, _ in pairs], 1, tuple(tuple(w.shape[1:]) for w, _ in pairs)
            bias = _biases(pairs, lambda w: w.flatten(1))
        else:              # F.linear(x, [gate; up]), nn.Linear's [out, in]
            parts, dim, shapes = [w for w, _ in pairs], 0, None
            bias = _biases(pairs, lambda w: w.t())
        old = None if layer is None else layer[name]
        w = torch.cat(parts, dim, out=old[0]) if old is not None else torch.cat(parts, dim)
        b = None
        if bias is not None:
            b = torch.cat(bias, out=old[1]) if old is not None else torch.cat(bias)
        out[name] = (w, b, shapes)
    return out


def _where(model) -> tuple:
    """Where every weight lives and its dtype: packed copies belong to those tensors (models.graphs keys its
    captured steps the same way)."""
    return tuple(p.data_ptr() for p in model.parameters()), model.wte.weight.dtype


def attach(model, state) -> None:
    """Give each layer of a fixed-shape decode state (`state.layers`) the packed weights of its block, refilled
    from the model's weights now."""
    key = _where(model)
    with _lock, torch.inference_mode(False), torch.no_grad():  # plain tensors, as the caches are (models.graphs)
        kept = _kept.get(model)
        old = kept[1] if kept is not None and kept[0] == key else None
        layers = [_fill(None if old is None else old[i], sources(block)) for i, block in enumerate(model.blocks)]
        _kept[model] = (key, layers)
    for layer, packed in zip(state.layers, layers):
        layer.packed = packed


def release(model) -> None:
    """Drop the model's packed copies (a decode state that holds them keeps them until it goes)."""
    with _lock:
        _kept.pop(model, None)


def step_weights(state, x: torch.Tensor, record) -> dict:
    """The layer's packed weights when this call is a one-token step over a fixed-shape decode state at inference
    (no diagnostics, no gradient: the copies carry none), else {}."""
    packed = getattr(state, "packed", None)
    if not packed or x.shape[1] != 1 or record is not None or torch.is_grad_enabled():
        return {}
    return packed


def project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, shapes) -> list[torch.Tensor]:
    """The packed q/k/v product of x [B,T,d_m], cut into [B,n,T,d_h] views, one per projection."""
    y = (x @ w) if b is None else torch.addmm(b, x.flatten(0, 1), w).view(*x.shape[:2], -1)
    widths = [n * d for n, d in shapes]
    return [p.unflatten(-1, s).transpose(1, 2) for p, s in zip(y.split(widths, -1), shapes)]


def gate_up(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, _shapes=None):
    """SwiGLU's gate and up products of x from one product: two [..., d_ff] views."""
    return F.linear(x, w, b).chunk(2, -1)
