"""Training writes loadable model directories and resumes exactly; evaluation is the plain loss."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from models import train as train_mod
from models.checkpoint import load_model_dir
from models.config import ConfigError
from models.data import DataError, prepare
from models.evaluate import encode_documents, evaluate_dir, paper_metrics, score_documents, windows
from models.train import batch_offsets, load_run_config, train
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

REPO = Path(__file__).resolve().parent.parent


def tiny_corpus(root: Path) -> Path:
    """A prepared corpus of twelve 400-word texts over 13 words under root (tests/test_gpu.py trains on it too)."""
    texts = root / "texts"
    texts.mkdir()
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home", "."]
    for i in range(12):
        (texts / f"{i}.txt").write_text(" ".join(rng.choice(words, size=400)))
    prepare(root / "data", [], [str(texts)], vocab_size=280, cache=None, min_frequency=1)
    return root / "data"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tiny_corpus(tmp_path_factory.mktemp("corpus"))


def write_config(path, data_dir, mixer="mhe-mul", **train):
    t = {"data": str(data_dir), "steps": 4, "batch_size": 4, "lr": 1e-2, "warmup": 1, "log_interval": 1,
         "eval_interval": 2, "eval_batches": 2, "checkpoint_interval": 2, "eval_stride": 8} | train
    path.write_text(json.dumps({"model": {"mixer": mixer, "vocab_size": 300, "context": 16, "d_model": 16,
                                          "n_layers": 2, "n_heads": 4}, "train": t}))
    return path


def curve(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def strip_time(entries):
    return [{k: v for k, v in e.items() if k not in ("tokens_per_s", "elapsed_s")} for e in entries]


def test_two_step_run_writes_a_loadable_directory(tmp_path, data_dir):
    cfg = write_config(tmp_path / "c.json", data_dir, steps=2)
    card = train(cfg, tmp_path / "m", progress=False)
    loaded = load_model_dir(tmp_path / "m")
    assert loaded.config.mixer == "mhe-mul" and card["steps"] == 2 and card["tokens_seen"] == 2 * 4 * 16
    for key in ("final_train_loss", "final_valid_loss", "test_perplexity", "wall_time_s", "device", "data"):
        assert card[key] is not None
    assert loaded.card["data"]["manifest_sha256"] and not (tmp_path / "m" / "train_state.safetensors").exists()
    res = evaluate_dir(tmp_path / "m", stride=8)
    assert res["perplexity"] == card["test_perplexity"] and res["data_matches_card"] is True


def test_interrupted_run_resumes_to_the_same_curve_and_weights(tmp_path, data_dir):
    cfg = write_config(tmp_path / "c.json", data_dir, steps=6)
    train(cfg, tmp_path / "straight", progress=False)
    assert train(cfg, tmp_path / "resumed", stop_after=3, progress=False)["status"] == "interrupted"
    assert (tmp_path / "resumed" / "train_state.safetensors").exists()
    train(cfg, tmp_path / "resumed", progress=False)
    assert strip_time(curve(tmp_path / "resumed")) == strip_time(curve(tmp_path / "straight"))
    a = load_model_dir(tmp_path / "straight").model.state_dict()
    b = load_model_dir(tmp_path / "resumed").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_killed_process_resumes_to_the_same_curve(tmp_path, data_dir):
    cfg = write_config(tmp_path / "c.json", data_dir, steps=40, checkpoint_interval=5, eval_interval=10)
    train(cfg, tmp_path / "straight", progress=False)
    cmd = [sys.executable, "-m", "models.train", "--config", str(cfg), "--out", str(tmp_path / "k")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp_path / "k" / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and sum(1 for _ in log.open()) > 14):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "k" / "train_state.safetensors").exists(), "killed before the first checkpoint"
    assert subprocess.run(cmd, cwd=REPO, capture_output=True).returncode == 0
    assert strip_time(curve(tmp_path / "k")) == strip_time(curve(tmp_path / "straight"))


def test_same_seed_same_batches_for_every_variant():
    a = [batch_offsets(7, s, 10_000, 16, 4) for s in range(5)]
    assert all(np.array_equal(x, y) for x, y in zip(a, [batch_offsets(7, s, 10_000, 16, 4) for s in range(5)]))
    assert not np.array_equal(a[0], a[1]) and not np.array_equal(a[0], batch_offsets(8, 0, 10_000, 16, 4))


def test_lr_schedule():
    tc = train_mod.TrainConfig(steps=100, warmup=10, lr=1.0, min_lr=0.1)
    assert train_mod.lr_at(0, tc) == pytest.approx(0.1) and train_mod.lr_at(9, tc) == pytest.approx(1.0)
    assert train_mod.lr_at(100, tc) == pytest.approx(0.1)
    assert all(train_mod.lr_at(s, tc) >= train_mod.lr_at(s + 1, tc) for s in range(10, 100))


def test_head_embeddings_and_lag_weights_are_not_decayed():
    model = DecoderLM(tiny_config("mhe-mul"))
    decay, no_decay = train_mod.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert any(names[id(p)].endswith("e_Q") for p in no_decay["params"])
    assert all(p.dim() >= 2 for p in decay["params"])


def test_bad_configs(tmp_path, data_dir):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "missing.json")
    bad = write_config(tmp_path / "c.json", data_dir, mixer="transformer-xl")
    with pytest.raises(ConfigError, match="unknown mixer 'transformer-xl'"):
        load_run_config(bad)
    (tmp_path / "b.json").write_text(json.dumps({"base": "b.json"}))
    with pytest.raises(ConfigError, match="loops back"):
        load_run_config(tmp_path / "b.json")
    with pytest.raises(ConfigError, match="eval_stride"):
        load_run_config(write_config(tmp_path / "s.json", data_dir, eval_stride=99))
    with pytest.raises(DataError, match="run `python -m models.data prepare"):
        train(write_config(tmp_path / "e.json", tmp_path / "empty"), tmp_path / "m", progress=False)
    with pytest.raises(ConfigError, match="cuda_graph captures the plain step"):
        load_run_config(write_config(tmp_path / "g.json", data_dir, cuda_graph=True, compile=True))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)
def test_cuda_graph_off_a_gpu_runs_the_same_eager_steps_and_says_so(tmp_path, data_dir, caplog, monkeypatch):
    """train.cuda_graph (models/step_graph.py) needs CUDA: here the run says it runs eagerly, and its curve (LM loss,
    alpha, the soft kept fraction from the sparsity mass) and weights are those of the run without it. The loop's
    graphed branch, run with make_graphed_callables' stand-in (tests/test_step_graph.py), gives them too. The keep
    structure on Triton (the interpreter) in all three, as a graphed table step needs."""
    from models.step_graph import GraphedLoss
    from tests.test_step_graph import _Capture
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    runs, stand_ins = {}, []

    def stand_in(model, tc, dev, world, start):
        stand_ins.append(GraphedLoss(model, train_mod.schedule_alphas(tc.steps, tc.steps, tc.alpha_start,
                                                                      tc.alpha_end),
                                     autocast_dtype=None, capture=_Capture(), min_steps=1))
        return stand_ins[-1]
    for name, graph in (("eager", False), ("said", True), ("branch", True)):
        # three steps of four, then stopped with the state saved: no evaluation (the interpreter is slow at it)
        cfg = write_config(tmp_path / f"{name}.json", data_dir, mixer="mha", steps=4, cuda_graph=graph,
                           eval_interval=100, checkpoint_interval=100)
        raw = json.loads(cfg.read_text())
        raw["model"] |= {"prune": True, "prune_r": 8}
        cfg.write_text(json.dumps(raw))
        if name == "branch":
            monkeypatch.setattr(train_mod, "graphed_loss", stand_in)
        with caplog.at_level("WARNING"):
            assert train(cfg, tmp_path / name, stop_after=3, progress=False)["status"] == "interrupted"
        runs[name] = strip_time(curve(tmp_path / name)), load_file(tmp_path / name / train_mod.STATE)
    assert "cuda_graph needs one CUDA process" in caplog.text
    assert stand_ins and stand_ins[0].graphs.keys() == {"sigmoid", "table"} and stand_ins[0].slot.alpha is not None
    log_eager, eager = runs["eager"]
    assert len(log_eager) == 3 and all("kept_fraction_soft" in e for e in log_eager)
    for name in ("said", "branch"):  # the curve, and the weights and optimizer state after three steps
        log_other, other = runs[name]
        assert log_other == log_eager, name
        assert eager.keys() == other.keys() and all(torch.equal(eager[k], other[k]) for k in eager), name


def test_base_config_is_merged(tmp_path):
    (tmp_path / "base.json").write_text(json.dumps({"model": {"d_model": 32, "n_heads": 4}, "train": {"steps": 9}}))
    (tmp_path / "v.json").write_text(json.dumps({"base": "base.json", "model": {"mixer": "we"}}))
    model_cfg, tc, _ = load_run_config(tmp_path / "v.json")
    assert (model_cfg.mixer, model_cfg.d_model, tc.steps) == ("we", 32, 9)


def test_zoo_configs_share_one_base():
    for path in sorted((REPO / "configs" / "zoo").glob("*.json")):
        if path.name != "base.json":
            model_cfg, tc, raw = load_run_config(path)
            assert set(raw["model"]) - {"mixer"} == set(json.loads((path.parent / "base.json").read_text())["model"])
            assert model_cfg.mixer == path.stem


@pytest.mark.parametrize("n,context,stride", [(2, 8, 8), (30, 8, 8), (30, 8, 3), (9, 8, 1), (100, 16, 5)])
def test_windows_score_every_target_once(n, context, stride):
    ws = windows(n, context, stride)
    scored = []
    for b, e, k in ws:
        assert 0 < e - b <= context and 0 < k <= e - b
        scored += list(range(e - k, e))                       # target t predicts token t+1
        for t in range(e - k, e):
            assert t - b + 1 >= min(t + 1, context - stride + 1)  # history the window gives target t
    assert scored == list(range(n - 1))


def test_windows_of_an_empty_document():
    assert windows(1, 8, 4) == [] and windows(0, 8, 4) == []


def test_score_matches_direct_loss_and_sliding_history():
    model = DecoderLM(tiny_config("mha", vocab_size=40, context=8)).double().eval()
    randomize(model, std=0.3)
    docs = [list(np.random.default_rng(1).integers(0, 40, size=n)) for n in (5, 8, 9, 23)]
    # stride == context == whole doc for short docs: the plain next-token loss
    short = docs[:2]
    res = score_documents(model, short, stride=8)
    with torch.no_grad():
        nll = sum(F.cross_entropy(model(torch.tensor([d[:-1]])).logits[0], torch.tensor(d[1:]),
                                  reduction="sum").item() for d in short)
    assert res["tokens"] == 4 + 7 and res["nll"] == pytest.approx(nll, rel=1e-9)
    # a long doc with stride 3: each target scored with exactly the history its window gives
    doc = docs[3]
    res = score_documents(model, [doc], stride=3)
    want = window_nll(model, doc, 8, 3)
    assert res["nll"] == pytest.approx(want, rel=1e-9) and res["tokens"] == 22
    assert res["perplexity"] == pytest.approx(math.exp(want / 22))
    # a window shorter than the context: the same windows as a model of that context
    res = score_documents(model, [doc], stride=3, window=5)
    assert res["nll"] == pytest.approx(window_nll(model, doc, 5, 3), rel=1e-9) and res["tokens"] == 22


def window_nll(model, doc, context, stride):
    """Each target scored with exactly the history its window gives, summed."""
    want = 0.0
    with torch.no_grad():
        for b, e, k in windows(len(doc), context, stride):
            logp = model(torch.tensor([doc[b:e]])).logits[0].log_softmax(-1)
            want -= sum(logp[i, doc[b + i + 1]].item() for i in range(e - b - k, e - b))
    return want


def test_paper_metrics():
    m = paper_metrics(ppl=110.0, attn_params=300, mha=(100.0, 1200), sha=(120.0, 100))
    assert m["prr"] == pytest.approx(0.9)
    assert m["peop"] == pytest.approx(-((110 / 120) - 1) / ((300 / 100) - 1))
    assert paper_metrics(120.0, 100, None, (120.0, 100)) == {"prr": None, "peop": None}


def test_encode_documents_starts_each_with_eos(data_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    docs = encode_documents(tok, ["the cat", "a dog"])
    assert all(d[0] == tok.token_to_id("<|endoftext|>") for d in docs)


@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path, data_dir):
    cfg = write_config(tmp_path / "c.json", data_dir, mixer="mhe-add", steps=4)
    train(cfg, tmp_path / "one", progress=False)
    torchrun = Path(sys.executable).parent / "torchrun"
    res = subprocess.run([str(torchrun), "--nproc_per_node", "2", "-m", "models.train", "--config", str(cfg),
                          "--out", str(tmp_path / "two")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    for a, b in zip(curve(tmp_path / "one"), curve(tmp_path / "two")):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_pruning_fine_tune_starts_from_the_dense_model(tmp_path, data_dir):
    dense_cfg = write_config(tmp_path / "dense.json", data_dir, mixer="mha", steps=3)
    train(dense_cfg, tmp_path / "dense", progress=False)
    raw = json.loads(dense_cfg.read_text())
    raw["model"] |= {"prune": True, "prune_r": 8}
    raw["train"] |= {"init_from": str(tmp_path / "dense"), "steps": 3, "lr": 1e-12, "min_lr": 1e-12, "gamma": 5.0}
    (tmp_path / "pruned.json").write_text(json.dumps(raw))
    card = train(tmp_path / "pruned.json", tmp_path / "pruned", progress=False)
    dense = load_model_dir(tmp_path / "dense").model.state_dict()
    pruned = load_model_dir(tmp_path / "pruned").model.state_dict()
    assert {k for k in pruned if k not in dense} == {k for k in pruned if ".pruning." in k}
    assert all(torch.allclose(dense[k], pruned[k], atol=1e-6) for k in dense)   # lr ~ 0: the dense weights carried over
    train_lines = [e for e in curve(tmp_path / "pruned") if e["kind"] == "train"]
    assert train_lines[0]["alpha"] == pytest.approx(1.0) and 0 < train_lines[-1]["kept_fraction_soft"] <= 1
    assert (0 <= card["final_valid_query_sparsity"] <= 1
            and [e for e in curve(tmp_path / "pruned") if "query_sparsity" in e])
    raw["model"]["d_model"] = 32
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"differs in d_ff .*d_model \(16 vs 32\)"):
        train(tmp_path / "bad.json", tmp_path / "bad", progress=False)


def test_compacter_fine_tune_trains_only_adapters_and_norms(tmp_path, data_dir):
    dense_cfg = write_config(tmp_path / "dense.json", data_dir, mixer="mhe-mul", steps=2)
    train(dense_cfg, tmp_path / "dense", progress=False)
    raw = json.loads(dense_cfg.read_text())
    raw["model"] |= {"adapter": "compacter", "adapter_reduction": 4, "phm_n": 2}
    raw["train"] |= {"init_from": str(tmp_path / "dense"), "steps": 2}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    train(tmp_path / "c.json", tmp_path / "c", progress=False)
    dense = load_model_dir(tmp_path / "dense").model.state_dict()
    tuned = load_model_dir(tmp_path / "c").model.state_dict()
    changed = {k for k in dense if not torch.equal(dense[k], tuned[k])}
    assert changed and all(".ln_" in k or k.startswith("ln_f") for k in changed)
    assert any("adapter" in k for k in tuned)


def test_frozen_base_trains_pruning_alone_and_a_rotary_context_may_shrink(tmp_path, data_dir):
    dense_cfg = write_config(tmp_path / "dense.json", data_dir, mixer="mha", steps=2)
    raw = json.loads(dense_cfg.read_text())
    raw["model"] |= {"positions": "rope", "context": 16}
    dense_cfg.write_text(json.dumps(raw))
    train(dense_cfg, tmp_path / "dense", progress=False)
    raw["model"] |= {"prune": True, "prune_r": 8, "context": 12}
    raw["train"] |= {"init_from": str(tmp_path / "dense"), "steps": 3, "freeze_base": True, "eval_stride": 6,
                     "prune_init": "calibrated"}
    (tmp_path / "p.json").write_text(json.dumps(raw))
    card = train(tmp_path / "p.json", tmp_path / "p", progress=False)
    assert len(card["prune_calibration_rms"]) == 2 and all(r > 0 for r in card["prune_calibration_rms"])
    dense = load_model_dir(tmp_path / "dense").model.state_dict()
    tuned = load_model_dir(tmp_path / "p").model.state_dict()
    assert all(torch.equal(dense[k], tuned[k]) for k in dense)                 # the base did not move
    assert card["trainable_params"] == sum(v.numel() for k, v in tuned.items() if ".pruning." in k)
    raw["model"]["prune"] = False
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="freeze_base trains context pruning alone"):
        train(tmp_path / "bad.json", tmp_path / "bad", progress=False)
    learned = write_config(tmp_path / "l.json", data_dir, mixer="mha", steps=2)
    train(learned, tmp_path / "l", progress=False)
    raw = json.loads(learned.read_text())
    raw["model"] |= {"context": 12}
    raw["train"] |= {"init_from": str(tmp_path / "l"), "eval_stride": 6}
    (tmp_path / "l2.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"differs in context \(16 vs 12\)"):
        train(tmp_path / "l2.json", tmp_path / "l2", progress=False)


def test_distillation_trains_the_rule_terms_against_the_frozen_base(tmp_path, data_dir):
    """train.distill: the loss is the KL to the same model with its rule off; the base stays put, the distance term's
    lambda and beta learn (in their own group at lr x scalar_lr_mult), and the run logs the KL beside the LM loss."""
    dense_cfg = write_config(tmp_path / "dense.json", data_dir, mixer="gqa", steps=2)
    raw = json.loads(dense_cfg.read_text())
    raw["model"] |= {"positions": "rope", "n_kv_heads": 2}
    dense_cfg.write_text(json.dumps(raw))
    train(dense_cfg, tmp_path / "dense", progress=False)
    raw["model"] |= {"prune": True, "prune_r": 8, "prune_distance": True, "prune_sinks": 2}
    raw["train"] |= {"init_from": str(tmp_path / "dense"), "steps": 3, "freeze_base": True, "distill": True,
                     "scalar_lr_mult": 10.0, "prune_init": "calibrated", "gamma": 2.0}
    (tmp_path / "p.json").write_text(json.dumps(raw))
    card = train(tmp_path / "p.json", tmp_path / "p", progress=False)
    tuned = load_model_dir(tmp_path / "p")
    dense = load_model_dir(tmp_path / "dense").model.state_dict()
    state = tuned.model.state_dict()
    assert all(torch.equal(dense[k], state[k]) for k in dense)
    assert all(float(state[f"blocks.{i}.mixer.pruning.lam"]) != 0.0 for i in range(2))
    assert tuned.config.prune_sinks == 2 and card["train"]["distill"] is True
    entries = [e for e in curve(tmp_path / "p") if e["kind"] == "train"]
    # the rule starts keeping almost everything, so the KL is ~1e-7: float32 rounding of its sum over the vocabulary
    # can land just below 0 (a full run on a clean clone saw it), never further than rounding
    assert all(e["kl"] > -1e-5 and math.isfinite(e["kl"]) for e in entries)
    raw["train"]["freeze_base"] = False
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="distill learns a pruning rule"):
        train(tmp_path / "bad.json", tmp_path / "bad", progress=False)
