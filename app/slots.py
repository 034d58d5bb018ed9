"""A server-wide limit on heavy computations (forwards, attribution, generation steps, model loads).

Every browser session of one server shares the cores and the memory: two forwards at once each take all the
threads (on 2 cores a 2-thread forward beside another ran several times slower) and each holds its own peak.
`Slots` lets `size` computations run at once and queues the rest first come, first served; a full queue
answers "busy" at once instead of piling up work. Waiting is polled, so the waiter can report its place and a
Streamlit rerun or a closed tab (which raise inside the report) leave the queue cleanly. A thread that
already holds a slot passes through a nested request (a cached computation that calls another).

When the last running computation ends and nobody waits, `on_idle(slots)` runs (from_env: IdleTrim, which hands
freed heap memory back to the system once no computation has started for 2 s and none runs, since glibc keeps it
for reuse: after integrated gradients on SmolLM2 the server held 1.5 GB more until trimmed, 6 MB after).

No Streamlit here: app/heavy.py shows the place on a page; tests drive this module with plain threads.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager

from kernels import settings


class Busy(RuntimeError):
    """The queue is full: the caller should ask the user to try again shortly."""


class Slots:
    def __init__(self, size: int, queue: int, on_idle=None, per_owner: int | None = None):
        if size < 1 or queue < 0 or (per_owner is not None and per_owner < 1):
            raise ValueError("at least one slot, a queue of zero or more and at least one per owner")
        self.size, self.queue, self.on_idle, self.per_owner = size, queue, on_idle, per_owner
        self._owners: Counter = Counter()   # owner -> computations running or waiting
        self._starts = 0                      # computations started so far (IdleTrim reads it)
        self._cond = threading.Condition()
        self._running = 0
        self._waiting: deque[object] = deque()
        self._held = threading.local()   # per thread: how many nested holds

    def starts(self) -> int:
        """How many computations have started so far (not counting nested holds)."""
        with self._cond:
            return self._starts

    def quiet(self) -> tuple[int, bool]:
        """(starts so far, whether nothing runs or waits), read together."""
        with self._cond:
            return self._starts, self._running == 0 and not self._waiting

    def state(self) -> tuple[int, int]:
        """(computations running, computations waiting)."""
        with self._cond:
            return self._running, len(self._waiting)

    @contextmanager
    def hold(self, report=None, poll_s: float = 0.25, refuse: bool = True, owner=None):
        """Run the body in a slot. report(place) is called (outside the lock) whenever the caller's place in
        the queue changes (1: next), and again every poll_s while it waits, so a caller whose report raises
        (a rerun, a stop) leaves the queue. Raises Busy when `queue` callers already wait, or when `owner` (a user,
        None: unknown) already has `per_owner` computations running or waiting, unless refuse is False (the next
        step of work already under way: it waits in line past the limits)."""
        depth = getattr(self._held, "depth", 0)
        if depth:   # this thread holds a slot already
            self._held.depth = depth + 1
            try:
                yield
            finally:
                self._held.depth = depth
            return
        self._enter(report, poll_s, refuse, owner)
        self._held.depth = 1
        try:
            yield
        finally:
            self._held.depth = 0
            with self._cond:
                self._running -= 1
                self._count(owner, -1)
                idle = self._running == 0 and not self._waiting
                self._cond.notify_all()
            if idle and self.on_idle is not None:
                self.on_idle(self)

    def _count(self, owner, n: int) -> None:
        if owner is not None:
            self._owners[owner] += n
            if self._owners[owner] <= 0:
                del self._owners[owner]

    def _enter(self, report, poll_s: float, refuse: bool, owner) -> None:
        ticket = object()
        with self._cond:
            if refuse and owner is not None and self.per_owner is not None and self._owners[owner] >= self.per_owner:
                raise Busy(f"you already have {self._owners[owner]} computation(s) running or waiting, the most one "
                           "user may have at once")
            if self._running < self.size and not self._waiting:
                self._running += 1
                self._starts += 1
                self._count(owner, 1)
                return
            if refuse and len(self._waiting) >= self.queue:
                raise Busy(f"{self._running} computation(s) running and {len(self._waiting)} waiting")
            self._waiting.append(ticket)
            self._count(owner, 1)
        try:
            while True:
                with self._cond:
                    if self._waiting[0] is ticket and self._running < self.size:
                        self._waiting.popleft()
                        self._running += 1
                        self._starts += 1
                        self._cond.notify_all()   # the next in line moves up a place
                        return
                    place = self._waiting.index(ticket) + 1
                if report is not None:
                    report(place)
                with self._cond:
                    if not (self._waiting[0] is ticket and self._running < self.size):
                        self._cond.wait(poll_s)
        except BaseException:
            with self._cond:
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                    self._count(owner, -1)
                    self._cond.notify_all()
            raise


def _malloc_trim():
    try:   # glibc's; another C library or system has none, and keeps its own ways
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def give_back_memory() -> bool:
    """Return the heap's free pages to the system (4-139 ms on a SmolLM2 server); False where it cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class IdleTrim:
    """Slots' on_idle: gives freed memory back once no computation has started for delay_s, from one background
    thread at most (so the steps of a generation, or the next forward of a page, never wait on a trim)."""

    def __init__(self, delay_s: float = 2.0, trim=give_back_memory):
        self.delay_s, self.trim = delay_s, trim
        self._lock, self._waiting = threading.Lock(), False

    def __call__(self, slots: Slots) -> None:
        with self._lock:
            if self._waiting:
                return   # (the waiting thread sees the newer quiet spell itself)
            self._waiting = True
        try:
            threading.Thread(target=self._wait, args=(slots,), name="give-back-memory", daemon=True).start()
        except RuntimeError:   # no thread to be had: no trim this time, and the next idle moment tries again
            with self._lock:
                self._waiting = False

    def _wait(self, slots: Slots) -> None:
        try:
            seen = slots.starts()
            while True:
                time.sleep(self.delay_s)
                now, quiet = slots.quiet()
                if now == seen and quiet:
                    self.trim()
                    with self._lock:   # (a computation that ran during the trim finds _waiting set: go on for it)
                        if slots.starts() == now:
                            self._waiting = False
                            return
                seen = now
        except BaseException:
            with self._lock:
                self._waiting = False
            raise


def cores() -> int:
    return os.cpu_count() or 1


def from_env() -> Slots:
    """MIXSCOPE_HEAVY_SLOTS computations at once (default: one per 4 cores, at least one), MIXSCOPE_HEAVY_QUEUE
    waiting (default 16), MIXSCOPE_HEAVY_PER_USER running or waiting for one user (default a quarter of the
    queue, at least 2)."""
    size, per_owner = settings.get("MIXSCOPE_HEAVY_SLOTS"), settings.get("MIXSCOPE_HEAVY_PER_USER")
    queue = max(0, settings.get("MIXSCOPE_HEAVY_QUEUE"))
    size = max(1, cores() // 4) if size is None else size
    per_owner = max(1, max(2, queue // 4) if per_owner is None else per_owner)
    return Slots(max(1, size), queue, on_idle=IdleTrim() if _TRIM is not None else None, per_owner=per_owner)


def threads_per_slot(slots: Slots) -> int:
    """Threads each computation takes so that all slots busy at once use the cores once: MIXSCOPE_THREADS
    overrides (the whole server's count, then split)."""
    total = settings.get("MIXSCOPE_THREADS")
    total = cores() if total is None else total
    return max(1, total // slots.size)
