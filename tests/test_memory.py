"""models.memory, the one memory planner: its search finds the largest window that fits (against a brute-force scan
over random, non-decreasing needs), a refusal names exactly that window, the budget follows MIXSCOPE_MEMORY_MB, and
its replay limit is the smallest of its terms and the one models.pruning.replay enforces."""
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from models import memory
from models.memory import RUNTIME_BYTES, OverBudget
from models.pruning import replay
from models.transformer import DecoderLM
from tests.helpers import tiny_config

MB = 2 ** 20


def brute_largest(fits, most: int) -> int:
    return max((t for t in range(1, most + 1) if fits(t)), default=0)


def random_need(rng, most: int, limit: int | None = None):
    """A non-decreasing need over 1..most (bytes): random steps, some of them flat, infinite past `limit`."""
    steps = rng.integers(0, 3 * MB, size=most + 1) * (rng.random(most + 1) < 0.7)
    table = np.cumsum(steps)

    def need(cfg, t: int) -> float:
        return float("inf") if limit is not None and t > limit else float(table[t] * cfg.scale)

    return need


def named_window(message: str) -> int | None:
    """The window a refusal names (`--window N` after "fits"), None when it names none."""
    found = re.search(r"fits(?: is|:) --window (\d+)", message)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("seed", range(40))
def test_the_search_is_the_brute_force_scan(seed):
    rng = np.random.default_rng(seed)
    most = int(rng.integers(0, 300))
    edge = int(rng.integers(-1, most + 2))     # fits up to here (none: -1 or 0; all: most and past)
    fits = lambda t: t <= edge   # noqa: E731
    assert memory.largest(fits, most) == brute_largest(fits, most)
    calls = []
    memory.largest(lambda t: calls.append(t) or fits(t), most)
    assert len(calls) <= max(1, math.ceil(math.log2(most + 1)))   # a binary search, not a scan


@pytest.mark.parametrize("seed", range(60))
def test_a_refusal_names_the_largest_window_that_fits(seed):
    rng = np.random.default_rng(100 + seed)
    cfgs = [SimpleNamespace(context=int(rng.integers(8, 400)), scale=float(rng.uniform(0.5, 2)))
            for _ in range(int(rng.integers(1, 4)))]
    context = min(c.context for c in cfgs)
    limit = int(rng.integers(1, 500)) if rng.random() < 0.3 else None
    need = random_need(rng, max(c.context for c in cfgs) + 600, limit)
    resident = int(rng.integers(0, 300)) * MB
    budget = RUNTIME_BYTES + resident + int(rng.integers(0, 400)) * MB
    room = budget - RUNTIME_BYTES - resident

    def fits(t):
        return t <= context and max(need(c, t) for c in cfgs) <= room

    want = brute_largest(fits, context)
    assert memory.largest_window(cfgs, need, resident, budget) == want
    for window in {1, want, want + 1, context, context + 1, int(rng.integers(1, context + 600))} - {0}:
        if window <= want:
            memory.check_window(cfgs, window, need, resident, budget=budget)   # accepted
            continue
        with pytest.raises(OverBudget) as e:
            memory.check_window(cfgs, window, need, resident, budget=budget)
        message = str(e.value)
        assert message.startswith(f"--window {window:,}")
        named = named_window(message)
        if window > context:
            assert f"context is {context:,} tokens" in message and named == (want or None)
        elif want > 1:
            assert named == brute_largest(fits, window) == want
        else:
            assert named is None and "no room for a window" in message
        if window <= context and math.isfinite(max(need(c, window) for c in cfgs)):
            assert f"over the {budget / 2**30:.1f} GB memory budget (MIXSCOPE_MEMORY_MB)" in message
        elif window <= context:
            assert "past what an eviction replay reads at once" in message


def test_the_budget_follows_the_setting(monkeypatch):
    cfg = SimpleNamespace(context=10_000, scale=1.0)
    need = lambda c, t: t * MB   # noqa: E731
    resident = 100 * MB
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "1000")
    assert memory.memory_budget() == 1000 * MB
    room = 1000 * MB - RUNTIME_BYTES - resident
    assert memory.largest_window([cfg], need, resident) == room // MB
    memory.check_window([cfg], room // MB, need, resident)
    with pytest.raises(OverBudget, match=rf"over the 1\.0 GB memory budget .*--window {room // MB}$"):
        memory.check_window([cfg], room // MB + 1, need, resident)
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "2000")                   # read at each call
    assert memory.memory_budget() == 2000 * MB
    assert memory.largest_window([cfg], need, resident) == (room + 1000 * MB) // MB
    memory.check_window([cfg], room // MB + 1, need, resident)
    with pytest.raises(OverBudget):                                      # an explicit budget wins
        memory.check_window([cfg], room // MB + 1, need, resident, budget=1000 * MB)
    monkeypatch.delenv("MIXSCOPE_MEMORY_MB")
    assert memory.memory_budget() == 4096 * MB                          # the default


def test_batch_rows_follow_the_setting(monkeypatch):
    model = DecoderLM(tiny_config("mha", vocab_size=200, context=256)).eval()
    fixed = memory.weights_bytes(model) + RUNTIME_BYTES
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", str((fixed + memory.forward_bytes(model.config, 3, 256)) / MB))
    assert memory.batch_rows(model, 256, 4096) == 3
    assert memory.batch_rows(model, 256, 4096, budget=fixed + memory.forward_bytes(model.config, 5, 256)) == 5
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", str((fixed + memory.forward_bytes(model.config, 1, 256) - 1) / MB))
    assert memory.batch_rows(model, 256, 4096) == 0


def test_the_planned_weights_are_the_built_models():
    cfg = tiny_config("gqa", n_kv_heads=2)
    assert memory.planned_weights(cfg) == 4 * sum(p.numel() for p in DecoderLM(cfg).parameters())


@pytest.mark.parametrize("over", [{}, {"context": 100_000, "n_heads": 9, "n_layers": 30},
                                  {"context": 8192, "n_heads": 2, "n_layers": 2}, {"context": 20}])
@pytest.mark.parametrize("rows, copies", [(1, 1), (3, 3), (9, 1)])
def test_the_replay_limit_is_the_smallest_of_its_terms(over, rows, copies):
    cfg = SimpleNamespace(**{"context": 4096, "n_heads": 4, "n_layers": 4, **over})
    got = memory.replay_tokens(cfg, rows, copies)
    t = got + 1   # one more token breaks one of the terms: the context, the cap, the scores or the masks
    assert (t > cfg.context or t > memory.REPLAY_MAX_TOKENS
            or 4 * cfg.n_heads * copies * t * t > memory.REPLAY_SCORES_BYTES
            or cfg.n_layers * rows * t * t > memory.REPLAY_VISIBLE_BYTES)
    assert 4 * cfg.n_heads * copies * got * got <= memory.REPLAY_SCORES_BYTES
    assert cfg.n_layers * rows * got * got <= memory.REPLAY_VISIBLE_BYTES


def test_the_replay_asks_the_planner(monkeypatch):
    model = DecoderLM(tiny_config("mha"))
    monkeypatch.setattr(memory, "REPLAY_MAX_TOKENS", 10)
    assert replay.replay(model, list(range(10))).logprobs.shape == (9,)
    with pytest.raises(ValueError, match="an eviction replay reads at most 10"):
        replay.replay(model, list(range(11)))


def test_logits_are_counted_whole():
    assert memory.logits_bytes(8192, 49_152) == 4 * 8192 * 49_152
    assert memory.gb(3 * 2 ** 29) == "1.5 GB"
