"""The bounded load test on the loopback (bench/load_sessions.py): eight browser sessions across pages on two SmolLM2
models, asked together, against the same sessions alone. Slow (about 4 minutes, `make test-all`), and it needs the
SmolLM2 model directory (`make smollm2`) and its pruned delta's base (`make fetch`)."""
import json
from pathlib import Path

import pytest

from models.delta import unfetched_base

pytestmark = [pytest.mark.slow, pytest.mark.browser]
MODELS = Path(__file__).resolve().parent.parent / "assets" / "models"


@pytest.mark.timeout(1800)
def test_eight_sessions_at_once_compute_what_each_computes_alone(tmp_path, monkeypatch):
    from tests.conftest import USER_CACHE
    monkeypatch.setenv("MIXSCOPE_CACHE", USER_CACHE)   # (the fetched bases: the other tests see an empty cache)
    dense, pruned = MODELS / "smollm2-135m", MODELS / "smollm2-pruned-window"
    if not (dense / "model.safetensors").is_file() or unfetched_base(pruned):
        pytest.skip("SmolLM2 is not here: `make smollm2` and `make fetch` bring it")
    from bench import load_sessions
    out = tmp_path / "load.json"
    assert load_sessions.main(["--model", str(dense), "--pruned", str(pruned), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sessions"] == 8 and result["errors"] == 0
    assert result["all_numbers_equal"], [r for r in result["sessions_detail"] if not r["same_numbers"]]
    assert result["server_peak_mb"] < 6 * 1024
