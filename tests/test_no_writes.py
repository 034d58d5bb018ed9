"""Nothing writes to a loaded model during inference (app sessions share one): every module's attributes,
parameters (values, version counters, grads, requires_grad) and buffers are the same after a compacted stream()
of a pruned model, an eviction policy (stream and replay) and an attribution as before them."""
import torch

from analysis.attribution import attribute
from models.generate import stream
from models.pruning import policies
from models.pruning.replay import replay
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

SKIP = ("_parameters", "_buffers", "_modules")


def snapshot(model) -> dict:
    out = {}
    for name, m in model.named_modules():
        out[name] = {k: repr(v) for k, v in vars(m).items() if k not in SKIP and not torch.is_tensor(v)}
        out[name]["tensors"] = {k: v.clone() for k, v in vars(m).items() if torch.is_tensor(v)}
        for pn, p in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            out[f"{name}.{pn}"] = (p.detach().clone(), p._version, p.requires_grad, p.grad is None)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert torch.equal(x[0], y[0]) and x[1:] == y[1:], key
        else:
            tx, ty = x.pop("tensors"), y.pop("tensors")
            assert x == y, (key, set(x.items()) ^ set(y.items()))
            assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx), key


def test_inference_leaves_the_model_as_it_was():
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, positions="rope", prune=True, prune_r=4, prune_distance=True,
                                  prune_sinks=2)).eval()
    randomize(model, std=0.3, seed=2)
    with torch.no_grad():
        for b in model.blocks:
            b.mixer.pruning.beta.fill_(0.5)
            b.mixer.pruning.lam.fill_(0.3)
    model.requires_grad_(False)  # as the app loads it
    before = snapshot(model)
    prompt = [3, 9, 4, 17, 5, 22, 8]
    events = list(stream(model, prompt, 12, greedy=True, cache="compacted"))
    assert len(events) == 12 and any(e.drops for e in events)  # the learned rule ran and dropped something
    list(stream(model, prompt, 6, greedy=True, policy=policies.make("tova", 5)))
    replay(model, prompt * 3, policies.make("h2o", 6))
    scores, _, _ = attribute(model, prompt, position=5, steps=4)
    assert scores.shape == (6,)
    assert_same(before, snapshot(model))
