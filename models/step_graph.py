"""A training step's forward and backward replayed from CUDA graphs (train.cuda_graph).

On a GPU a step of configs/gpu/mha-pruned.json at batch 8 waits on the host: an H200 is busy 24 of the pruned
step's 42-51 ms and 13 of its dense twin's 24, so what the host dispatches decides the ratio. Replayed
from a graph, the forward and the backward are one launch each, whatever they hold.

GraphedLoss captures the model's loss (and the pruned model's sparsity mass) with
torch.cuda.make_graphed_callables, PyTorch's partial-network capture: the captured forward and backward sit in
one autograd node, so the gradient reaches .grad as an eager step's does; clipping, the optimizer and the
sparsity term stay eager (a few launches). What a capture bakes in, and how each is handled:

- Shapes: a graph replays one batch shape; a batch of another shape is refused.
- Alpha moves every step. It picks the alpha-sigmoid's form, a constexpr of the keep kernel (the sigmoid at 1, a
  clamp at 2, a table elsewhere): each form the run's alphas hold at MIN_STEPS steps or more gets a capture of its
  own, made when it first runs, with a memory pool of its own (a forward and backward's activations); the others
  run eagerly (a cosine schedule from 1 passes alpha 1 at one step and alpha 2 at none). Inside the table form the
  table's values and range are read on the device from a TableSlot, which load(alpha) refills before each replay
  (kernels.triton_keep reads lim, half / lim and half from it). The reference keep path takes them from the host,
  so a table form captured anywhere else is refused.
- Autocast's weight cache is off inside the capture (make_graphed_callables refuses it): each forward casts the
  weights it uses, as the cache's first use would.
- The rest of the step must not change while graphs live: which parameters train, the kernel paths
  (MIXSCOPE_KERNELS, MIXSCOPE_CAUSAL_BIAS), training mode (an eval-mode call is refused).
- No autograd graph of an earlier eager step of the model may be alive when a form is captured: its parameters'
  AccumulateGrad nodes are shared with the capture and tied to the stream they were made on, the default one,
  which cannot join a capture (cudaErrorStreamCaptureImplicit on an H200; pytorch/pytorch#64339).
  models.train drops each step's loss and mass before the next, and DecoderLM.forward keeps no layer's mass.
  A first capture holds those nodes from then on (its graphed module keeps its static outputs' graph); with
  nothing held before it they are made on its warm-up's side stream, which later captures can join (on an
  H200 a later form, the table, was captured with a replay's graph alive). Every form runs the same
  model forward, so the first capture reaches each parameter a later one does. So before its first capture
  GraphedLoss looks for live tensors (and autograd nodes) whose graph reaches a parameter. Where torch can point
  such a node at the capturing stream at each sync (torch.autograd.graph.set_override_stale_capture_stream,
  pytorch/pytorch#180090; 2.13 has it), every capture runs with that on and goes ahead, a best effort (later
  PyTorch fixes name sync points it missed). Where it cannot (2.11, the H200 image's torch, and 2.12), the form
  is not captured and the run steps eagerly, naming the holders, rather than start a capture that fails and
  breaks the process's CUDA state.
- The gradients a replay hands back are the graph's own buffers (p.grad shares their memory), so a replayed step
  needs every trained p.grad None before it (zero_grad(set_to_none=True), as models.train does): a gradient left
  there would be overwritten by the replay, then added to itself. Refused.

A capture that fails is reported (`failed`) and every form of the step runs eagerly from then on, as a best effort:
on torch before 2.12 a capture that raised can leave the caching allocator believing a capture is still under way
(pytorch/pytorch#180395), which a later capture or empty_cache trips over. A device fault is raised. On other
devices models.train runs eagerly and says so.
"""
from __future__ import annotations

import gc
import logging
import math
from collections import Counter
from contextlib import contextmanager, nullcontext

import torch

import kernels
from kernels import efficient
from kernels.alpha_sigmoid import TableSlot, alpha_schedule, needs_table, slot_points, use_slot

log = logging.getLogger(__name__)

MIN_STEPS = 8  # a capture costs about four steps (three warm-ups and the capture); rarer forms run eagerly


def form(alpha: float | None) -> str:
    """Which capture a step at this alpha replays (None: a dense model, no alpha)."""
    if alpha is None:
        return "dense"
    if alpha == 1:
        return "sigmoid"
    if alpha == 2:
        return "clamp"
    return "step" if math.isinf(alpha) else "table"


def _forward(model, x: torch.Tensor, y: torch.Tensor, autocast_dtype: torch.dtype | None, cache: bool):
    with torch.autocast(x.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None,
                        cache_enabled=cache):
        res = model(x, targets=y)
    return res.loss, res.prune_mass


def eager_loss(model: torch.nn.Module, autocast_dtype: torch.dtype | None = torch.bfloat16):
    """(x, y) -> (LM loss, sparsity mass or None) of a step run eagerly, as models.train computes them without
    train.cuda_graph (autocast in autocast_dtype; None: off): a GraphedLoss's forms that do not replay, and
    bench.train_step_profile's eager rows."""
    return lambda x, y: _forward(model, x, y, autocast_dtype, cache=True)


def graphs_holding(params, limit: int = 3) -> list[str]:
    """Up to `limit` live tensors (or autograd nodes) whose graph reaches one of these parameters' AccumulateGrad
    nodes, each as shape, dtype and grad_fn: what would share those nodes with a capture. Collects garbage first (a
    cycle can hold a graph)."""
    want = {id(p) for p in params}
    gc.collect()
    # (clear: the nodes known to reach no parameter, shared across roots; by id, each kept so that no id is reused
    # while the scan runs: a node's Python wrapper lives only as long as something refers to it)
    found, clear = [], {}
    # (type(), and torch functions off: neither an object's __class__ nor a subclass's __torch_function__ runs)
    with torch._C.DisableTorchFunctionSubclass():
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor):
                if o.grad_fn is not None and _reaches(o.grad_fn, want, clear):
                    found.append(f"{tuple(o.shape)} {o.dtype} from {type(o.grad_fn).__name__}")
            elif issubclass(type(o), torch.autograd.graph.Node) and _reaches(o, want, clear):
                found.append(f"an autograd node {type(o).__name__}")
            if len(found) == limit:
                break
    return found


def _reaches(root, want: set[int], clear: dict) -> bool:
    """Whether root's graph holds the AccumulateGrad node of a parameter whose id is in want. Nodes in clear are
    not walked; a walk that finds none adds the nodes it saw to clear (one that finds one does not: a later root
    through the same nodes is named too, whatever order the collector lists them in)."""
    todo, seen = [root], {}
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen or id(fn) in clear:
            continue
        seen[id(fn)] = fn
        if id(getattr(fn, "variable", None)) in want:  # (an AccumulateGrad node's parameter)
            return True
        todo.extend(f for f, _ in fn.next_functions)
    clear.update(seen)
    return False


@contextmanager
def _stale_streams_redirected():
    """Yields whether autograd points a node made on a stream outside the capture at the capturing stream (where
    torch has the setting: 2.13 does, 2.11 and 2.12 do not), turned on for the block and restored after (a
    process-wide setting)."""
    put = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if put is None:
        yield False
        return
    before = getattr(torch._C, "_override_stale_capture_stream", lambda: False)()  # (off: the documented start)
    put(True)
    try:
        yield True
    finally:
        put(before)


class _Loss(torch.nn.Module):
    """The model's loss and sparsity mass as a module of tensors in and out, what make_graphed_callables takes
    (a fresh one per capture: each capture replaces its module's forward)."""

    def __init__(self, model: torch.nn.Module, autocast_dtype: torch.dtype | None):
        super().__init__()
        self.model, self.autocast_dtype = model, autocast_dtype

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        loss, mass = _forward(self.model, x, y, self.autocast_dtype, cache=False)
        return (loss,) if mass is None else (loss, mass)


def schedule_alphas(steps: int, total: int, start: float, end: float) -> list[float]:
    """The alpha of each of a run's steps 0..steps-1 (alpha_schedule over `total` steps, then held): a form's count
    of steps, and the longest table, come from it."""
    return [alpha_schedule(s, total, start, end) for s in range(steps)]


class GraphedLoss:
    """model(x, targets=y)'s (loss, sparsity mass or None), the forward and backward replayed from CUDA graphs.
    alphas: the alpha of every step the run will take, repeats included (sizes the table slot and says which forms
    are worth a capture; a dense model has none). min_steps: a form's steps in alphas for a capture (a dense model's
    one form is always captured). capture: make_graphed_callables, replaceable so that the orchestration runs on a
    CPU in tests."""

    def __init__(self, model: torch.nn.Module, alphas=(), autocast_dtype: torch.dtype | None = torch.bfloat16,
                 capture=None, min_steps: int = MIN_STEPS):
        self.model, self.autocast_dtype = model, autocast_dtype
        self.capture = capture or torch.cuda.make_graphed_callables
        self.device = next(model.parameters()).device
        alphas = [float(a) for a in alphas]
        self.slot = TableSlot(self.device, slot_points(alphas)) if any(needs_table(a) for a in alphas) else None
        steps = Counter(form(a) for a in alphas)
        self.captured_forms = {"dense"} | {k for k, n in steps.items() if n >= min_steps}
        self.graphs: dict[str, torch.nn.Module] = {}
        self.paths: dict[str, dict[str, str]] = {}  # per form, the kernel paths its capture took
        self.failed: dict[str, str] = {}            # per form, why its capture failed (then every form is eager)
        self.eager = eager_loss(model, autocast_dtype)
        self.shape = None

    def _alpha(self) -> float | None:
        rules = [b.mixer.pruning for b in self.model.blocks if getattr(b.mixer, "pruning", None) is not None]
        return rules[0].current_alpha() if rules else None

    def replays(self, alpha: float | None) -> bool:
        """Whether a step at this alpha replays a graph (captured already or to be), rather than running eagerly:
        after any capture failed, none does."""
        return form(alpha) in self.captured_forms and not self.failed

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.model.training:
            raise ValueError("a graphed step trains: the model is in eval mode")
        alpha = self._alpha()
        kind = form(alpha)
        if not self.replays(alpha):
            return self.eager(x, y)
        if self.shape is None:
            self.shape = (tuple(x.shape), tuple(y.shape))
        elif (tuple(x.shape), tuple(y.shape)) != self.shape:
            raise ValueError(f"a graphed step replays batches of {self.shape[0]} tokens, got {tuple(x.shape)}")
        if any(p.grad is not None for p in self.model.parameters() if p.requires_grad):
            raise ValueError("a replayed step writes its gradients into the graph's own buffers: set every .grad to "
                             "None before it (zero_grad(set_to_none=True))")
        if kind == "table":  # (captured only when the run's alphas hold tables: the slot is sized for them)
            self.slot.load(alpha)
        with use_slot(self.slot) if kind == "table" else nullcontext():
            graphed = self.graphs.get(kind) or self._capture(kind, x, y)
            if graphed is None:
                return self(x, y)  # (it failed: now eager)
            out = graphed(x, y)
        return out[0], (out[1] if len(out) > 1 else None)

    def _capture(self, kind: str, x: torch.Tensor, y: torch.Tensor):
        """The form's graphed module (its warm-up steps and the capture read the slot just loaded), or None when the
        capture failed."""
        stream = torch.cuda.current_stream() if x.is_cuda else None
        # (only before the first capture: the module docstring)
        held = [] if self.graphs else graphs_holding(p for p in self.model.parameters() if p.requires_grad)
        with _stale_streams_redirected() as redirected:
            if held and not redirected:
                return self._fail(kind, "live tensors hold an earlier step's autograd graph, whose nodes this torch "
                                        f"cannot move into a capture: {'; '.join(held)}")
            if held:
                log.info("live tensors hold an earlier step's graph (%s): autograd points its nodes at the capture's "
                         "stream", "; ".join(held))
            try:
                with kernels.record_paths() as self.paths[kind]:
                    graphed = self.capture(_Loss(self.model, self.autocast_dtype), (x, y), allow_unused_input=True)
            except RuntimeError as e:
                if not efficient.refusal(e):  # out of memory, or the device failed: nothing eager would fare better
                    raise
                if stream is not None:  # (a capture that raised leaves its side stream current: pytorch/graphs.py)
                    torch.cuda.set_stream(stream)
                return self._fail(kind, f"{type(e).__name__}: {e}")
        if kind == "table" and self.paths[kind].get("log_keep") != "triton":
            # the reference indexes the table with the capture's alpha, taken from the host: later replays would
            # read each new table with it
            raise RuntimeError(f"a graphed table step needs the Triton keep kernel; its capture took "
                               f"{self.paths[kind].get('log_keep')!r} (MIXSCOPE_KERNELS, or no Triton here)")
        self.graphs[kind] = graphed
        return graphed

    def _fail(self, kind: str, why: str) -> None:
        self.failed[kind] = why
        self.paths.pop(kind, None)  # (paths: the forms captured)
        log.warning("the %s form of the training step was not captured (%s): every form runs eagerly", kind, why)
