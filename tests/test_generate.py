"""generate(): cache-backed decoding agrees with recomputation; sampling controls do what they say."""
import math

import pytest
import torch

from models.generate import filter_logits, generate
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, randomize, tiny_config


def model_for(mixer="mha", **cfg):
    m = DecoderLM(tiny_config(mixer, **cfg)).eval()
    randomize(m, std=0.3)
    return m


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_greedy_equals_argmax_rollout_without_cache(mixer):
    model = model_for(mixer)
    prompt = [3, 14, 15, 9]
    res = generate(model, prompt, max_new_tokens=8, greedy=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert res.ids == ids
    logp = [model(torch.tensor([ids[:i]])).logits[0, -1].log_softmax(-1)[ids[i]].item() for i in range(4, 12)]
    assert [e.logprob for e in res.events] == pytest.approx(logp, abs=1e-4)
    assert res.perplexity == pytest.approx(math.exp(-sum(logp) / 8), rel=1e-4)
    assert res.cache_bytes > 0


def test_seed_reproducible_and_top_k_one_is_greedy():
    model = model_for()
    a = generate(model, [1, 2], 10, seed=7, temperature=1.5)
    b = generate(model, [1, 2], 10, seed=7, temperature=1.5)
    c = generate(model, [1, 2], 10, seed=8, temperature=1.5)
    assert a.new_ids == b.new_ids and a.new_ids != c.new_ids
    assert generate(model, [1, 2], 10, seed=3, top_k=1).new_ids == generate(model, [1, 2], 10, greedy=True).new_ids
    assert generate(model, [1, 2], 10, temperature=0).new_ids == generate(model, [1, 2], 10, greedy=True).new_ids


def test_filter_logits():
    logits = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15]))
    keep = lambda out: torch.isfinite(out).nonzero().flatten().tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2, top_p=None)) == [0, 2]
    assert keep(filter_logits(logits, top_k=None, top_p=0.5)) == [0]
    assert keep(filter_logits(logits, top_k=None, top_p=0.79)) == [0, 2]
    assert keep(filter_logits(logits, top_k=None, top_p=0.81)) == [0, 2, 3]
    assert keep(filter_logits(logits, top_k=None, top_p=1.0)) == [0, 1, 2, 3]


def test_sampling_respects_top_k():
    model = model_for()
    with torch.no_grad():
        first = model(torch.tensor([[5, 6]])).logits[0, -1]
    allowed = set(torch.topk(first, 3).indices.tolist())
    seen = {generate(model, [5, 6], 1, seed=s, top_k=3, temperature=5.0).new_ids[0] for s in range(40)}
    assert seen <= allowed and len(seen) > 1


def test_stop_token_and_callback():
    model = model_for()
    first = generate(model, [4, 4], 1, greedy=True).new_ids[0]
    res = generate(model, [4, 4], 10, greedy=True, stop_ids=[first])
    assert res.new_ids == [first] and res.stop_reason == "stop_token"
    seen = []
    res = generate(model, [4, 4], 10, greedy=True, callback=lambda e: seen.append(e) or len(seen) < 3)
    assert [e.index for e in seen] == [0, 1, 2] and res.stop_reason == "callback" and len(res.new_ids) == 3
    assert all(e.latency_s > 0 for e in seen)


def test_length_is_clamped_to_the_context_window_with_a_message():
    model = model_for()  # context 24
    res = generate(model, list(range(20)), 50, greedy=True)
    assert len(res.new_ids) == 4 and res.stop_reason == "max_new_tokens"
    assert "clamped to 4" in res.notes[0] and "context window of 24" in res.notes[0]


@pytest.mark.parametrize("prompt,kwargs,message", [
    ([], {}, "empty prompt"),
    (list(range(24)), {}, "prompt has 24 tokens but the context window is 24"),
    ([1], {"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ([1], {"top_p": 0.0}, "top_p must be in"),
    ([1], {"top_k": 0}, "top_k must be at least 1"),
    ([1], {"temperature": -1}, "temperature must be >= 0"),
])
def test_bad_requests(prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model_for(), prompt, **kwargs)


def test_training_mode_is_restored():
    model = model_for().train()
    generate(model, [1], 2)
    assert model.training
