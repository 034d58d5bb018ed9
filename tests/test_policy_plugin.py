"""The plug-in example of docs/policies.md: registered from MIXSCOPE_POLICIES, it runs in a replay per KV group (as
its rule says, checked step by step), and the Pruning page offers it."""
from pathlib import Path

import pytest
import torch

from models.pruning import policies
from models.pruning.replay import replay
from tests.test_compact_cache import model_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "docs/examples/scissorhands_policy.py")


@pytest.fixture
def plugin(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_POLICIES", EXAMPLE)
    yield policies.load_plugins(EXAMPLE)
    policies.REGISTRY.pop("scissorhands", None)   # the other tests see the built-in policies only
    import sys
    for k in [k for k in sys.modules if k.startswith("mixscope_policy_")]:
        del sys.modules[k]


def strikes_brute(probs_rows, budget, recent, t):
    """Per row, the positions held after each step, from the rule as docs/examples states it."""
    out = []
    for row in probs_rows:            # row: per step n, {position: attention averaged over the row's heads}
        cache, strikes, held = [], {}, []
        for n in range(t):
            cache.append(n)
            for j in cache:
                strikes[j] = strikes.get(j, 0) + (row[n][j] < 1.0 / len(cache))
            if len(cache) > budget:
                cache.remove(max((j for j in cache if j <= n - recent), key=lambda j: (strikes[j], -j)))
            held.append(set(cache))
        out.append(held)
    return out


def test_the_example_registers_and_evicts_by_its_rule(plugin):
    assert plugin == ["scissorhands"] and "scissorhands" in policies.methods() and policies.load_plugins(EXAMPLE) == []
    model = model_for("gqa", prune=False, context=64, seed=4, n_kv_heads=2)
    ids = [int(i) for i in torch.randint(0, 61, (30,), generator=torch.Generator().manual_seed(1))]
    seen = []
    pol = policies.make("scissorhands", 10, recent=4)
    step = pol.step

    def spy(live, pos, q_pos, probs=None, state=None):
        seen.append({r: {int(pos[r, s]): float(probs[r, :, s].mean()) for s in range(pos.shape[1]) if live[r, s]}
                     for r in range(live.shape[0])})
        return step(live, pos, q_pos, probs, state)
    pol.step = spy
    run = replay(model, ids, pol)
    t = len(ids)
    assert run.visible.shape[:2] == (model.config.n_layers, 2)
    for layer in range(model.config.n_layers):
        per_row = [[seen[layer * t + n][r] for n in range(t)] for r in range(2)]
        want = strikes_brute(per_row, 10, 4, t)
        for r in range(2):
            got = [{j for j in range(n + 1) if run.dropped_at[layer, r, j] < 0 or run.dropped_at[layer, r, j] > n}
                   for n in range(t)]
            assert got == want[r]
    with pytest.raises(ValueError, match="no 'prompt' mode"):
        policies.make("scissorhands:prompt", 10)


def test_the_pruning_page_offers_it(plugin):
    from streamlit.testing.v1 import AppTest
    at = AppTest.from_file(str(ROOT / "app/views/7_Pruning.py"), default_timeout=180)
    at.session_state["model"] = "mha"
    at.run()
    assert not at.exception, at.exception
    at.selectbox(key="prune_method").select("scissorhands").run()
    assert not at.exception, at.exception
    assert any("scissorhands at" in (c.proto.spec or "") for c in at.get("plotly_chart"))
