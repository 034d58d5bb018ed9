"""Packed projections for fixed-shape decode steps (models.decode.Decoder with fixed or graphs).

At batch 1 a step replayed from a CUDA graph costs about its kernel count (models.graphs). q, k and v are three
products of one input, and SwiGLU's gate and up two more; with their weights side by side each group is one
product (gpt-fast's wqkv and w1/w3 packing): two kernels a layer fewer for attention, one for the feed-forward.

The packed copies are not put on the model, which app sessions share and whose state dict stays as it is: they
are kept here per model and handed to a fixed-shape decode state's layers (`layer.packed`). A decoder's start
refills them in place from the weights as they are then: a state that already holds copies (a pooled entry of
models.graphs, whose captured graph reads them) keeps their addresses, and a model trained between two
generations decodes with its new weights (a state whose copies no longer fit the model is refused). They are
read when a decoder starts: a weight changed while a decoder runs is not seen by its q, k, v, gate and up
products until a decoder of the model starts (it refills the set fresh decoders share). They cost memory: one more
copy of the packed weights (for SmolLM2-135M 69.7 M parameters, 139 MB in bf16), for as long as the model lives
(`size` says how much; the app counts it for a model on a GPU).
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
    there are two or more and `project` is the generic one that applies just them (a variant with a `project` of
    its own is left alone); "gate_up", SwiGLU's (weight [d_ff,d_m], bias) pairs."""
    out = {}
    proj = block.mixer.packable_projections()
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


def _parts(name: str, pairs) -> tuple[list[torch.Tensor], int, tuple | None, list[torch.Tensor] | None]:
    """(weights to concatenate, along which dim, the q/k/v heads' shapes, biases) of one packed product."""
    if name == "qkv":  # x @ [W_Q | W_K | W_V], each flattened to [d_m, n d_h]
        return ([w.flatten(1) for w, _ in pairs], 1, tuple(tuple(w.shape[1:]) for w, _ in pairs),
                _biases(pairs, lambda w: w.flatten(1)))
    return [w for w, _ in pairs], 0, None, _biases(pairs, lambda w: w.t())  # F.linear(x, [gate; up])


def _fits(into: torch.Tensor | None, parts: list[torch.Tensor], dim: int) -> bool:
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return into is not None and (list(into.shape) == shape and into.dtype == parts[0].dtype
                                 and into.device == parts[0].device)


def _fill(layer: dict | None, src: dict[str, tuple], own: bool = False) -> dict:
    """The packed weights of one block, written into `layer`'s tensors where they fit (never resized: a captured
    graph holds their addresses), else new ones. own: `layer` is a decode state's own set, which a captured graph
    may read: every tensor must fit, else a ValueError."""
    out = {}
    for name, pairs in src.items():
        parts, dim, shapes, bias = _parts(name, pairs)
        w_old, b_old, _ = (layer or {}).get(name, (None, None, None))
        fit_w, fit_b = _fits(w_old, parts, dim), bias is None or _fits(b_old, bias, 0)
        if own and not (fit_w and fit_b and set(layer) == set(src)):
            raise ValueError("this decode state's packed copies no longer fit the model (its projections changed): "
                             "give the state back and start a new decoder")
        w = torch.cat(parts, dim, out=w_old) if fit_w else torch.cat(parts, dim)
        b = None if bias is None else (torch.cat(bias, out=b_old) if fit_b else torch.cat(bias))
        out[name] = (w, b, shapes)
    return out


def where(model) -> tuple:
    """Where every weight lives and its dtype: packed copies belong to those tensors (models.graphs keys its
    captured steps by it too)."""
    return tuple(p.data_ptr() for p in model.parameters()), model.wte.weight.dtype


def attach(model, state) -> None:
    """Give each layer of a fixed-shape decode state (`state.layers`) the packed weights of its block, refilled
    from the model's weights now: into the state's own copies when it has them (a pooled entry's graph reads
    those), else into the model's kept ones (new ones when its weights moved)."""
    key = where(model)
    with _lock, torch.inference_mode(False), torch.no_grad():  # plain tensors, as the caches are (models.graphs)
        old = [getattr(layer, "packed", None) for layer in state.layers]
        own = all(p is not None for p in old)
        if not own:
            kept = _kept.get(model)
            old = kept[1] if kept is not None and kept[0] == key else [None] * len(model.blocks)
        layers = [_fill(old[i], sources(block), own) for i, block in enumerate(model.blocks)]
        _kept[model] = (key, layers)
    for layer, packed in zip(state.layers, layers):
        layer.packed = packed


def size(model) -> int:
    """Bytes one set of the model's packed copies takes."""
    return sum(w.numel() * w.element_size() + (0 if b is None else b.numel() * b.element_size())
               for block in model.blocks for pairs in sources(block).values() for w, b in pairs)


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
