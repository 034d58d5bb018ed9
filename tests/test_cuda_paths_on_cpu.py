"""What used to break only on CUDA, caught on the CPU.

A GPU trains under bf16 autocast and dispatches to Triton; the app loads models in bfloat16 there. Here the
same dispatch runs with MIXSCOPE_KERNELS=triton (Triton's interpreter, set in conftest) under CPU bf16
autocast, for every mixer with and without pruning and COMPACTER adapters, and every mixer runs inference
in bfloat16 against its float32 self.
"""
import math

import pytest
import torch

import kernels
from models.adapters import set_trainable_params, trainable_params
from models.pruning import pair_count, sparsity_loss
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, EXTRACTORS, cached_logits, randomize, tiny_config

pytest.importorskip("triton")

VARIANTS = {"plain": {}, "pruned": {"prune": True}, "compacter": {"adapter": "compacter", "adapter_reduction": 4},
            "pruned+compacter": {"prune": True, "adapter": "compacter", "adapter_reduction": 4}}


def _step(model, idx, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        res = model(idx[:, :-1], targets=idx[:, 1:])
        loss = res.loss
        if model.config.prune:
            loss = loss + sparsity_loss(res.prune_mass, 0.3, pair_count(model.config.n_layers, idx.shape[1] - 1))
    loss.backward()
    return float(res.loss.detach())


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_bf16_autocast_training_step(mixer, variant, monkeypatch):
    opts = VARIANTS[variant]
    if opts.get("prune") and mixer in EXTRACTORS:
        pytest.skip("context pruning is defined for softmax mixers only")
    model = DecoderLM(tiny_config(mixer, **opts)).train()
    randomize(model, std=0.1)
    if opts.get("prune"):
        model.set_alpha(2.0)
    params = trainable_params(model, freeze_base=bool(opts.get("adapter")))
    set_trainable_params(model, params)
    idx = torch.randint(0, 61, (2, 17))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    want = _step(model, idx, autocast=False)
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")  # the dispatch a GPU takes
    with kernels.record_paths() as paths:
        got = _step(model, idx, autocast=True)
    # training runs the reference, except the pruning rule's keep structure, whose kernels come with their own
    # backward (kernels.triton_keep)
    on_triton = {op for op, path in paths.items() if path == "triton"}
    assert on_triton == ({"log_keep", "log_keep_grad"} if opts.get("prune") else set()), paths
    assert math.isfinite(got) and abs(got - want) < 0.05 * abs(want), (got, want)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained
    missing = [n for n, p in trained if p.grad is None]
    # MHE-ADD's e^K cancels in the softmax (docs/methods.md): no gradient by construction, nothing else may lack one
    assert all("mhe-add" == mixer and "e_k" in n.lower() for n in missing), missing
    assert all(torch.isfinite(p.grad).all() for _, p in trained if p.grad is not None)


@pytest.mark.parametrize("mixer", ALL_MIXERS + ["mha+prune", "mhe-mul+prune"])
def test_bfloat16_inference_follows_float32(mixer, monkeypatch):
    """What the app runs on a GPU (weights in bf16), incremental == full, near the float32 model."""
    mixer, _, prune = mixer.partition("+")
    model = DecoderLM(tiny_config(mixer, n_layers=1, prune=bool(prune))).eval()
    randomize(model, std=0.1)
    if prune:  # a beta that keeps most tokens: bf16 may flip a decision near x = 0, and one flip moves logits
        for b in model.blocks:
            b.mixer.pruning.beta.data.fill_(5.0)
    idx = torch.randint(0, 61, (2, 11))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    with torch.no_grad():
        want = model(idx).logits
        half = model.to(torch.bfloat16)
        full = half(idx).logits.float()
        inc = cached_logits(half, idx, [4, 1, 6])[0].float()
    assert torch.isfinite(full).all() and torch.isfinite(inc).all()
    scale = want.abs().max()
    assert (full - want).abs().max() < 0.05 * scale
    assert (inc - full).abs().max() < 0.05 * scale


def test_gpu_check_says_there_is_no_gpu_here(capsys):
    from bench import gpu_check
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs for real")
    assert gpu_check.main([]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert gpu_check.main(["--only", "app,decode"]) == 1  # parts of the check, for calls of 10 minutes
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "tests,bogus"])
    assert "unknown part(s) bogus" in capsys.readouterr().err


def test_device_choice_refuses_what_is_not_here():
    from models.device import DeviceError, inference_dtype, resolve
    assert resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert inference_dtype(torch.device("cpu")) == torch.float32
    assert inference_dtype(torch.device("cpu"), "bfloat16") == torch.bfloat16
    with pytest.raises(DeviceError, match="unknown device"):
        resolve("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve("cuda")


def test_gpu_check_prepares_the_corpus_only_when_missing_and_says_why_it_could_not(tmp_path, monkeypatch):
    """The device machine reaches no registry: a part that needs the corpus prepares it from the carried copies
    (.corpus/) and, failing that, is skipped with the reason instead of ending the whole check."""
    import subprocess

    from bench import gpu_check
    (tmp_path / "train.npy").write_bytes(b"")
    (tmp_path / "test.txt").write_text("")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("prepared although the corpus is there"))
    assert gpu_check.ensure_corpus(tmp_path) is None
    seen = []

    def failing(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 2, "", "error: could not fetch austen")

    monkeypatch.setattr(subprocess, "run", failing)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".corpus").mkdir()
    why = gpu_check.ensure_corpus(tmp_path / "data")
    assert "could not fetch austen" in why and ".corpus" in why
    assert seen[0][-2:] == ["--cache", ".corpus"] and gpu_check.NEEDS_CORPUS == {"train"}
