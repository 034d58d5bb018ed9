"""The benchmarks run end to end at toy sizes (their numbers are not checked: timing is not a unit test)."""
import json
import os
import statistics
from pathlib import Path

import pytest

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
    from bench import kernels as bench
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


def test_kernel_bench_times_only_the_sections_asked_for(tmp_path, capsys):
    from bench import kernels as bench
    out = tmp_path / "k.json"
    assert bench.main(["--quick", "--sections", "compact", "--models", "", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"] and all(r["case"].startswith("compact decode") for r in res["rows"])
    assert res["end_to_end"] == [] and res["dtype"] == "torch.float32"  # a CPU's default
    # --dtype picks the precision timed (float32 on a GPU: the app's default there)
    assert bench.main(["--quick", "--sections", "compact", "--models", "", "--dtype", "bfloat16", "--json",
                       str(out)]) == 0
    assert json.loads(out.read_text())["dtype"] == "torch.bfloat16"
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--sections", "compact,nonsense"])
    assert "unknown sections ['nonsense']" in capsys.readouterr().err


def test_compacted_target_compares_like_with_like():
    """The 5x compacted-decode target reads dense MHA decode timed the same way: launched against launched,
    replayed from a graph against replayed (the keep pass's rows too)."""
    from bench import kernels as bench
    rows = [{"case": "decode mha ctx=16384 batch=1", "impl": "triton", "ms": 0.2},
            {"case": "decode mha ctx=16384 batch=1", "impl": "triton_graph", "ms": 0.1},
            {"case": "compact decode mha ctx=16384 live=0.1 batch=1", "impl": "triton", "ms": 0.1, "live_share": 0.1},
            {"case": "compact decode mha ctx=16384 live=0.1 batch=1", "impl": "triton_graph", "ms": 0.02,
             "live_share": 0.1},
            {"case": "compact decode mha ctx=16384 live=0.1 batch=1", "impl": "triton_graph_keep_pass", "ms": 0.025,
             "live_share": 0.1},
            # the same call's fixed cost, at 64 live slots (replayed only)
            {"case": "compact decode mha ctx=16384 live=0.00390625 batch=1", "impl": "triton_graph", "ms": 0.008,
             "live_share": 64 / 16384}]
    targets = bench.targets(rows)
    got = {t["target"]: (round(t["value"], 6), t["met"]) for t in targets}
    goal = "compact decode mha ctx=16384 live=0.1 batch=1: >= 5x faster than dense MHA decode"
    assert got == {goal: (2.0, False), goal + " (graph replay)": (5.0, True),
                   goal + " (graph replay, keep pass)": (4.0, False)}
    assert [(t["target"], t["fixed_ms"], round(t["ceiling"], 6)) for t in targets if "ceiling" in t] == [
        (goal + " (graph replay)", 0.008, 12.5)]


def test_train_step_profile_runs(tmp_path):
    from bench import train_step_profile
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"mixer": "gqa", "vocab_size": 64, "context": 16, "d_model": 16, "n_layers": 2,
                                         "n_heads": 4, "n_kv_heads": 2, "positions": "rope", "prune": True,
                                         "prune_r": 4},
                               "train": {"batch_size": 2, "freeze_base": True, "eval_stride": 8}}))
    out = tmp_path / "p.json"
    assert train_step_profile.main(["--config", str(cfg), "--alphas", "1,1.02,4", "--steps", "1",
                                    "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert ([(r["model"], r["alpha"]) for r in res["rows"]] == [("dense", None), ("pruned", 1.0), ("pruned", 1.02),
                                                               ("pruned", 4.0)]
            and all(r["step_s"] > 0 and r["top_ops"] for r in res["rows"]))
    # every timed step kept, and the operators each step dispatched: a count, the same at any two tabled alphas
    assert all(len(r["step_s_each"]) == 1 and r["aten_calls"] > 0 and r["weights_finite"] for r in res["rows"])
    assert res["rows"][2]["aten_calls"] == res["rows"][3]["aten_calls"] != res["rows"][1]["aten_calls"]
    # each step's share of its alpha-sigmoid table: none at alpha 1 (a closed form), one table a step on a CPU
    assert res["rows"][1]["table_s_per_step"] == 0
    assert all(r["table_s_per_step"] > 0 and r["tables_per_block"] == 1 for r in res["rows"][2:])
    twin, rule = res["rows"][0], 2 * (2 * 16 * 4 + 1)
    assert twin["rule_params"] == 0 and twin["trainable_params"] > rule        # dense, every parameter training
    assert all(r["rule_params"] == r["trainable_params"] == rule for r in res["rows"][1:])
    assert all(r["vs_dense"] == r["tokens_per_s"] / twin["tokens_per_s"] for r in res["rows"][1:])
    assert "not the rule's overhead" in res["vs_dense_note"]                   # freeze_base: not like for like
    assert res["trainable_params"] == 2 * (2 * 16 * 4 + 1)   # the base is frozen: pruning alone
    assert res["complete"] is True and not os.path.exists(f"{out}.part")   # (written after every row)
    assert res["cuda_graph"] is False and not any(r["cuda_graph"] for r in res["rows"])
    for bad in (["--cuda-graph"], ["--cuda-graph", "--device", "cuda", "--ab-alpha", "2"]):  # (refused before a
        with pytest.raises(SystemExit):                                                      # model is built)
            train_step_profile.main(["--config", str(cfg), *bad])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)
def test_the_profiles_ab_rows_take_each_attention_path(tmp_path, monkeypatch):
    import torch

    """--ab-alpha adds three rows at that alpha, one per MIXSCOPE_CAUSAL_BIAS (0, triton, 1), each with the path its
    attention took: here, in the interpreter, SDPA, our kernels, and SDPA again (PyTorch's kernel is CUDA's)."""
    import kernels
    from bench import train_step_profile
    if "causal_bias" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"mixer": "mha", "vocab_size": 64, "context": 16, "d_model": 16, "n_layers": 1,
                                         "n_heads": 2, "prune": True, "prune_r": 4},
                               "train": {"batch_size": 2, "eval_stride": 8}}))
    out = tmp_path / "p.json"
    assert train_step_profile.main(["--config", str(cfg), "--alphas", "2", "--ab-alpha", "2", "--steps", "1",
                                    "--top", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r.get("causal_bias"), r["kernel_paths"]["attention"]) for r in rows[2:]] == [
        ("0", "reference"), ("triton", "triton"), ("1", "reference")]
    assert [r["causal_bias_off"] for r in rows[2:]] == [True, False, False]

    def broken(*a):
        raise RuntimeError("no kernel image is available")
    monkeypatch.setitem(kernels.TRITON, "causal_bias", broken)  # a path that fails loses its own row only
    assert train_step_profile.main(["--config", str(cfg), "--alphas", "2", "--ab-alpha", "2", "--steps", "1",
                                    "--top", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["causal_bias"] for r in rows[2:]] == ["0", "triton", "1"]
    assert "no kernel image" in rows[3]["error"] and "tokens_per_s" not in rows[3]
    assert rows[4]["kernel_paths"]["attention"] == "reference" and rows[4]["vs_dense"] > 0

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")  # its own memory, freed: the next row runs

    def device_fault(*a):
        raise torch.AcceleratorError("an illegal memory access was encountered")  # the context is gone
    for fails, then in ((out_of_memory, "vs_dense"), (device_fault, "skipped")):
        monkeypatch.setitem(kernels.TRITON, "causal_bias", fails)
        assert train_step_profile.main(["--config", str(cfg), "--alphas", "2", "--ab-alpha", "2", "--steps", "1",
                                        "--top", "1", "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert "error" in rows[3] and then in rows[4] and rows[4]["causal_bias"] == "1", rows[3:]

    def nan_out(q, k, v, bias, scale):  # a path that gives NaN without raising: the weights say so from then on
        return q * float("nan")
    monkeypatch.setitem(kernels.TRITON, "causal_bias", nan_out)
    assert train_step_profile.main(["--config", str(cfg), "--alphas", "2", "--ab-alpha", "2", "--steps", "1",
                                    "--top", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["weights_finite"] for r in rows] == [True, True, True, False, False]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)
def test_a_graphed_profile_row_says_what_replayed(monkeypatch):
    """bench.train_step_profile's rows with --cuda-graph, on the CPU with make_graphed_callables' stand-in
    (tests/test_step_graph.py): a row that replayed says so and carries the paths its capture took (a replay notes
    none); after a failed capture the row ran eagerly and says why."""
    import argparse

    import torch

    import kernels
    from bench import train_step_profile as tsp
    from models.step_graph import GraphedLoss
    from tests.helpers import tiny_config
    from tests.test_step_graph import _Capture
    if "log_keep" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")  # (a graphed table step needs the Triton keep kernel)
    model, opt = tsp.build(tiny_config("mha", prune=True, context=16), False, torch.device("cpu"))
    x = torch.randint(0, 61, (2, 16))
    args = argparse.Namespace(steps=1, clip=1.0, top=3, schedule=(10, 1.0, 8.0))

    def broken(module, sample_args, allow_unused_input=False):
        raise RuntimeError("operation not permitted when stream is capturing")
    for capture in (_Capture(), broken):
        graphed = GraphedLoss(model, [1.5], autocast_dtype=None, capture=capture, min_steps=1)
        row = tsp.profile_row(model, opt, 1.5, x, x, 0.3, 16 * 15, args, graphed)
        if capture is broken:
            assert row["cuda_graph"] is False and "not permitted" in row["capture_failed"]
        else:
            assert row["cuda_graph"] is True and "capture_failed" not in row
            assert row["kernel_paths"]["log_keep"] == "triton"
        assert len(row["step_s_each"]) == 1 and row["table_s_per_step"] > 0


def test_decode_vs_hf_counts_weight_bytes_and_refuses_without_the_model(tmp_path, capsys):
    from bench import decode_vs_hf
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    tied = DecoderLM(tiny_config("mha", vocab_size=300))
    n = sum(p.numel() for p in tied.parameters()) * 4
    assert decode_vs_hf.weight_bytes_per_token(tied) == n
    untied = DecoderLM(tiny_config("mha", vocab_size=300, tie_embeddings=False))
    d = untied.config.d_model
    assert decode_vs_hf.weight_bytes_per_token(untied) == sum(p.numel() for p in untied.parameters()) * 4 - 299 * d * 4
    assert decode_vs_hf.main(["--model", str(tmp_path / "none")]) == 2
    assert "make smollm2" in capsys.readouterr().err


def test_decode_vs_hf_random_weights_convert_exactly():
    """--random-weights: transformers' Llama at random weights and ours converted from it give the same logits
    and the same greedy tokens (a small config; the command builds SmolLM2-135M's)."""
    import torch

    from bench import decode_vs_hf
    small = dict(decode_vs_hf.SMOLLM2, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    pair = decode_vs_hf.random_pair(torch.device("cpu"), seed=3, config=small)
    ours, hf = pair.ours(torch.float32), pair.hf(torch.float32)
    x = torch.tensor([pair.ids])
    with torch.inference_mode():
        assert torch.allclose(ours(x).logits, hf(x).logits, atol=1e-5, rtol=1e-4)
    got, _ = decode_vs_hf.time_ours(ours, pair.ids, 12)
    want, _ = decode_vs_hf.time_hf(hf, pair.ids, 12)
    assert got == want and len(got) == 12


def test_pruning_decode_takes_prompts_from_real_text(tmp_path):
    import numpy as np
    text = np.arange(100, dtype=np.uint16)
    rows = pruning_decode.token_rows(3, 40, 500, text)
    assert rows.shape == (3, 40) and rows[0, 0] == 0 and rows[1, 0] == 40 and rows[2, 0] == 80 % 100
    assert rows[2, 20] == 0  # a short split repeats
    out = tmp_path / "r.json"
    np.save(tmp_path / "test.npy", np.random.default_rng(0).integers(0, 8192, 5000).astype(np.uint16))
    assert pruning_decode.main(["--dense", "assets/models/mha-1024", "--pruned", "assets/models/mha-1024-pruned",
                                "--contexts", "48", "--steps", "2", "--batch1-only", "--data", str(tmp_path),
                                "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["models"]["prompts"].endswith("test.npy, consecutive windows") and "dense_budget" not in res["rows"][0]


def test_decode_zoo_times_a_pruned_model_over_both_caches(tmp_path, monkeypatch):
    from bench import decode_zoo
    out = tmp_path / "z.json"
    monkeypatch.setenv("MIXSCOPE_KEEP_PASS", "1")
    assert decode_zoo.main(["assets/models/mha-1024-pruned", "--tokens", "4", "--repeats", "1",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # (the keep pass's row needs a GPU: the reference decode has none)
    assert [(r["cache"], r.get("keep_pass")) for r in rows] == [("static", None), ("compacted", False)]
    assert all(r["eager_tokens_per_s"] > 0 and r["graphs"] == "no CUDA device" for r in rows)
    assert rows[1]["kernel_paths"]["compact_decode"] == "reference"  # what ran, in the row
    assert os.environ["MIXSCOPE_KEEP_PASS"] == "1"  # the caller's setting is left as it was
    with pytest.raises(Exception):  # ... also when a run fails after one that set it
        decode_zoo.main(["assets/models/mha-1024-pruned", str(tmp_path / "no-such-model"), "--tokens", "2",
                         "--repeats", "1"])
    assert os.environ["MIXSCOPE_KEEP_PASS"] == "1"


def test_gpu_check_records_which_app_packages_the_machine_has():
    """The report's environment names each app package's version, or None where the machine lacks it: what a
    later call must carry."""
    from importlib import metadata

    from bench import gpu_check
    got = gpu_check.installed(("pytest", "mixscope-no-such-distribution"))
    assert got == {"pytest": metadata.version("pytest"), "mixscope-no-such-distribution": None}
    assert set(gpu_check.APP_DISTRIBUTIONS) >= {"streamlit", "plotly", "pandas", "spacy", "captum"}


def test_train_step_profile_sums_the_gpu_kernels_only():
    """A step's busy GPU time is its CUDA events' device time: an operator carries its kernels' time too, and
    would count it twice."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    from bench.train_step_profile import device_busy
    events = [Event(device_type=DeviceType.CPU, self_device_time_total=4000.0, count=1,  # the op of the next
                    key="aten::mm", self_cpu_time_total=30.0),
              Event(device_type=DeviceType.CUDA, self_device_time_total=4000.0, count=2),
              Event(device_type=DeviceType.CUDA, self_device_time_total=500.0, count=3),
              Event(device_type=DeviceType.CPU, self_device_time_total=0.0, count=7, key="aten::add",
                    self_cpu_time_total=70.0)]
    got = device_busy(events, top=1)
    # the host's top operators by self CPU time (where a step that waits on the host spends it), CPU events only
    assert got == {"device_busy_s": 0.0045, "device_kernels": 5,
                   "host_top_ops": [{"op": "aten::add", "self_s": 70e-6, "calls": 7}]}
    assert device_busy(events[:1], top=1) == {}


def test_timeit_graph_waits_for_its_copies_before_the_warm_up(monkeypatch):
    """triton's do_bench_cudagraph warms up on a stream of its own that does not wait for the default one: the
    copies' inputs must be written first (a length read before it was written ran a kernel off its buffers, an
    illegal address on the H200). Recorded here without a GPU: the copies made, then a synchronize, then the bench."""
    import types

    import torch
    import triton.testing

    from bench import kernels as bench
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(L2_cache_size=1 << 20))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: calls.append("synchronize"))

    def fake_bench(fn, rep, return_mode):
        calls.append("bench")
        fn()
        return 2.0
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_bench)

    def make(i):
        calls.append(f"make {i}")
        return lambda: calls.append(f"call {i}")
    s = bench.timeit_graph(make, nbytes=1 << 20, dev=torch.device("cpu"), reps=5, max_copies=2)
    assert calls == ["make 0", "make 1", "synchronize", "bench", "call 0", "call 1"]
    assert s == 2.0 / 1e3 / 2


def test_the_gpu_call_runs_its_parts_in_order_and_packs_after_each(tmp_path):
    """bench/gpu_call.sh in a copy of its folder, `make` and `python3` stubbed: each part runs with its output
    kept, and $OUT/results.tgz holds what the parts wrote under bench/results and their logs, packed after each (a
    later part that fails leaves the earlier results in it). $OUT holds that archive alone (the device tool brings
    back 8 files at most): gpu-check's own archive is removed. --dry-run and a missing $OUT run nothing."""
    import shutil
    import subprocess
    import tarfile
    root = tmp_path / "repo"
    (root / "bench" / "results").mkdir(parents=True)
    shutil.copy("bench/gpu_call.sh", root / "bench")
    (root / "bench" / "results" / "old.json").write_text("{}")  # from before the call: not packed
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "make").write_text('#!/bin/sh\nname=$(echo "$2" | cut -d" " -f2)\necho "ran $name"\n'
                                'echo "{}" > "bench/results/$name.json"\necho x > "$OUT/gpu-results.tar.gz"\n')
    (stubs / "python3").write_text('#!/bin/sh\ncase "$1" in -c) echo h200 ;; *) echo "bench $*"; exit 3 ;; esac\n')
    for s in stubs.iterdir():
        s.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = os.environ | {"PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out)}
    got = subprocess.run(["bash", str(root / "bench" / "gpu_call.sh")], env=env, capture_output=True, text=True)
    assert got.returncode == 1 and ("failed or cut short: kernels16k kernels16k-fp32 train-attention profile-smollm2"
                                    in got.stdout)
    said = [line.split(":")[1].split()[0] for line in got.stdout.splitlines() if "(limit" in line]
    assert said == ["tests", "kernels16k", "kernels16k-fp32", "train-attention", "profile", "profile-smollm2",
                    "decode"]
    assert "kernels16k exit 3" in got.stdout and "kernels_16k_h200.json" in got.stdout
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz"]
    parts = ("tests", "kernels16k", "kernels16k-fp32", "train-attention", "profile", "profile-smollm2", "decode")
    with tarfile.open(out / "results.tgz") as tar:
        assert sorted(tar.getnames()) == sorted([f"bench/results/{p}.json" for p in ("decode", "profile", "tests")]
                                                + [f"bench/results/gpu_call_logs/part-{p}.txt" for p in parts])
        assert tar.extractfile("bench/results/gpu_call_logs/part-tests.txt").read() == b"ran tests\n"
    dry = subprocess.run(["bash", str(root / "bench" / "gpu_call.sh"), "--dry-run"], env=env, capture_output=True,
                         text=True)
    assert dry.returncode == 0 and "ran" not in dry.stdout
    assert "kernels_16k_GPU.json" in dry.stdout and "--models ''" in dry.stdout  # (quoted as a shell would take it)
    missing = subprocess.run(["bash", str(root / "bench" / "gpu_call.sh")], env=env | {"OUT": ""},
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "$OUT" in missing.stdout


def test_a_benchmarks_environment_switch_is_given_back(monkeypatch):
    """bench.env sets a variable for a block and puts back what was there, also when the block raises."""
    from bench import env
    monkeypatch.delenv("MIXSCOPE_TEST_SWITCH", raising=False)
    with env("MIXSCOPE_TEST_SWITCH", "0"):
        assert os.environ["MIXSCOPE_TEST_SWITCH"] == "0"
    assert "MIXSCOPE_TEST_SWITCH" not in os.environ
    monkeypatch.setenv("MIXSCOPE_TEST_SWITCH", "1")
    with pytest.raises(KeyError), env("MIXSCOPE_TEST_SWITCH", "0"):
        raise KeyError
    assert os.environ["MIXSCOPE_TEST_SWITCH"] == "1"
    with env("MIXSCOPE_TEST_SWITCH"):  # (left as it is; a change inside is undone)
        os.environ["MIXSCOPE_TEST_SWITCH"] = "2"
    assert os.environ["MIXSCOPE_TEST_SWITCH"] == "1"


def test_the_gpu_checks_profile_summary_keeps_each_rows_path_and_failure(tmp_path):
    """bench.gpu_check.profile_summary: one line a row (alpha, vs_dense, the switch, the attention path), with a
    failed row's error or a skipped row's reason; nothing from a file older than the run."""
    import time

    from bench.gpu_check import profile_summary
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"causal_bias_refused": None, "rows": [
        {"alpha": None, "kernel_paths": {"attention": "reference"}},
        {"alpha": 2.0, "vs_dense": 0.6, "causal_bias": "1", "kernel_paths": {"attention": "efficient"}},
        {"alpha": 2.0, "causal_bias": "triton", "error": "AcceleratorError: illegal address"},
        {"alpha": 2.0, "causal_bias": "1", "skipped": "after a device fault"}]}))
    rows = profile_summary(path, since=0.0)["rows"]
    assert [(r["alpha"], r["vs_dense"], r["causal_bias"], r["attention"]) for r in rows] == [
        (None, None, None, "reference"), (2.0, 0.6, "1", "efficient"), (2.0, None, "triton", None),
        (2.0, None, "1", None)]
    assert rows[2]["error"].startswith("AcceleratorError") and rows[3]["skipped"] and "error" not in rows[1]
    assert profile_summary(path, since=time.time() + 60) == {}


def test_the_gpu_checks_profile_part_runs_each_path_at_both_batches(tmp_path, monkeypatch):
    """bench.gpu_check --only profile (its processes stubbed, a GPU pretended): eager at batch 8 and 32 with the
    A/B rows, then graphed at both, then graphed at both with our attention kernels, each in a process of its own
    writing its own file, and the report saying what each wrote."""
    import torch

    from bench import gpu_check
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))  # (main sets it to 0: put back)
    calls = []

    def run_module(out, module, *args, env=None):
        calls.append((out.name, module, args, env))
        return {"exit_code": 0, "json": str(out)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "slug", lambda: "gpu")
    monkeypatch.setattr(gpu_check, "environment", lambda: {"date": "today", "torch": torch.__version__})
    monkeypatch.setattr(gpu_check, "run_module", run_module)
    assert gpu_check.main(["--only", "profile", "--results", str(tmp_path)]) == 0
    got = [(name, args[args.index("--batch") + 1], "--cuda-graph" in args, "--ab-alpha" in args,
            (env or {}).get("MIXSCOPE_CAUSAL_BIAS")) for name, _, args, env in calls]
    stem = "train_step_profile_mha-pruned"
    assert got == [(f"{stem}_gpu.json", "8", False, True, None), (f"{stem}_b32_gpu.json", "32", False, True, None),
                   (f"{stem}_graphed_gpu.json", "8", True, False, None),
                   (f"{stem}_graphed_b32_gpu.json", "32", True, False, None),
                   (f"{stem}_graphed_triton_gpu.json", "8", True, False, "triton"),
                   (f"{stem}_graphed_triton_b32_gpu.json", "32", True, False, "triton")]
    assert all(module == "bench.train_step_profile" for _, module, _, _ in calls)
    report = json.loads((tmp_path / "gpu_check_gpu.json").read_text())
    assert report["train_profile_graphed_triton_b32"]["exit_code"] == 0 and report["ok"] is True
    # a split check: a part that failed in an earlier call stays in the report, but fails only that call
    (tmp_path / "gpu_check_gpu.json").write_text(json.dumps(report | {"failed_parts": ["tests"]}))
    assert gpu_check.main(["--only", "profile", "--results", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check_gpu.json").read_text())
    assert report["failed_parts"] == ["tests"] and report["ok"] is False


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)
def test_the_training_attentions_launch_sweep_times_each_candidate_and_puts_the_table_back():
    """bench.kernels.tune_train_attention, in the interpreter at a toy shape in float16: a time for every
    candidate shape of every kernel in every round, its median, its ratio to the table's own shape, and
    triton_causal_bias.LAUNCH as it was afterwards."""
    import torch

    import kernels
    from bench import kernels as bench
    if "causal_bias" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    from kernels import triton_causal_bias as cb
    before = {k: dict(v) for k, v in cb.LAUNCH.items()}
    got = bench.tune_train_attention(torch.device("cpu"), torch.float16, reps=1, b=1, h=2, g=1, d=16, t=20,
                                     rounds=2)
    assert {k: [tuple(r["launch"]) for r in rows] for k, rows in got.items()} == bench.TRAIN_LAUNCH_CANDIDATES
    for rows in got.values():
        for r in rows:
            assert len(r["ms_rounds"]) == 2 and r["ms"] == statistics.median(r["ms_rounds"]) > 0 and r["vs_table"] > 0
        assert rows[0]["vs_table"] == 1.0  # (the table's own shape against itself)
    assert cb.LAUNCH == before
    assert all(bench.TRAIN_LAUNCH_CANDIDATES[k][0] == cb.LAUNCH["half"][k] for k in bench.TRAIN_LAUNCH_CANDIDATES)


def test_the_decode_rows_with_fewer_splits_go_below_the_decodes_own_count_at_small_batches():
    """bench.kernels.fewer_splits: at batch x groups up to 8, a row for each of DECODE_FEWER_SPLITS under the split
    count the decode takes itself (128 at most: MQA at batch 1 over 16k slots), and none above 8 or where the cache
    holds fewer blocks than the smallest count."""
    import torch

    from bench import kernels as bench
    cpu = torch.device("cpu")
    assert bench.fewer_splits(16384, 1, 1, 64, torch.bfloat16, cpu) == {
        f"triton_graph_split{n}": {"n_split": n} for n in (8, 16, 32, 64)}
    assert bench.fewer_splits(16384, 8, 1, 64, torch.bfloat16, cpu) == {"triton_graph_split8": {"n_split": 8}}
    assert bench.fewer_splits(16384, 8, 2, 64, torch.bfloat16, cpu) == {}
    assert bench.fewer_splits(512, 1, 1, 64, torch.bfloat16, cpu) == {}  # (4 blocks of 128 slots: 4 splits)


def test_before_after_runs_each_case_in_both_trees_alternating_which_goes_first(monkeypatch):
    """Both trees take every run, half of the runs each going first, and the greedy tokens are compared."""
    from bench import before_after
    calls = []

    def fake(tree, code):
        calls.append(tree.name)
        return {"rate": 2.0 if tree.name == "new" else 1.0, "ids": [1, 2]}
    monkeypatch.setattr(before_after, "run_case", fake)
    row = before_after.compare("decode x", "code", Path("/old"), Path("/new"), runs=4, decode=True)
    assert calls == ["old", "new", "new", "old", "old", "new", "new", "old"]
    assert row["after_over_before"] == 2.0 and row["median_pair_ratio"] == 2.0 and row["same_tokens"] is True


def test_before_after_decodes_a_toy_model_in_one_tree_against_itself(tmp_path):
    """The case code runs for real (a fresh process loading a shipped model): same tokens in both trees."""
    from bench import before_after
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    assert before_after.main(["--before", str(root), "--after", str(root), "--model",
                              f"mha={root}/assets/models/mha:static", "--runs", "1", "--tokens", "2",
                              "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["same_tokens"] is True and row["median_before"] > 0 and row["median_after"] > 0
