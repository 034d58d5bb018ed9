"""The app's shared model cache (app/model_cache.py): bounded by bytes and idle time, one load per model."""
import threading
import time

import pytest

from app.model_cache import ModelCache


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def cache(budget=100, idle=60.0):
    clock = Clock()
    return ModelCache(budget, idle, clock=clock, size=lambda v: v["bytes"]), clock


def test_least_recently_used_models_go_once_the_budget_is_passed():
    c, clock = cache()
    for key in "abc":
        clock.now += 1
        c.get(key, lambda: {"bytes": 40})
    assert c.keys() == ["b", "c"] and c.total() == 80            # a went: 120 > 100
    clock.now += 1
    c.get("b", lambda: pytest.fail("b was cached"))             # a hit refreshes b
    c.get("d", lambda: {"bytes": 40})
    assert c.keys() == ["b", "d"]                                # c, least recently used, went
    c.get("huge", lambda: {"bytes": 500})
    assert c.keys() == ["huge"]                                  # kept alone: the page needs it


def test_idle_models_go_at_the_next_request_and_failed_loads_cache_nothing():
    c, clock = cache(idle=60)
    c.get("a", lambda: {"bytes": 1})
    clock.now += 61
    c.get("b", lambda: {"bytes": 1})
    assert c.keys() == ["b"]

    def broken():
        raise ValueError("corrupt")
    with pytest.raises(ValueError):
        c.get("x", broken)
    assert c.keys() == ["b"]


def test_two_sessions_asking_for_one_model_load_it_once():
    c = ModelCache(10**9, 60)
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.2)
        return {"model": object()}
    c.size = lambda v: 1
    got = []
    threads = [threading.Thread(target=lambda: got.append(c.get("m", slow))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)
