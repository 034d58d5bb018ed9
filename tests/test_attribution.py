"""Attributions: the hook-free computation equals captum's layer methods at the embedding, integrated gradients
are complete, and nothing is left on the model."""
import pytest
import torch
from captum.attr import LayerGradientXActivation, LayerIntegratedGradients

from analysis.attribution import attribute
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config


def reference(model, ids, target, method, steps):
    """captum's layer methods, hooking a model of our own (the way the app did before)."""
    x = torch.tensor([ids])

    def logprob(inp):
        return model(inp).logits[:, -1].float().log_softmax(-1)[:, target]
    if method == "integrated gradients":
        return LayerIntegratedGradients(logprob, model.wte).attribute(
            x, baselines=torch.zeros_like(x), n_steps=steps, internal_batch_size=steps).sum(-1)[0]
    if method == "gradient x input":
        return LayerGradientXActivation(logprob, model.wte).attribute(x).sum(-1)[0]
    return LayerGradientXActivation(logprob, model.wte, multiply_by_inputs=False).attribute(x).norm(dim=-1)[0]


@pytest.mark.parametrize("method", ["integrated gradients", "gradient x input", "saliency"])
@pytest.mark.parametrize("mixer", ["mha", "mhe-mul", "we"])
def test_equals_captum_layer_methods_and_leaves_no_hooks(mixer, method):
    model = DecoderLM(tiny_config(mixer)).double().eval()
    randomize(model, std=0.2, seed=3)
    ids = torch.randint(0, 61, (9,)).tolist()
    scores, target, _ = attribute(model, ids, 8, None, method, steps=16)
    want = reference(model, ids, target, method, 16)
    torch.testing.assert_close(torch.as_tensor(scores, dtype=torch.float64), want.detach(), rtol=1e-5, atol=1e-7)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


def test_integrated_gradients_are_complete():
    """sum of attributions = f(x) - f(baseline), up to the Riemann error of the path integral."""
    model = DecoderLM(tiny_config("mha")).double().eval()
    randomize(model, std=0.2, seed=4)
    ids = torch.randint(1, 61, (7,)).tolist()
    scores, target, lp = attribute(model, ids, 6, None, "integrated gradients", steps=64)
    with torch.no_grad():
        base = model(torch.zeros(1, 7, dtype=torch.long)).logits[0, -1].log_softmax(-1)[target].item()
    assert scores.sum() == pytest.approx(lp - base, rel=2e-2, abs=2e-3)


def test_budget_chunks_the_steps_and_refuses_what_cannot_fit():
    """A small budget runs integrated gradients a few steps at a time (same scores); a budget below one
    gradient refuses before running, naming the longest prefix that fits; progress reaches 1."""
    from analysis.attribution import TooLarge, bytes_per_sample, max_tokens
    model = DecoderLM(tiny_config("mha")).double().eval()
    randomize(model, std=0.2, seed=3)
    ids = torch.randint(0, 61, (15,)).tolist()
    per = bytes_per_sample(model.config, 15)
    whole, t, _ = attribute(model, ids, 14, method="integrated gradients", steps=12, budget=100 * per)
    seen = []
    chunked, t2, _ = attribute(model, ids, 14, method="integrated gradients", steps=12, budget=3 * per,
                               progress=seen.append)
    assert t == t2 and torch.allclose(torch.tensor(whole), torch.tensor(chunked), atol=1e-10)
    assert seen[-1] == 1.0 and len(seen) >= 4          # 12 steps in chunks of 3
    with pytest.raises(TooLarge, match=f"at most {max_tokens(model.config, per - 1)} tokens"):
        attribute(model, ids, 14, budget=per - 1)
    assert bytes_per_sample(model.config, max_tokens(model.config, per)) <= per


def test_last_only_logits_equal_the_last_row():
    model = DecoderLM(tiny_config("mhe-mul")).eval()
    idx = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        assert torch.allclose(model(idx, last_only=True).logits[:, 0], model(idx).logits[:, -1], atol=1e-6)
    with pytest.raises(ValueError, match="a loss needs them all"):
        model(idx, targets=idx, last_only=True)
