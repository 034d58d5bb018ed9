"""Nothing a user has is overwritten, and nothing one app session does is visible to another."""
import threading

import pytest
import torch

import kernels
from models.config import ConfigError
from models.generate import make_sampler
from models.train import main as train_main
from models.train import train
from tests.test_train_eval import curve, data_dir, write_config  # noqa: F401  (data_dir is a fixture)


def test_training_refuses_a_finished_model_and_resumes_only_an_unfinished_run(tmp_path, data_dir, capsys):  # noqa: F811
    cfg = write_config(tmp_path / "c.json", data_dir, steps=2)
    out = tmp_path / "m"
    train(cfg, out, progress=False)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError, match="already holds a model.*--overwrite"):
        train(cfg, out, progress=False)
    assert train_main(["--config", str(cfg), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files          # not a byte changed
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train(cfg, tmp_path / "file", progress=False)
    longer = write_config(tmp_path / "c4.json", data_dir, steps=4)
    card = train(longer, out, progress=False, overwrite=True)               # asked: replaced, from scratch
    assert card["steps"] == 4 and [e["step"] for e in curve(out) if e["kind"] == "train"] == [1, 2, 3, 4]
    partial = tmp_path / "p"
    assert train(longer, partial, progress=False, stop_after=2)["status"] == "interrupted"
    assert train(longer, partial, progress=False)["steps"] == 4              # an unfinished run resumes


def test_a_random_seed_does_not_touch_the_global_generator():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    sample = make_sampler("cpu", greedy=False, temperature=1.0, top_k=None, top_p=None, seed=None)
    sample(torch.zeros(5, 10))
    assert torch.equal(torch.rand(3), want)


def test_kernel_paths_are_seen_only_by_the_caller():
    q = torch.randn(1, 2, 3, 4)
    seen, barrier = {}, threading.Barrier(2)

    def session(name, calls):
        with kernels.record_paths() as paths:
            barrier.wait()
            for op in calls:
                if op == "attention":
                    kernels.attention(q, q, q, scale=0.5)
                else:
                    kernels.lag_conv(torch.randn(1, 5, 3), torch.randn(5, 3))
            seen[name] = dict(paths)

    threads = [threading.Thread(target=session, args=("a", ["attention"] * 20)),
               threading.Thread(target=session, args=("b", ["lag_conv"] * 20))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": {"attention": "reference"}, "b": {"lag_conv": "reference"}}
    kernels.attention(q, q, q, scale=0.5)   # outside any recording nothing is kept anywhere
    with kernels.record_paths() as paths:
        pass
    assert paths == {}


def test_inference_on_a_shared_model_writes_nothing_to_it():
    """App sessions share one model object: evaluating() on a model already in inference mode must not flip
    any module's mode (another session may be mid-forward)."""
    from models.transformer import DecoderLM, evaluating
    from tests.helpers import tiny_config
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=4)).eval()

    def no_writes(mode=True):
        raise AssertionError("train()/eval() called on a shared model")
    for m in model.modules():
        m.train = no_writes
    with evaluating(model):
        model(torch.randint(0, 61, (1, 5)))
    assert not model.training
