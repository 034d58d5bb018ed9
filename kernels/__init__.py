"""Kernel functions behind one dispatch: Triton for CUDA tensors, the reference otherwise.

`MIXSCOPE_KERNELS=reference|triton` overrides the choice (triton on CPU tensors needs TRITON_INTERPRET=1,
the interpreter the tests use); `MIXSCOPE_KEEP_PASS=1` gives the Triton compacted decode its keep pass;
`MIXSCOPE_CAUSAL_BIAS=0` keeps a pruned training step's attention on plain SDPA (kernels.efficient), `=triton`
gives it our own forward and backward (kernels.triton_causal_bias). The app, `generate` and the benchmarks all call
these functions, so they run the same code. Ops without a Triton kernel (attention weights for the maps, SHE's
matrix lags) and anything else that needs a gradient through attention or the lag sum (those kernels are
inference-only) run the reference on every device; training's keep structure has kernels for both directions
(log_keep, log_keep_grad); `record_paths()` reports what really ran, for the caller's own context only. The three
switches are read through kernels.settings (docs/settings.md), so `settings.override(MIXSCOPE_KERNELS=...)` sets
them for one block of code.
"""
from __future__ import annotations

import math
import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from kernels import efficient, reference, settings

# Which implementation each op took, noted only inside record_paths() and only for that context: a context
# variable, because app sessions run in threads of one process and must never see each other's paths.
_recording: ContextVar[dict[str, str] | None] = ContextVar("mixscope_kernel_paths", default=None)


def _note(op: str, path: str) -> None:
    paths = _recording.get()
    if paths is not None:
        paths[op] = path


@contextmanager
def record_paths():
    """with record_paths() as paths: ... -> paths holds op -> "triton" | "reference" for the calls made inside
    ("efficient" for attention: PyTorch's memory-efficient kernel with its causal mask, kernels.efficient; "triton"
    for a training step's: kernels.triton_causal_bias).
    Nested recorders each see their own calls, and an enclosing one sees its inner ones' too."""
    outer = _recording.get()
    paths: dict[str, str] = {}
    token = _recording.set(paths)
    try:
        yield paths
    finally:
        _recording.reset(token)
        if outer is not None:
            outer.update(paths)


def recorder() -> dict[str, str] | None:
    """The dict record_paths() fills in this context (None outside one), for work begun here that runs in another
    thread: a CUDA backward runs on autograd's device thread, which does not inherit context variables."""
    return _recording.get()


class _Tee(dict):
    """Notes into every recorder it was given (the dicts themselves, not copies)."""

    def __init__(self, targets):
        super().__init__()
        self.targets = targets

    def __setitem__(self, op, path):
        for t in self.targets:
            t[op] = path

    def update(self, other):  # (an inner record_paths() merges into its enclosing one with update)
        for op, path in other.items():
            self[op] = path


@contextmanager
def recording_into(*recorders: dict[str, str] | None):
    """For the calls made inside, note paths into each of `recorders` (None ones left out): recorder() as it was
    where the work began, and as it is here. A recorder whose block has closed takes the note, but an enclosing
    one it was merged into at exit does not see it."""
    targets = list({id(r): r for r in recorders if r is not None}.values())
    token = _recording.set(None if not targets else targets[0] if len(targets) == 1 else _Tee(targets))
    try:
        yield
    finally:
        _recording.reset(token)


def _triton_ops() -> dict[str, object]:
    try:
        from kernels import triton_attention, triton_causal_bias, triton_keep, triton_lag, triton_step  # noqa: F401
        # (attention's two wrappers import triton_attention when called; here it is what fails without triton)
    except ImportError:  # no triton on this machine: everything runs the reference
        return {}
    return {"attention": _triton_attention, "lag_conv": triton_lag.lag_conv, "compact_decode": _triton_compact_decode,
            "causal_bias": triton_causal_bias.attention, "log_keep": triton_keep.log_keep,
            "log_keep_grad": triton_keep.log_keep_grad,
            "step_write": triton_step.step_write, "rule_product": triton_step.rule_product,
            "silu_mul": triton_step.silu_mul, "add_norm": triton_step.add_norm}


def backend_for(op: str, tensor) -> str:
    forced = settings.get("MIXSCOPE_KERNELS")
    if forced == "reference" or op not in TRITON:
        return "reference"
    if forced == "triton":
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("MIXSCOPE_KERNELS=triton needs CUDA tensors (or TRITON_INTERPRET=1, Triton's "
                               "slow CPU interpreter, for tests)")
        return "triton"
    return "triton" if tensor.is_cuda else "reference"


def _run(op: str, tensor, ref, *args, **kwargs):
    path = backend_for(op, tensor)
    _note(op, path)
    return (TRITON[op] if path == "triton" else ref)(*args, **kwargs)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _triton_attention(q, k, v, *, scale, bias=None, causal=True, lengths=None, q_mul=None, q_add=None, o_mul=None,
                      o_add=None, merge_counts=None, bias_is_causal=False):
    # (bias_is_causal changes nothing here: with causal the prefill skips the blocks above the diagonal anyway)
    from kernels import triton_attention
    maps = dict(q_mul=q_mul, q_add=q_add, o_mul=o_mul, o_add=o_add)
    if q.shape[2] == 1:  # one query per sequence: the split-KV decode kernel (it sees the whole cache)
        return triton_attention.decode(q, k, v, scale=scale, bias=bias, lengths=lengths, merge_counts=merge_counts,
                                       **maps)
    return triton_attention.prefill(q, k, v, scale=scale, bias=_with_lengths(bias, lengths, k.shape[2], q.dtype),
                                    causal=causal, **maps)


def _triton_compact_decode(q, k, v, **kw):
    from kernels import triton_attention
    return triton_attention.decode(q, k, v, keep_pass=keep_pass(), **kw)


def _with_lengths(bias, lengths, s: int, dtype):
    """`lengths` [B] (row b reads slots [0, lengths[b])) folded into an additive bias [B,1,1,S]."""
    if lengths is None:
        return bias
    out = torch.zeros(lengths.shape[0], 1, 1, s, dtype=dtype, device=lengths.device)
    out.masked_fill_(torch.arange(s, device=lengths.device) >= lengths[:, None, None, None], float("-inf"))
    return out if bias is None else bias + out


def _reference_attention(q, k, v, *, lengths=None, bias=None, merge_counts=None, causal=True, bias_is_causal=False,
                         **kw):
    # (merge_counts: the Triton decode's workspace, nothing to combine here; a bias that masks the future already
    # needs no causal mask built over it)
    return reference.attention(q, k, v, bias=_with_lengths(bias, lengths, k.shape[2], q.dtype),
                               causal=causal and not (bias_is_causal and bias is not None), **kw)[0]


def _reference_decode(q, k, v, *, merge_counts=None, **kw):
    return reference.decode(q, k, v, **kw)


TRITON: dict[str, object] = _triton_ops()


def attention(q, k, v, *, scale: float, bias=None, need_weights: bool = False, causal: bool = True, lengths=None,
              merge_counts=None, bias_is_causal: bool = False, **maps):
    """(out, probs or None); see kernels.reference.attention. Attention weights come from the reference.
    lengths [B] (device): row b attends over cache slots [0, lengths[b]) only; the decode kernel skips the
    slots after them, so a preallocated cache is read only as far as it is filled (static-shape decode).
    merge_counts: a fixed-shape decode state's workspace, with which the decode kernel combines its splits itself
    (kernels.triton_attention.decode). bias_is_causal: the caller's promise that bias is -inf wherever the causal
    mask masks (a pruned model's log I over a whole sequence), so no path need build the mask over it, and a
    training step on CUDA may take PyTorch's memory-efficient kernel with its own causal mask (kernels.efficient),
    which skips those blocks and leaves the bias's gradient there unwritten."""
    if need_weights:
        _note("attention", "reference")
        return reference.attention(q, k, v, scale=scale, bias=_with_lengths(bias, lengths, k.shape[2], q.dtype),
                                   need_weights=True, causal=causal, **maps)
    if _needs_grad(q, k, v, bias, *maps.values()):
        # Training: the inference kernels have no backward; PyTorch's SDPA (flash / memory-efficient on CUDA, the
        # log I bias included) has a real one, and bench.kernels measures it against FlexAttention. Where the dispatch
        # takes the fast kernels (CUDA, not MIXSCOPE_KERNELS=reference), a bias that masks the future lets it skip
        # the blocks above the diagonal: in our own kernels if asked (MIXSCOPE_CAUSAL_BIAS=triton), else in PyTorch's.
        settings.get("MIXSCOPE_KERNELS")  # (an unknown value refused on every device, as inference's dispatch does)
        whole = bias_is_causal and causal and lengths is None and not any(m is not None for m in maps.values())
        if whole and _causal_bias_triton(q, k, v, bias):
            _note("attention", "triton")
            return TRITON["causal_bias"](q, k, v, bias, scale), None
        if whole and efficient.usable(q, k, v, bias):
            try:
                out = efficient.attention(q, k, v, bias, scale)
                _note("attention", "efficient")
                return out, None
            except RuntimeError as err:  # the operator refused the arguments: SDPA takes the call (a forward that
                if not efficient.refusal(err):  # failed left nothing behind); out of memory or a broken device is
                    raise                       # not a refusal
                efficient.refuse(err)
        _note("attention", "reference")
        return _reference_attention(q, k, v, scale=scale, bias=bias, lengths=lengths, causal=causal,
                                    bias_is_causal=bias_is_causal, **maps), None
    out = _run("attention", q, _reference_attention, q, k, v, scale=scale, bias=bias, causal=causal, lengths=lengths,
               merge_counts=merge_counts, bias_is_causal=bias_is_causal, **maps)
    return out, None


def _causal_bias_triton(q, k, v, bias) -> bool:
    """Whether a training step's attention over a whole sequence with a causal bias takes
    kernels.triton_causal_bias: asked for, the Triton path taken for q (CUDA, or forced in the interpreter), and
    shapes the kernels accept."""
    if efficient.choice() != "triton" or backend_for("causal_bias", q) != "triton":
        return False
    from kernels import triton_causal_bias
    return triton_causal_bias.fits(q, k, v, bias)


def keep_pass() -> bool:
    """`MIXSCOPE_KEEP_PASS=1`: the Triton compacted decode decides keep in a launch of its own first
    (kernels.triton_attention.decode's keep_pass), once a slot, not once per head group. Off by default: on an H200
    it took 35-39 % off a call at batch 64 and added a launch a layer, which a batch-1 step from a graph pays for;
    the switch is there for the end-to-end comparison (bench.decode_zoo times both)."""
    return settings.get("MIXSCOPE_KEEP_PASS")


def compact_decode(q, k, v, *, scale: float, prune: dict, lengths=None, merge_counts=None, **maps):
    """One decode step over the compacted pruning cache: (out, keep). See kernels.reference.decode. lengths [B]
    (fixed shapes): row b reads slots [0, lengths[b]) only, and keeps none after them; merge_counts: see
    attention. On Triton the keep pass runs first under MIXSCOPE_KEEP_PASS=1 (keep_pass)."""
    return _run("compact_decode", q, _reference_decode, q, k, v, scale=scale, prune=prune, lengths=lengths,
                merge_counts=merge_counts, **maps)


def log_keep(x, *, alpha: float, sinks: int = 0, log_dtype=None):
    """Training's keep structure from the scores x [B,T,T]: (log I, I, ratio, mass); see kernels.reference.log_keep.
    Called inside a backward-owning autograd Function (models.pruning.interaction), so it never needs a gradient
    itself. Float64 (the exact bisection) and alpha = inf run the reference everywhere."""
    if x.dtype != torch.float32 or math.isinf(alpha):
        _note("log_keep", "reference")
        return reference.log_keep(x, alpha=alpha, sinks=sinks, log_dtype=log_dtype)
    return _run("log_keep", x, reference.log_keep, x, alpha=alpha, sinks=sinks, log_dtype=log_dtype)


def log_keep_grad(g_log, g_keep, keep, ratio, g_mass=None):
    """The scores' gradient from those of log I, I and the mass; see kernels.reference.log_keep_grad."""
    if keep.dtype != torch.float32:
        _note("log_keep_grad", "reference")
        return reference.log_keep_grad(g_log, g_keep, keep, ratio, g_mass)
    return _run("log_keep_grad", keep, reference.log_keep_grad, g_log, g_keep, keep, ratio, g_mass)


def lag_conv(x, w, start: int = 0):
    if w.dim() == 3 or _needs_grad(x, w):  # SHE's matrix lags (batched matmuls / FFT) and training
        _note("lag_conv", "reference")
        return reference.lag_conv(x, w, start)
    return _run("lag_conv", x, reference.lag_conv, x, w, start)


def step_write(q, new: dict, buffers: dict, cursor, rope=None, slots=None):
    """A fixed-shape decode step's cache writes at the device-side cursor (K, V, the rule's K_int; with `slots`
    the compacted cache's position and live bit), with q and K rotated on the way when `rope` is given (angle
    tables and the rows' positions): one launch on a GPU; returns q, rotated with rope. See
    kernels.reference.step_write. Values that need a gradient take the reference (autograd's rotary and index
    copies)."""
    if _needs_grad(q if rope is not None else None, *new.values()):
        _note("step_write", "reference")
        return reference.step_write(q, new, buffers, cursor, rope, slots)
    return _run("step_write", new["k"], reference.step_write, q, new, buffers, cursor, rope, slots)


def rule_product(x, w):
    """The learned rule's projection of a decode step's hidden state x in float32 at least (w: [W^Qint | W^Kint]
    in the rule's precision): for a half-precision x one launch on a GPU (PyTorch: the widening copy and the
    product); any other x, or one that needs a gradient, is the reference's one matmul. See
    kernels.reference.rule_product."""
    if x.dtype not in (torch.bfloat16, torch.float16) or _needs_grad(x, w):
        _note("rule_product", "reference")
        return reference.rule_product(x, w)
    return _run("rule_product", x, reference.rule_product, x, w)


def silu_mul(g, u):
    """silu(g) * u (SwiGLU's gate), one launch on a GPU at inference; anything that needs a gradient runs the
    reference, whose autograd owns the backward."""
    if _needs_grad(g, u):
        _note("silu_mul", "reference")
        return reference.silu_mul(g, u)
    return _run("silu_mul", g, reference.silu_mul, g, u)


def add_norm(x, h, weight, bias, eps: float, rms: bool):
    """(x + h, norm(x + h)) with RMSNorm (rms) or LayerNorm over the last dimension; h None: (x, norm(x)). One
    launch on a GPU at inference (PyTorch: an add and a norm, six kernels for RMSNorm's composite form).
    The reference runs what needs a gradient, and mixed dtypes: under autocast (training's distillation teacher
    runs without a gradient) a float32 residual meets bf16 sums, and torch's norms there compute in float32.
    See kernels.reference.add_norm."""
    mixed = torch.is_autocast_enabled(x.device.type) or any(t is not None and t.dtype != x.dtype
                                                             for t in (h, weight, bias))
    if mixed or _needs_grad(x, h, weight, bias):
        _note("add_norm", "reference")
        return reference.add_norm(x, h, weight, bias, eps, rms)
    return _run("add_norm", x, reference.add_norm, x, h, weight, bias, eps, rms)
