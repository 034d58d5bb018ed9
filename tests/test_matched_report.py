"""analysis.reports.matched: the held-out protocol's numbers equal token-by-token scoring of the same windows."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from analysis.reports import matched
from models.pruning import policies


def test_windows_cost_and_bootstrap_from_their_definitions():
    dense, method = matched.Windows(), matched.Windows()
    rng = np.random.default_rng(1)
    for _ in range(5):
        lp = -rng.uniform(1, 5, 150)
        dense.add(np.tril(np.ones((2, 151, 151), dtype=np.uint8)), lp)
        method.add(np.tril(np.ones((2, 151, 151), dtype=np.uint8)), lp - rng.uniform(0, 0.2, 150))
    every = np.arange(5)
    want = math.exp((sum(method.nll) - sum(dense.nll)) / sum(dense.tokens)) - 1
    assert float(matched.cost(method, dense, every, late=False)) == pytest.approx(want)
    assert sum(method.tokens_late) == 5 * 50 and matched.pooled_sparsity(method, late=False) == 0.0
    rows = {r["method"]: r for r in matched.summary({"dense": dense, "method": method}, "dense", "method", late=True)}
    lo, hi = rows["method"]["cost_ci"]
    assert 0 < lo <= rows["method"]["cost"] <= hi  # every window costs more: the whole interval is above 0
    assert rows["dense"]["cost"] == 0.0


def test_source_windows_spread_over_a_split_or_all_of_a_source(tmp_path):
    for i, split in enumerate(matched.SPLITS):
        np.save(tmp_path / f"{split}.npy", np.full(300, i, dtype=np.uint16))
    test = matched.source_windows(f"{tmp_path}:test", 100, 5)
    assert len(test) == 3 and all(set(w) == {2} for w in test)
    every = matched.source_windows(f"{tmp_path}:all", 100, 4)
    assert [w[0] for w in every] == [0, 1, 1, 2] and all(len(w) == 100 for w in every)
    with pytest.raises(ValueError, match="DIR:SPLIT"):
        matched.source_windows(f"{tmp_path}:nope", 100, 4)


def test_the_report_equals_token_by_token_scoring(tmp_path):
    from models.checkpoint import load_model_dir
    from models.evaluate import score_token_by_token
    stream = np.random.default_rng(0).integers(0, 8192, 300).astype(np.uint16)
    np.save(tmp_path / "test.npy", stream)
    out = tmp_path / "m.md"
    assert matched.main(["assets/models/mha-1024-pruned", "--base", "assets/models/mha-1024",
                         "--source", f"held={tmp_path}:test", "--window", "130", "--windows", "2",
                         "--policies", "streamingllm,tova", "--out", str(out)]) == 0
    text = out.read_text()
    every, late = text.split("## held: positions >= 100")
    windows = [[int(t) for t in stream[i * 130:(i + 1) * 130]] for i in range(2)]
    learned = [score_token_by_token(load_model_dir("assets/models/mha-1024-pruned").model, w) for w in windows]
    dense = [score_token_by_token(load_model_dir("assets/models/mha-1024").model, w) for w in windows]
    ppl = math.exp(sum(r["nll"] for r in learned) / sum(r["tokens"] for r in learned))
    sp = sum(r["sparsity"] * r["tokens"] for r in learned) / sum(r["tokens"] for r in learned)
    row = re.search(r"\| mha-1024-pruned \| - \| ([\d.]+)% \| ([\d.]+) \| ([+-][\d.]+)%", every)
    assert (float(row.group(2)) == pytest.approx(ppl, rel=1e-5)
            and float(row.group(1)) == pytest.approx(100 * sp, abs=0.05))
    dppl = math.exp(sum(r["nll"] for r in dense) / sum(r["tokens"] for r in dense))
    assert float(row.group(3)) == pytest.approx(100 * (ppl / dppl - 1), abs=0.006)
    b = policies.budget_for("tova", sp, 129)
    tova = [score_token_by_token(load_model_dir("assets/models/mha-1024").model, w, policies.make("tova", b))
            for w in windows]
    row = re.search(rf"\| tova \| {b} \| [\d.]+% \| ([\d.]+) \|", every)
    assert row and float(row.group(1)) == pytest.approx(
        math.exp(sum(r["nll"] for r in tova) / sum(r["tokens"] for r in tova)), rel=1e-5)
    assert "(2 windows, 58 scored tokens)" in late  # positions 100..128 of each window predict tokens 101..129
    with pytest.raises(SystemExit):
        matched.main(["assets/models/mha-1024-pruned", "--base", "x", "--source", "bad", "--policies", "snapkv"])


def test_the_prompt_reading_equals_decoding_after_the_prompt(tmp_path, capsys):
    """After a prompt, each policy's row is what decoding makes of the queries after the prompt (SnapKV: the prompt
    in one call, then token by token; TOVA: token by token from the start), at the budget matched to the learned
    rule's sparsity over those queries; the learned rule's row is its own full forward over the same queries."""
    from models.checkpoint import load_model_dir
    from tests.test_replay import decoded
    stream = np.random.default_rng(3).integers(0, 8192, 300).astype(np.uint16)
    np.save(tmp_path / "test.npy", stream)
    out = tmp_path / "m.md"
    assert matched.main(["assets/models/mha-1024-pruned", "--base", "assets/models/mha-1024",
                         "--source", f"held={tmp_path}:test", "--window", "130", "--windows", "2",
                         "--policies", "tova,snapkv-layer", "--prompt-share", "0.5", "--out", str(out)]) == 0
    text = out.read_text()
    assert "--prompt-share 0.5" in text and "after a prompt: the first 65 tokens" in text.lower()
    table = text.split("## held: after a 65-token prompt (2 windows, 128 scored tokens)")[1]
    windows = [[int(t) for t in stream[i * 130:(i + 1) * 130]] for i in range(2)]
    dense = load_model_dir("assets/models/mha-1024").model
    learned = load_model_dir("assets/models/mha-1024-pruned").model
    from analysis import pruning
    runs = [pruning.method_run(learned, w, pruning.LEARNED) for w in windows]
    # query k (65..128) sees (row sum - 1) of its k earlier tokens; mean over layers, queries and windows
    sp = float(np.mean([(1 - (v[:, 0, 65:129].astype(float).sum(-1) - 1) / np.arange(65, 129)).mean()
                        for v, _, _ in runs]))
    for name, prefill in (("tova", 1), ("snapkv-layer", 65)):   # (decoding evicts per layer: per group is replay's)
        b = policies.budget_for(name, sp, 129, 65, first=65)
        row = re.search(rf"\| {name} \| {b} \| [\d.]+% \| ([\d.]+) \|", table)
        assert row, (name, b, table)
        with torch.no_grad():
            lp = torch.cat([decoded(dense, w, policies.make(name, b), prompt=prefill if prefill > 1 else None)[0][65:]
                            for w in windows])
        assert 1 < b < 100
        assert float(row.group(1)) == pytest.approx(math.exp(-float(lp.sum()) / len(lp)), rel=1e-5)
    assert re.search(r"\| mha-1024-pruned \| - \| [\d.]+% \|", table)
    with pytest.raises(SystemExit):  # SnapKV, asked for, needs a prompt
        matched.main(["assets/models/mha-1024-pruned", "--base", "x", "--source", f"held={tmp_path}:test",
                      "--window", "130", "--policies", "snapkv", "--prompt-share", "0"])
    assert "decide after a prompt" in capsys.readouterr().err
    ap = matched.argparse.ArgumentParser()
    matched.add_arguments(ap)
    args = ap.parse_args(["--source", f"held={tmp_path}:test", "--prompt-share", "0"])  # the default policies
    assert matched.parse(ap, args, 130)[1:] == ([m for m in matched.DEFAULT_POLICIES if not policies.once(m)], None)
    for share in ("1", "0.001"):
        with pytest.raises(SystemExit):
            matched.main(["assets/models/mha-1024-pruned", "--base", "x", "--source", f"held={tmp_path}:test",
                          "--window", "130", "--prompt-share", share])


def test_the_verdict_needs_every_policy_interval_above_zero():
    def row(method, lo, sparsity=0.6, windows=24):
        return {"method": method, "sparsity": sparsity, "cost": 0.05, "cost_ci": (0.04, 0.06), "windows": windows,
                "vs_match": lo + 0.01, "vs_match_ci": (lo, lo + 0.02)}

    def results(*rows, budgets=("streamingllm", "tova")):
        return {"src": {"budgets": {b: 10 for b in budgets}, "all": [row("m", 0.0), *rows]}}

    ahead = results(row("streamingllm", 0.02), row("tova", 0.001), row("control", -0.5))  # control: not a policy
    v, = matched.verdict(ahead, "m")
    assert v["beats_all"] and v["bar"] and v["strongest"] == "tova" and v["strongest_lead"][1] == (0.001, 0.021)
    v, = matched.verdict(results(row("streamingllm", 0.02), row("tova", -0.001)), "m")  # a straddling interval
    assert v["beats_all"] is False and v["bar"] is False and v["strongest"] == "tova"
    hindsight = results(row("streamingllm", 0.02), row("tova", 0.001), row("oracle", -0.03),
                        budgets=("streamingllm", "tova", "oracle"))
    v, = matched.verdict(hindsight, "m")   # the oracle reads the future: a reference in the tables, not in the bar
    assert v["bar"] and v["strongest"] == "tova"
    v, = matched.verdict(results(budgets=()), "m")  # nothing to beat
    assert v["beats_all"] is None and v["strongest"] == "-"
    few = {"src": {"budgets": {"tova": 10}, "all": [row("m", 0.0, windows=3), row("tova", 0.5, windows=3)]}}
    assert matched.verdict(few, "m")[0]["bar"] is None  # too few windows to call
    low = {"src": {"budgets": {"tova": 10}, "all": [row("m", 0.0, sparsity=0.4), row("tova", 0.5)]}}
    v, = matched.verdict(low, "m")
    assert v["beats_all"] and v["bar"] is False and v["regime"] is False  # ahead, but below 50 % dropped


def test_the_bar_also_needs_the_prompt_reading():
    def row(method, lo, windows=24):
        return {"method": method, "sparsity": 0.6, "cost": 0.05, "cost_ci": (0.04, 0.06), "windows": windows,
                "vs_match": lo + 0.01, "vs_match_ci": (lo, lo + 0.02)}

    def results(snapkv_lo):
        whole = [row("m", 0.0), row("tova", 0.01)]
        gen = [row("m", 0.0), row("tova", 0.02), row("snapkv", snapkv_lo)]
        return {"src": {"budgets": {"tova": 10}, "all": whole,
                        "prompt": {"length": 50, "budgets": {"tova": 12, "snapkv": 40}, "rows": gen}}}

    v, = matched.verdict(results(0.003), "m")
    assert v["bar"] and v["prompt_beats_all"] and v["prompt_strongest"] == "snapkv" and v["prompt"] == 50
    v, = matched.verdict(results(-0.003), "m")  # ahead on the whole window, not after the prompt
    assert v["beats_all"] and v["prompt_beats_all"] is False and v["bar"] is False


def test_a_policy_that_cannot_reach_the_sparsity_is_reported_not_counted():
    def row(method, lo, sparsity):
        return {"method": method, "sparsity": sparsity, "cost": 0.05, "cost_ci": (0.04, 0.06), "windows": 24,
                "vs_match": lo + 0.01, "vs_match_ci": (lo, lo + 0.02)}

    gen = [row("m", 0.0, 0.87), row("tova", 0.02, 0.874), row("snapkv", -0.01, 0.79)]  # snapkv: its smallest budget
    res = {"src": {"budgets": {"tova": 10}, "all": [row("m", 0.0, 0.66), row("tova", 0.01, 0.66)],
                   "prompt": {"length": 50, "budgets": {"tova": 12, "snapkv": 33}, "rows": gen}}}
    v, = matched.verdict(res, "m")
    assert v["bar"] and v["prompt_beats_all"] and v["prompt_strongest"] == "tova"
    assert v["unmatched"] == [("after the prompt", "snapkv", 0.79, 0.0, (-0.01, 0.01))]
    gen[2]["sparsity"] = 0.865  # within MATCH_GAP: matched, and it ties
    v, = matched.verdict(res, "m")
    assert v["prompt_beats_all"] is False and v["bar"] is False and v["unmatched"] == []


def test_sources_run_apart_and_merged_equal_one_run(tmp_path, capsys, monkeypatch):
    """--json then --merge: two processes each running one source render the tables one run of both makes; runs of
    another protocol, a source in two runs and a file that is not a saved run are refused."""
    for name, seed in (("a", 5), ("b", 6)):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "test.npy", np.random.default_rng(seed).integers(0, 8192, 300).astype(np.uint16))
    common = ["assets/models/mha-1024-pruned", "--base", "assets/models/mha-1024", "--window", "130", "--windows", "2",
              "--policies", "streamingllm,h2o:prompt", "--prompt-share", "0.5"]
    src = {n: ["--source", f"{n}={tmp_path / n}:test"] for n in "ab"}
    assert matched.main(common + src["a"] + src["b"] + ["--out", str(tmp_path / "one.md")]) == 0
    for n in "ab":
        assert matched.main(common + src[n] + ["--out", str(tmp_path / f"{n}.md"),
                                               "--json", str(tmp_path / f"{n}.json")]) == 0
    out = tmp_path / "merged.md"
    assert matched.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    one, merged = (p.read_text().split("\n", 4)[4] for p in (tmp_path / "one.md", out))  # all but the command line
    assert merged == one and "## b: after a 65-token prompt" in merged
    assert "joined by --merge" in out.read_text()
    other = tmp_path / "other.json"
    assert matched.main(common[:-1] + ["0.25"] + src["b"] + ["--out", str(tmp_path / "o.md"),
                                                             "--json", str(other)]) == 0
    for runs, why in (([tmp_path / "a.json", other], "differs from .* in prompt_share"),
                      ([tmp_path / "a.json", tmp_path / "a.json"], "source a is in more than one run"),
                      ([tmp_path / "a.md"], "not a saved run")):
        with pytest.raises(SystemExit):
            matched.main(["--merge", *map(str, runs), "--out", str(tmp_path / "x.md")])
        assert re.search(why, capsys.readouterr().err)
    with pytest.raises(SystemExit):   # a merge runs nothing
        matched.main(["--merge", str(tmp_path / "a.json")] + src["a"])
    assert not (tmp_path / "x.md").exists()
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["weights"] == matched.weights_sha256(["assets/models/mha-1024", "assets/models/mha-1024-pruned"])
    saved["commit"] = "another"    # a run of other code does not merge
    (tmp_path / "c.json").write_text(json.dumps(saved | {"results": {"c": saved["results"]["a"]}}))
    with pytest.raises(SystemExit):
        matched.main(["--merge", str(tmp_path / "b.json"), str(tmp_path / "c.json"), "--out", str(tmp_path / "x.md")])
    assert "in commit" in capsys.readouterr().err
    # a run of some sources saves its results without writing over the whole report
    absolute = [str(Path(a).resolve()) if a.startswith("assets/") else a for a in common]
    monkeypatch.chdir(tmp_path)
    assert matched.main(absolute + src["b"] + ["--json", "only.json"]) == 0
    assert (tmp_path / "only.json").exists() and not (tmp_path / matched.DEFAULT_OUT).exists()
