"""docs/benchmarks.md is generated from bench/results/ (python -m bench.summary): the committed page is what the
results give now, every top-level results file appears on it, the latest run per device first."""
import json
from pathlib import Path

from bench import summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_what_the_results_give():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == summary.render(ROOT / "bench" / "results"), \
        "docs/benchmarks.md is stale: run python -m bench.summary and commit the page"
    lines = page.splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] == summary.GENERATED


def test_every_committed_results_file_is_on_the_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    results = ROOT / "bench" / "results"
    missing = [p.name for p in results.iterdir() if p.is_file() and f"`{p.name}`" not in page]
    assert not missing, f"not on docs/benchmarks.md: {missing}"
    archived = [p.name for p in (results / "archive").iterdir() if p.suffix == ".json"]
    assert archived and not [n for n in archived if f"`{n}`" in page]


def write(path: Path, **fields) -> None:
    path.write_text(json.dumps(fields))


def test_a_synthetic_results_directory_latest_per_device_first(tmp_path):
    zoo = {"rows": [{"model": "assets/models/mha", "cache": "static", "ratio": 20.0, "graphs_tokens_per_s": 6000.0,
                     "eager_tokens_per_s": 300.0, "identical_tokens": 128, "tokens": 128}]}
    write(tmp_path / "decode_zoo_h200.json", date="2026-11-28T10:00:00+00:00", device="NVIDIA H200", **zoo)
    write(tmp_path / "decode_zoo_h200_older.json", date="2026-11-20T10:00:00+00:00", device="NVIDIA H200", **zoo)
    write(tmp_path / "decode_zoo_h100.json", date="2026-11-25T10:00:00+00:00", device="NVIDIA H100", **zoo)
    write(tmp_path / "decode_zoo_cpu.json", date="2026-11-29T10:00:00+00:00", device="cpu", cpu="Some CPU", **zoo)
    write(tmp_path / "mystery_cpu.json", date="2026-11-01T00:00:00+00:00", speedup_vs_old=1.5)
    write(tmp_path / "broken_zoo.json", date="2026-11-02T00:00:00+00:00")  # claimed by nothing, no headline
    write(tmp_path / "decode_zoo_h200_nodate.json", device="NVIDIA H200", **zoo)
    (tmp_path / "archive").mkdir()
    write(tmp_path / "archive" / "decode_zoo_h200_ancient.json", date="2026-12-31T00:00:00+00:00",
          device="NVIDIA H200", **zoo)
    (tmp_path / "gpu_tests_h200.txt").write_text("1 passed\n")

    got = summary.entries(tmp_path)
    # the device with the latest run first, each device's latest run first, a run without a date last
    assert [e.file for e in got["decode_zoo"]] == ["decode_zoo_cpu.json", "decode_zoo_h200.json",
                                                   "decode_zoo_h200_older.json", "decode_zoo_h200_nodate.json",
                                                   "decode_zoo_h100.json"]
    assert [e.device for e in got["decode_zoo"]][:2] == ["CPU: Some CPU", "NVIDIA H200"]
    assert "20.00x" in got["decode_zoo"][0].headline

    page = summary.render(tmp_path)
    lines = page.splitlines()
    assert lines[:3] == [summary.TITLE, "", summary.GENERATED]
    for p in tmp_path.iterdir():   # every top-level file, JSON or log, appears; the archive is counted, not listed
        if p.is_file():
            assert f"`{p.name}`" in page, p.name
    assert "decode_zoo_h200_ancient" not in page and "(1 files there now)" in page.replace("\n", " ")
    assert page.index("`decode_zoo_cpu.json`") < page.index("`decode_zoo_h200.json`") \
        < page.index("`decode_zoo_h200_older.json`") < page.index("`decode_zoo_h100.json`")
    assert "## Other results" in page and "speedup_vs_old 1.5" in page and "no headline defined" in page
    assert "| not recorded |" in page  # the file with no date


def test_check_says_whether_the_page_is_stale(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write(results / "train_throughput_cpu.json", date="2026-11-21T00:00:00+00:00", device="cpu (2 threads)",
          tokens_per_s={"ours": 100.0, "nanogpt_reference": 110.0}, ratio_ours_to_reference=100 / 110)
    out = tmp_path / "page.md"
    assert summary.main(["--results", str(results), "--out", str(out), "--check"]) == 1 and not out.exists()
    assert summary.main(["--results", str(results), "--out", str(out)]) == 0
    assert "(0.91x)" in out.read_text() and "CPU (model not recorded)" in out.read_text()
    assert summary.main(["--results", str(results), "--out", str(out), "--check"]) == 0
