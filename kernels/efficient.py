"""Training attention over a whole sequence whose bias already masks the future (a pruned model's log I, -inf above
the diagonal), on CUDA: PyTorch's memory-efficient kernel given the bias and its own causal mask at once.

`F.scaled_dot_product_attention` takes a mask or `is_causal`, not both, so a pruned training step handed it log I
alone. With a bias that needs a gradient SDPA picks the memory-efficient kernel, which then computes every block of
the T x T scores forward and backward, and writes the bias's gradient for every block and head. The aten operator
SDPA itself calls, `_scaled_dot_product_efficient_attention`, takes both; with its causal mask the kernel skips the
blocks above the diagonal (about half of them at T = 1024). The values are the same: in those blocks the bias is
-inf, so they add exact zeros to every sum.

The bias's gradient in the skipped blocks is left as the kernel allocated it (`at::empty`: whatever memory held).
It reaches only the keep structure's backward, which reads the gradient of log I on and below the diagonal and never
above it (kernels.reference.log_keep_grad masks it, kernels.triton_keep selects with `where`; tested with NaN there).
No other caller may take this path.

Grouped K/V (GQA, MQA: SmolLM2 has 3 groups for 9 heads) are repeated to one per head first: the memory-efficient
kernel takes no groups. SDPA's own `enable_gqa` went to the flash kernel alone at first (pytorch/pytorch#139586;
newer versions add cuDNN), and flash takes no bias, so a grouped pruned step on SDPA may fall to the math kernel,
every score of every head materialised (PyTorch's account, not yet seen on our GPU: the SmolLM2 profile's A/B is
to tell). A copy of K and V a layer is cheap beside either.

`MIXSCOPE_CAUSAL_BIAS=0` turns it off (the plain SDPA path then runs), for an A/B of the two on a GPU;
`MIXSCOPE_CAUSAL_BIAS=triton` hands the calls that fit to our own kernels (kernels.triton_causal_bias) first. If the
operator's forward refuses a call (a PyTorch that changed it), the path is off for the rest of the process, with a
warning, and the call runs on SDPA (`kernels.attention`): a training run or a profile goes on, and notes the path it
took. Out of memory and device errors are raised as they are, and so is any error of the backward. Under
`torch.autograd.set_detect_anomaly(True)` the unwritten gradient may hold NaN, which anomaly mode reports as an error
of this operator's backward: switch the path off to debug with it.
"""
from __future__ import annotations

import warnings

import torch

from kernels import settings

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ALIGN = 16  # elements: the kernel reads bias rows 16-aligned (SDPA pads a mask whose rows are not)


_refused: list[str] = []  # the operator's error, once it refused a call in this process


def choice() -> str:
    """MIXSCOPE_CAUSAL_BIAS: "1" (the default) this path, "triton" our own kernels first
    (kernels.triton_causal_bias; this path where they do not fit), "0" plain SDPA. Read by every whole-sequence
    training call on any device, so a value not among these raises there too."""
    return settings.get("MIXSCOPE_CAUSAL_BIAS")


def enabled() -> bool:
    return choice() != "0" and not _refused


def refusal(err: Exception) -> bool:
    """Whether a RuntimeError says the operator refused its arguments, not that memory or the device failed."""
    fatal = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None))
                  if t is not None)
    return not isinstance(err, fatal)


def refuse(err: Exception) -> None:
    """The operator failed a call: off for this process, said once."""
    if not _refused:
        _refused.append(str(err))
        warnings.warn(f"PyTorch's memory-efficient attention refused a causal bias ({err}); pruned training steps "
                      "run attention on SDPA with the bias alone from here on", RuntimeWarning, stacklevel=3)


def shapes_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """q [B,H,T,D], k/v [B,G,T,D] with G dividing H (grouped K/V are repeated to H heads: the kernel has no groups),
    a whole sequence (T == S), a bias [B,1,T,T] shared by the heads with its rows 16-aligned, one dtype of the three
    for all four."""
    if bias is None or q.dim() != 4 or k.dim() != 4 or bias.dim() != 4:
        return False
    b, h, t, d = q.shape
    g = k.shape[1]
    if g < 1 or h % g or k.shape != (b, g, t, d) or v.shape != (b, g, t, d) or tuple(bias.shape) != (b, 1, t, t):
        return False
    if q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype == bias.dtype):
        return False
    return bias.stride(-1) == 1 and bias.stride(-2) % ALIGN == 0 and bias.storage_offset() % ALIGN == 0


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this path takes the call: CUDA, where the dispatch takes its fast kernels (not
    MIXSCOPE_KERNELS=reference), the switch on, shapes_fit, and whatever PyTorch's own check of the
    memory-efficient kernel asks (head width, strides, the backend enabled, the GPU). Grouped K/V are checked as
    what the kernel will get, contiguous copies of q's shape and dtype (q stands in for them: no copy made here)."""
    if not q.is_cuda or settings.get("MIXSCOPE_KERNELS") == "reference" or not enabled():
        return False
    if not shapes_fit(q, k, v, bias):
        return False
    b, h, t, _ = q.shape
    if k.shape[1] != h:
        k = v = q
    params = torch.backends.cuda.SDPAParams(q, k, v, bias.expand(b, h, t, t), 0.0, True, False)
    return bool(torch.backends.cuda.can_use_efficient_attention(params, False))


def heads(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """K or V [B,G,T,D] repeated to q's H heads, head h reading group h // (H/G) (kernels.reference's convention,
    SDPA's enable_gqa); as it is when G == H. Its backward sums each group's heads."""
    h, g = q.shape[1], kv.shape[1]
    return kv if g == h else kv.repeat_interleave(h // g, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with the causal mask, for inputs `usable` accepted -> [B,H,T,D]. Autograd
    runs the operator's own backward (the one SDPA's memory-efficient path runs), with the log-sum-exp it needs."""
    b, h, t, _ = q.shape
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, heads(q, k), heads(q, v), bias.expand(b, h, t, t), True, 0.0, True,
        scale=scale)  # (compute_log_sumexp, dropout, is_causal)
    return out[0]
