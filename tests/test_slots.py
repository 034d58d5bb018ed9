"""The server-wide limit on heavy computations (app/slots.py), driven by plain threads."""
import threading
import time

import pytest

from app import slots as slots_module
from app.slots import Busy, Slots


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def holding(slots, gate) -> threading.Thread:
    """Another caller, started and holding a slot until gate is set."""
    def hold():
        with slots.hold():
            gate.wait()

    t = threading.Thread(target=hold)
    t.start()
    wait_until(lambda: slots.state()[0] >= 1)
    return t


def test_never_more_than_size_at_once_and_every_caller_runs():
    slots, lock = Slots(2, queue=64), threading.Lock()
    now, most, done = [0], [0], []

    def work(i):
        with slots.hold(poll_s=0.01):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            time.sleep(0.01)
            with lock:
                now[0] -= 1
        done.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 2 and sorted(done) == list(range(12)) and slots.state() == (0, 0)


def test_first_come_first_served_with_places_reported():
    slots = Slots(1, queue=8)
    gate, order, places = threading.Event(), [], {}

    def first():
        with slots.hold():
            gate.wait()
            order.append("first")

    def waiter(name):
        with slots.hold(report=lambda p: places.setdefault(name, []).append(p), poll_s=0.01):
            order.append(name)

    a = threading.Thread(target=first)
    a.start()
    wait_until(lambda: slots.state() == (1, 0))
    waiters = []
    for k, name in enumerate(["b", "c", "d"]):
        waiters.append(threading.Thread(target=waiter, args=(name,)))
        waiters[-1].start()
        wait_until(lambda k=k: slots.state() == (1, k + 1))
    wait_until(lambda: all(n in places for n in "bcd"))
    assert places["b"][0] == 1 and places["c"][0] == 2 and places["d"][0] == 3
    gate.set()
    for t in [a, *waiters]:
        t.join()
    assert order == ["first", "b", "c", "d"]
    assert all(p == sorted(p, reverse=True) for p in places.values())   # places only ever go down


def test_a_full_queue_answers_busy_at_once():
    slots, gate = Slots(1, queue=1), threading.Event()

    def hold_until_gate():
        with slots.hold(poll_s=0.01):
            gate.wait()

    threads = [threading.Thread(target=hold_until_gate) for _ in range(2)]
    threads[0].start()
    wait_until(lambda: slots.state() == (1, 0))
    threads[1].start()
    wait_until(lambda: slots.state() == (1, 1))
    with pytest.raises(Busy, match="1 computation"):
        with slots.hold():
            pass
    gate.set()
    for t in threads:
        t.join()
    assert slots.state() == (0, 0)


def test_a_caller_whose_report_raises_leaves_the_line():
    """A Streamlit rerun or a closed tab raises inside the report: the others move up, no slot is lost."""
    slots, gate = Slots(1, queue=8), threading.Event()

    class Rerun(Exception):
        pass

    def quitter():
        def report(place):
            raise Rerun

        with pytest.raises(Rerun):
            with slots.hold(report=report, poll_s=0.01):
                pass

    h = holding(slots, gate)
    q = threading.Thread(target=quitter)
    q.start()
    q.join()
    assert slots.state() == (1, 0)
    gate.set()
    h.join()
    with slots.hold():   # the slot came back
        assert slots.state() == (1, 0)
    assert slots.state() == (0, 0)


def test_work_under_way_waits_in_line_past_the_limit():
    """The next step of a generation already running is never refused as busy: it waits its turn."""
    slots, gate = Slots(1, queue=0), threading.Event()

    h = holding(slots, gate)
    with pytest.raises(Busy):
        with slots.hold():
            pass
    ran = []
    step = threading.Thread(target=lambda: slots.hold(poll_s=0.01, refuse=False).__enter__() or ran.append(1))
    step.start()
    wait_until(lambda: slots.state() == (1, 1))
    gate.set()
    h.join()
    step.join()
    assert ran == [1]


def test_a_nested_hold_in_the_same_thread_passes_through():
    """A cached computation that calls another (a forward inside a cached function that loads the model) must not
    wait for its own slot."""
    slots = Slots(1, queue=0)
    with slots.hold():
        with slots.hold():
            assert slots.state() == (1, 0)
        assert slots.state() == (1, 0)
    assert slots.state() == (0, 0)


def test_an_error_in_the_body_gives_the_slot_back():
    slots = Slots(1, queue=0)
    with pytest.raises(ZeroDivisionError):
        with slots.hold():
            1 / 0
    assert slots.state() == (0, 0)
    with slots.hold():
        pass


def test_on_idle_runs_when_the_last_computation_ends_and_nobody_waits():
    idle = []
    slots, gate = Slots(2, queue=4, on_idle=lambda s: idle.append(s.state())), threading.Event()
    other = holding(slots, gate)
    with slots.hold():
        with slots.hold():   # (a nested hold ends nothing)
            pass
    assert idle == []        # the other caller still runs
    gate.set()
    other.join()
    assert idle == [(0, 0)]


def test_memory_is_given_back_after_a_quiet_spell_not_between_steps():
    """A generation takes a slot per token: each step ends idle for a moment. The trim waits until nothing has
    started for delay_s, from one thread, and runs once."""
    trims = []
    idle = slots_module.IdleTrim(delay_s=0.5, trim=lambda: trims.append(time.monotonic()))
    slots = Slots(1, queue=4, on_idle=idle)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:   # steps 20 ms apart: never 0.5 s quiet
        with slots.hold():
            pass
        last = time.monotonic()
        time.sleep(0.02)
    assert trims == []
    wait_until(lambda: trims, timeout=10)
    wait_until(lambda: not idle._waiting, timeout=10)   # its one thread has ended
    assert len(trims) == 1 and trims[0] - last >= 0.45   # (no step started in the 0.5 s before it)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(slots_module._TRIM is None, reason="glibc's malloc_trim is not here")
def test_freed_heap_memory_goes_back_to_the_system():
    import torch
    blocks = [torch.ones(16_000) for _ in range(6_000)]   # 64 KB each (under glibc's mmap threshold): 384 MB of heap
    keep = blocks[::50]                                    # a few stay alive, so the heap's top cannot just shrink
    del blocks
    held = rss_mb()
    assert slots_module.give_back_memory()
    assert held - rss_mb() > 200, "malloc_trim gave back less than 200 of about 380 free MB"
    del keep


def test_one_user_may_hold_per_owner_places_and_no_more():
    """Several tabs of one user cannot fill the line: past per_owner running or waiting, that user is told so;
    another user, an unknown one and work under way still get in line; a place left is given back."""
    slots, gate = Slots(1, queue=8, per_owner=2), threading.Event()

    def hold(owner, refuse=True):
        with slots.hold(poll_s=0.01, owner=owner, refuse=refuse):
            gate.wait()

    threads = [threading.Thread(target=hold, args=("ann",))]
    threads[0].start()
    wait_until(lambda: slots.state() == (1, 0))
    threads.append(threading.Thread(target=hold, args=("ann",)))
    threads[1].start()
    wait_until(lambda: slots.state() == (1, 1))
    with pytest.raises(Busy, match="you already have 2"):
        with slots.hold(owner="ann"):
            pass
    for who, refuse in (("bob", True), (None, True), ("ann", False)):
        threads.append(threading.Thread(target=hold, args=(who, refuse)))
        threads[-1].start()
    wait_until(lambda: slots.state() == (1, 4))
    gate.set()
    for t in threads:
        t.join()
    assert slots.state() == (0, 0) and not slots._owners


def test_a_user_who_leaves_the_line_gets_the_place_back():
    slots, gate = Slots(1, queue=8, per_owner=1), threading.Event()
    other = holding(slots, gate)

    def stop(place):
        raise KeyboardInterrupt   # (a rerun: the report raises)

    with pytest.raises(KeyboardInterrupt):
        with slots.hold(report=stop, owner="ann"):
            pass
    assert slots.state() == (1, 0) and not slots._owners
    gate.set()
    other.join()
    with slots.hold(owner="ann"):
        assert slots._owners == {"ann": 1}
