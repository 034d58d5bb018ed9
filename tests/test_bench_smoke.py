"""The benchmarks run end to end at toy sizes (their numbers are not checked: timing is not a unit test)."""
import json

from bench import pruning_decode


def test_pruning_decode_bench_runs(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert pruning_decode.main(["--synthetic", "--contexts", "32,64", "--steps", "3", "--budget-mb", "0.5",
                                "--max-batch", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["context"] for r in res["rows"]] == [32, 64] and res["models"]["kind"] == "synthetic"
    row = res["rows"][1]
    assert 0 < row["pruned_b1"]["kept_fraction"] <= 1 and row["dense_budget"]["batch"] >= 1
    assert row["cache_ratio_pruned_to_dense"] > 0


def test_kernel_bench_runs_quick(tmp_path):
    from kernels import bench
    out = tmp_path / "k.json"
    table = tmp_path / "k.md"
    assert bench.main(["--quick", "--json", str(out), "--table", str(table), "--models", "assets/models/mhe-mul"]) == 0
    assert "| prefill mha t=64 | reference |" in table.read_text()
    res = json.loads(out.read_text())
    assert res["environment"]["device"] and res["floors"]["copy_bytes_per_s"] > 0
    cases = {r["case"] for r in res["rows"]}
    assert {"prefill mhe-mul t=64", "decode mqa ctx=128 batch=2", "lag she s=64 c=128"} <= cases
    assert all(r["x_floor"] > 0 for r in res["rows"] if "ms" in r)
    assert res["end_to_end"][0]["mixer"] == "mhe-mul" and res["end_to_end"][0]["tokens_per_s"] > 0
