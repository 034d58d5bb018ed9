"""The alpha-sigmoid of context pruning and its alpha schedule (docs/methods.md#the-alpha-sigmoid-and-its-schedule).

sigma_alpha(x) = argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy) = alpha-entmax([x, 0])[0]:
the ordinary sigmoid at alpha = 1, clip((x + 1)/2, 0, 1) at alpha = 2, saturating at +-1/(alpha - 1) for
alpha > 1, and the step 1[x > 0] at alpha = inf (inference).
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch


def _f_log(t: torch.Tensor, a1, below_two: bool) -> torch.Tensor:
    """The x at which the alpha-sigmoid equals p = e^t (its inverse, (p^(a-1) - (1-p)^(a-1)) / (a-1)), for
    a1 = alpha - 1: a number, or a tensor of one per row (the batched table build), every alpha on the side of 2
    that below_two says. Below alpha 2 with expm1, so nothing cancels near alpha = 1; from 2 on with the powers
    themselves, since there both expm1 terms sit near -1 and their difference near x = 0 would cancel (3e-4 off at
    alpha 50)."""
    log_rest = torch.log1p(-torch.exp(t))
    if below_two:
        return (torch.expm1(a1 * t) - torch.expm1(a1 * log_rest)) / a1
    return (torch.exp(a1 * t) - torch.exp(a1 * log_rest)) / a1


class _AlphaSigmoid(torch.autograd.Function):
    """sigma_alpha by bisection, exact to the working precision in relative terms: it solves for the smaller of
    sigma and 1 - sigma (sigma(-x) = 1 - sigma(x)) by bisecting its logarithm, so a tail value such as 1e-30
    comes out as itself (bisecting sigma directly stopped at 2^-55 and lifted log sigma to -38)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        p, q = _bisect(x, alpha)
        ctx.alpha = alpha
        ctx.save_for_backward(q, x)
        return p

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, x = ctx.saved_tensors
        return grad * derivative(q, x.to(q.dtype), ctx.alpha).to(grad.dtype), None


def _bisect(x: torch.Tensor, alpha, below_two: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma_alpha(x) in x's dtype, q = min(sigma, 1 - sigma) in the working precision), see _AlphaSigmoid.
    alpha: a number, or a float64 tensor [K, 1] of one alpha per row of x [K, N] (as _f_log takes it)."""
    if below_two is None:
        below_two = alpha < 2
    a1 = alpha - 1.0  # (once: with a tensor alpha each use would be a launch)
    lim = 1.0 / a1
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    tiny = torch.finfo(work).tiny
    # log q lies in [log tiny, log 1/2]; 63 halvings of that span (31 in float32) reach the working precision
    steps = 63 if work == torch.float64 else 31
    xd = x.detach().to(work).clamp(-lim, lim)
    target = -xd.abs()                                   # q = sigma(-|x|) <= 1/2
    lo, hi = torch.full_like(xd, math.log(tiny)), torch.full_like(xd, -math.log(2.0))
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        below = _f_log(mid, a1, below_two) < target
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    # 0 at saturation, and below the smallest normal q the bracket can hold (float32 near alpha 1: x < -85)
    floor = _f_log(torch.tensor(math.log(tiny), dtype=work, device=xd.device), a1, below_two)
    under = (target <= -lim) | (target < floor)
    q = torch.where(under, torch.zeros_like(xd), (0.5 * (lo + hi)).exp())
    p = torch.where(xd > 0, 1 - q, q)
    p = torch.where(xd.isnan(), xd, p)   # a NaN score stays NaN (training reports the divergence)
    return p.to(x.dtype), q


def derivative(q: torch.Tensor, x: torch.Tensor, alpha) -> torch.Tensor:
    """d sigma / dx from q = min(sigma, 1 - sigma) (the derivative is symmetric in the two): the entmax
    Jacobian for [x, 0], s1 s2 / (s1 + s2) with s = p^(2 - alpha); 0 where sigma saturates. alpha: a number or
    a tensor that broadcasts against q (one per row)."""
    tiny = torch.finfo(q.dtype).tiny
    d = 1.0 / (q.clamp_min(tiny).pow(alpha - 2) + (1 - q).pow(alpha - 2))
    inside = (x.abs() < 1.0 / (alpha - 1.0)) & (q > 0)
    return torch.where(inside, d, torch.zeros_like(d))


TABLE_POINTS = 8193
TABLE_STEP = 0.005  # widest grid spacing; linear interpolation errs by at most ~2e-6, next to saturation
P_FLOOR = 1e-40     # log I's floor (docs/methods.md; keep_rule.LOG_FLOOR): below it a value changes nothing


def table_range(alpha: float) -> float:
    """R such that the table on [-R, R] covers every x whose sigma_alpha is neither below P_FLOOR nor 1 in
    float32: 1/(alpha-1) where sigma saturates, or, nearer alpha = 1 where the saturation point runs off to
    infinity (1000 at alpha = 1.001), the x at which sigma falls to P_FLOOR, which stays under 93 (the
    sigmoid's)."""
    a1 = alpha - 1.0
    return min(1.0 / a1, -math.expm1(a1 * math.log(P_FLOOR)) / a1)


# Tables by (alpha, device), newest last. Training moves alpha every step, so each step needs a new table, and
# one table's bisection is about 930 small operations (counted on the CPU). On an H200 a
# configs/gpu/mha-pruned step that built one took 13-17 ms more than one at alpha 2, which needs none: a GPU trainer
# builds the next steps' tables in one batched bisection a side of alpha 2 (prepare_tables; more only past
# BATCH_POINTS, as for a block near alpha 1.001, whose grids hold 37k points: two below 2).
class Table(NamedTuple):
    """One alpha's interpolation table on a device: sigma_alpha (p) and its derivative (d) on a uniform odd grid
    over [-lim, lim], float32, and params = (lim, half / lim, half) as float32 on the same device (half: the grid's
    points either side of 0), which the Triton keep kernel reads there, so a captured step takes a new alpha's
    table without a launch argument changing (TableSlot)."""
    p: torch.Tensor
    d: torch.Tensor
    params: torch.Tensor


def _params(alpha: float, points: int) -> tuple[float, float, float]:
    lim, half = table_range(alpha), float((points - 1) // 2)
    return lim, half / lim, half


_TABLES: OrderedDict[tuple[float, str], Table] = OrderedDict()
_TABLES_LOCK = threading.Lock()
TABLES_KEPT = 128        # at most ~40 MB (37k points each near alpha = 1, 8193 from 1.05 on)
BATCH_POINTS = 1 << 21   # grid points in one batched build: its float64 bisection holds a few [K, points] tensors
AHEAD = 64               # the steps a GPU trainer builds tables for at once (prefetch_schedule)


def _where(device) -> str:
    """The device as tensors name it ('cuda' is 'cuda:0' on a tensor there): the tables' key."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def needs_table(alpha: float) -> bool:
    """Whether the alpha-sigmoid at alpha is interpolated in a table: every finite alpha but the closed forms,
    1 (the sigmoid) and 2 (a clamp)."""
    return 1 < alpha < math.inf and alpha != 2


def _keep(built) -> None:
    """Put (key, tables) pairs in the kept set, newest last, dropping the oldest past TABLES_KEPT."""
    with _TABLES_LOCK:
        for key, tables in built:
            _TABLES[key] = tables
            _TABLES.move_to_end(key)
        while len(_TABLES) > TABLES_KEPT:
            _TABLES.popitem(last=False)


def _grid(alpha: float) -> tuple[float, int]:
    """The table's half-range R and its (odd) point count: the grid is symmetric about 0. Below alpha 1.05, where R
    passes 20, the half count (R / TABLE_STEP at least) is rounded up to a multiple of 1024 (once so that nearby
    alphas shared a bisection; kept so that every alpha's table stays what it was)."""
    lim = table_range(alpha)
    half = max((TABLE_POINTS - 1) // 2, -(-math.ceil(lim / TABLE_STEP) // 1024) * 1024)
    return lim, 2 * half + 1


def _build(alphas: list[float], device: str) -> list[Table]:
    """sigma_alpha and its derivative on each alpha's grid, exact (float64 bisection), stored in float32; every
    alpha of one call on one side of 2, so one bisection over [K, points] serves all (built on `device` itself: a
    host-built table would cost each GPU step a host bisection and a copy). A grid with fewer points than the
    call's largest is padded with its end points on both sides, so each row stays symmetric about its centre (the
    derivative pairs x with -x by flipping the row) and the padding is cut off after. Every operation is
    elementwise, so a table's values do not depend on what it was built beside (tests/test_pruning.py)."""
    counts = [_grid(a)[1] for a in alphas]
    points = max(counts)
    rows = []
    for a, n in zip(alphas, counts):
        row = torch.linspace(-table_range(a), table_range(a), n, dtype=torch.float64, device=device)
        pad = (points - n) // 2  # (both counts odd)
        rows.append(torch.cat([row[:1].expand(pad), row, row[-1:].expand(pad)]) if pad else row)
    x = torch.stack(rows)
    a = torch.tensor(alphas, dtype=torch.float64, device=device)[:, None]
    p, _ = _bisect(x, a, below_two=alphas[0] < 2)
    d = derivative(torch.minimum(p, p.flip(-1)), x, a)  # p(-x) = 1 - p(x), unrounded (grid symmetric to 1e-14)
    p, d = p.float(), d.float()
    params = torch.tensor([_params(a, n) for a, n in zip(alphas, counts)], dtype=torch.float32, device=device)
    cut = [((points - n) // 2, n) for n in counts]
    return [Table(p[i, lo:lo + n].clone(), d[i, lo:lo + n].clone(), params[i].clone())  # (a kept row must not
            for i, (lo, n) in enumerate(cut)]                                           # hold its batch)


def prepare_tables(alphas, device) -> None:
    """Build the tables of these alphas that are not kept yet: those on one side of 2 in one batched bisection
    (up to BATCH_POINTS grid points at a time, every row as long as the chunk's longest: a block of 64 steps from
    alpha 1.001 takes two). Near alpha 1 the point counts of a schedule's neighbouring steps differ; a bisection
    per count made an H200 build a block of 64 steps from alpha 1.02 in six (99 ms). Closed forms
    (alpha 1, 2, inf) need none."""
    device = _where(device)
    with _TABLES_LOCK:
        todo = list(dict.fromkeys(float(a) for a in alphas if needs_table(a) and (float(a), device) not in _TABLES))
    for below in (True, False):
        group = sorted((a for a in todo if (a < 2) == below), key=lambda a: -_grid(a)[1])  # longest first
        while group:
            per = max(1, BATCH_POINTS // _grid(group[0])[1])  # (the chunk's first row is its longest)
            chunk, group = group[:per], group[per:]
            _keep(zip([(a, device) for a in chunk], _build(chunk, device)))


def has_table(alpha: float, device) -> bool:
    with _TABLES_LOCK:
        return (float(alpha), _where(device)) in _TABLES


def clear_tables() -> None:
    with _TABLES_LOCK:
        _TABLES.clear()


def prefetch_schedule(step: int, total: int, start: float, end: float, device, ahead: int = AHEAD) -> None:
    """Before a training step: when this step's table is missing, build it with the next `ahead` steps' in one
    batched bisection a side of 2 (a GPU trainer's call; on a CPU ahead=1 builds only this step's, as _table
    would)."""
    alpha = alpha_schedule(step, total, start, end)
    if needs_table(alpha) and not has_table(alpha, device):
        prepare_tables([alpha_schedule(s, total, start, end) for s in range(step, step + max(ahead, 1))], device)


def _table(alpha: float, device: str) -> Table:
    """sigma_alpha and its derivative on a uniform grid over [-R, R] (table_range), float32: the kept one, else
    built now (alone); while a TableSlot is in use on the device (in this context), the slot's, which must hold
    this alpha."""
    key = (float(alpha), _where(device))
    slot = (_SLOTS.get() or {}).get(key[1])
    if slot is not None:
        return slot.table(key[0])
    with _TABLES_LOCK:
        if key in _TABLES:
            _TABLES.move_to_end(key)
            return _TABLES[key]
    if not needs_table(key[0]):
        raise ValueError(f"alpha {alpha} takes a closed form, not a table")
    tables = _build([key[0]], key[1])[0]
    _keep([(key, tables)])
    return tables


class TableSlot:
    """Fixed buffers on one device for the table of the alpha about to run. A training step captured in a CUDA
    graph (models.step_graph) launches the keep kernel with the addresses it had at capture, so its table has to
    sit at those addresses whatever alpha the step has: load(alpha) copies that alpha's table there (three copies
    on the device, nothing from the host), and while the slot is in use (use_slot) _table answers for the device
    from it. Sized for the longest grid it will hold (slot_points)."""

    def __init__(self, device, points: int):
        self.device = _where(device)
        self.p = torch.zeros(points, dtype=torch.float32, device=self.device)
        self.d = torch.zeros_like(self.p)
        self.params = torch.zeros(3, dtype=torch.float32, device=self.device)
        self.alpha, self.points = None, 0

    def load(self, alpha: float) -> None:
        token = _SLOTS.set({})  # (the kept table, not a slot's: look it up with none in use)
        try:
            tab = _table(float(alpha), self.device)
        finally:
            _SLOTS.reset(token)
        n = tab.p.numel()
        if n > self.p.numel():
            raise ValueError(f"alpha {alpha}'s table has {n} points, the slot {self.p.numel()}: size it with "
                             "slot_points over every alpha it will hold")
        self.p[:n].copy_(tab.p)
        self.d[:n].copy_(tab.d)
        self.params.copy_(tab.params)
        self.alpha, self.points = float(alpha), n

    def table(self, alpha: float) -> Table:
        """The slot's table as _table returns one: views from the buffers' start (the same addresses whatever
        their length), which must be alpha's."""
        if self.alpha != alpha:
            raise RuntimeError(f"the table slot holds alpha {self.alpha}, the step asked for {alpha}: load() the "
                               "step's alpha first")
        return Table(self.p[:self.points], self.d[:self.points], self.params)


# device -> the TableSlot in use there, per context (app sessions run in threads, and only the thread that set a
# slot runs the forward that reads it: a capture's warm-up, capture and eager steps)
_SLOTS: ContextVar[dict[str, TableSlot] | None] = ContextVar("alpha_sigmoid_slots", default=None)


def slot_points(alphas) -> int:
    """The grid points a TableSlot needs to hold any of these alphas' tables (at least 1)."""
    return max([_grid(float(a))[1] for a in alphas if needs_table(float(a))], default=1)


@contextmanager
def use_slot(slot: TableSlot):
    """While inside (in this context), _table on the slot's device answers from the slot (see TableSlot)."""
    token = _SLOTS.set((_SLOTS.get() or {}) | {slot.device: slot})
    try:
        yield slot
    finally:
        _SLOTS.reset(token)


def _lerp_tables(tables: tuple[torch.Tensor, ...], x: torch.Tensor, lim: float) -> list[torch.Tensor]:
    """Linear interpolation of x in each table (all on one odd grid over [-lim, lim]), the index computed once.
    The index is counted from the centre so float32 keeps x's own precision near 0, where sigma is steepest (from
    the left end, x + lim rounds to the ulp of lim: up to 2e-6 off at alpha = 1.001)."""
    half = (tables[0].shape[0] - 1) // 2
    x = x.float()
    nan = x.isnan()
    u = x.nan_to_num(0.0).clamp(-lim, lim) * (half / lim)   # (a NaN would index out of range: NaN comes back below)
    # float32(lim) * float32(half / lim) can pass half by an ulp (at 88 of the alphas 1.01, 1.02, ..., 19.99): w
    # then leaves [0, 1] and sigma went to -7e-8 below the grid (negative I) and 1 + 1e-7 above it
    u = u.clamp(-half, half)
    i0 = u.floor().clamp(-half, half - 1)
    w = u - i0
    i0 = i0.long() + half
    return [torch.where(nan, x, table[i0] * (1 - w) + table[i0 + 1] * w) for table in tables]


class _AlphaSigmoidTable(torch.autograd.Function):
    """Training speed: sigma_alpha by linear interpolation in an exact table (alpha is one number per
    step), its derivative likewise; within about 2e-6 of the exact value. Past the table's ends sigma is 0 or 1
    and its derivative 0 (within P_FLOOR near alpha = 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, alpha: float) -> torch.Tensor:
        lim = table_range(alpha)
        p_tab, d_tab, _ = _table(alpha, str(x.device))
        ctx.save_for_backward(x)
        ctx.alpha, ctx.lim, ctx.d_tab = alpha, lim, d_tab
        return _lerp_tables((p_tab,), x, lim)[0].to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        d = _table_slope(_lerp_tables((ctx.d_tab,), x, ctx.lim)[0], x, ctx.lim)
        return grad * d.to(grad.dtype), None


def _table_slope(d: torch.Tensor, x: torch.Tensor, lim: float) -> torch.Tensor:
    """The interpolated derivative, 0 past the table's ends (sigma is flat there)."""
    return torch.where(x.float().abs() < lim, d, torch.zeros_like(d))


def alpha_sigmoid(x: torch.Tensor, alpha: float, exact: bool | None = None) -> torch.Tensor:
    """argmax_{p in [0,1]} p x + H_alpha(p) (Tsallis entropy): the sigmoid at alpha = 1, clip((x+1)/2) at
    alpha = 2, saturating at +-1/(alpha-1) for alpha > 1, the step 1[x > 0] at alpha = inf.
    exact=None: bisection for float64 inputs, the interpolated table otherwise (every alpha: below 1.05 the
    float64 bisection over a [B,T,T] score tensor made a training step over 3x slower, bench.train_step_profile)."""
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    if alpha == 1:
        return torch.sigmoid(x)
    if math.isinf(alpha):
        return (x > 0).to(x.dtype)
    if alpha == 2:
        return ((x + 1) / 2).clamp(0, 1)
    if exact is None:
        exact = x.dtype == torch.float64
    return (_AlphaSigmoid if exact else _AlphaSigmoidTable).apply(x, float(alpha))


def alpha_sigmoid_slope(x: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma_alpha(x), d sigma_alpha / dx) without autograd, each as the path alpha_sigmoid takes for x computes
    it (forward and backward): for a hand-written backward that fuses what follows sigma (interaction's log I)."""
    if alpha < 1:
        raise ValueError(f"alpha must be >= 1, got {alpha}")
    with torch.no_grad():
        if alpha == 1:
            p = torch.sigmoid(x)
            return p, p * (1 - p)
        if math.isinf(alpha):
            return (x > 0).to(x.dtype), torch.zeros_like(x)
        if alpha == 2:  # clamp passes the gradient where (x + 1) / 2 lies in [0, 1], its ends included
            y = (x + 1) / 2
            return y.clamp(0, 1), torch.where((y >= 0) & (y <= 1), 0.5, 0.0).to(x.dtype)
        if x.dtype == torch.float64:
            p, q = _bisect(x, alpha)
            return p, derivative(q, x.to(q.dtype), alpha).to(x.dtype)
        lim = table_range(alpha)
        p, d = _lerp_tables(_table(alpha, str(x.device))[:2], x, lim)
        return p.to(x.dtype), _table_slope(d, x, lim).to(x.dtype)


def alpha_schedule(step: int, total: int, start: float = 1.0, end: float = 8.0) -> float:
    """Cosine from `start` to `end` over `total` steps, then held (reference: 8 + 0.5 (1 - 8)(1 + cos(pi s / S)))."""
    s = min(step, total) / max(total, 1)
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * s))
