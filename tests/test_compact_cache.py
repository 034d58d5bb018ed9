"""The compacted pruning cache: exact against the full forward, ragged batches, drops with triggers, memory."""
import pytest
import torch

from models.decode import Decoder
from models.pruning import drop_records
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config


def model_for(mixer, prune=True, beta=0.02, seed=5, **cfg):
    m = DecoderLM(tiny_config(mixer, prune=prune, prune_r=8, **cfg)).double().eval()
    randomize(m, std=0.2, seed=seed)
    if prune:
        for b in m.blocks:
            with torch.no_grad():
                b.mixer.pruning.beta.fill_(beta)
    return m


def run_compact(model, seqs, prompt_lens, diagnostics=False):
    """Prefill ragged prompts in one padded call, then one token per row per step; logits per row/position."""
    b, total = len(seqs), len(seqs[0])
    dec = Decoder(model, b, "compacted", ragged=True)
    got = [dict() for _ in range(b)]
    with torch.no_grad():
        logits = dec.prefill([s[:n] for s, n in zip(seqs, prompt_lens)], last_only=False)
    for r, n in enumerate(prompt_lens):
        for p in range(n):
            got[r][p] = logits[r, p]
    cur = list(prompt_lens)
    while min(cur) < total:
        tokens = torch.tensor([seqs[r][min(cur[r], total - 1)] for r in range(b)])
        with torch.no_grad():
            out = dec.step(tokens, active=[c < total for c in cur])
        for r in range(b):
            if cur[r] < total:
                got[r][cur[r]] = out[r]
                cur[r] += 1
    return got, dec.state


def compact_on_triton_and_full(model, monkeypatch, n=14, prompt_lens=(5, 9, 3)):
    """Ragged prompts decoded over the compacted cache with the Triton kernels forced, and the reference full
    forward of each row: ([(got [n, V], full [n, V]) per row], cache). The CPU interpreter and the GPU tests
    share it."""
    import kernels
    dev = model.wte.weight.device
    seqs = torch.randint(0, 61, (len(prompt_lens), n)).tolist()
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    with kernels.record_paths() as paths:
        got, cache = run_compact(model, seqs, list(prompt_lens))
    assert paths["compact_decode"] == "triton"
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    pairs = []
    for r, seq in enumerate(seqs):
        with torch.no_grad():
            full = model(torch.tensor([seq], device=dev)).logits[0]
        pairs.append((torch.stack([got[r][p] for p in range(n)]), full))
    return pairs, cache


def assert_ragged_equals_full(model, n=16, prompt_lens=(5, 9, 3)):
    """Ragged prompts decoded together over the compacted cache give, row by row, the full forward's logits."""
    seqs = torch.randint(0, 61, (len(prompt_lens), n)).tolist()
    got, cache = run_compact(model, seqs, list(prompt_lens))
    for r, seq in enumerate(seqs):
        with torch.no_grad():
            full = model(torch.tensor([seq])).logits[0]
        torch.testing.assert_close(torch.stack([got[r][p] for p in range(n)]), full, rtol=1e-6, atol=1e-6)
    return seqs, cache


@pytest.mark.parametrize("prune", [True, False], ids=["pruned", "dense"])
@pytest.mark.parametrize("mixer", ["mha", "mqa", "skv", "mhe-add", "el-att"])
def test_ragged_batch_equals_full_forward_per_row(mixer, prune):
    model = model_for(mixer, prune)
    seqs, cache = assert_ragged_equals_full(model)
    if prune:
        assert len(cache.layers[0].drop_table()) > 0   # this setting does drop tokens


def assert_drops_match_full_forward(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each layer's compacted drop table (token, trigger) for equal-length rows == the full forward's drop records
    (models.pruning.drop_records) row by row; returns those records' `dropped` masks for further checks."""
    n = len(seqs[0])
    _, cache = run_compact(model, seqs, [n] * len(seqs))
    masks = []
    for layer in range(model.config.n_layers):
        got = {(int(b), int(p)): int(t) for b, p, t in cache.layers[layer].drop_table()}
        for r, seq in enumerate(seqs):
            with torch.no_grad():
                keep = model(torch.tensor([seq]), diagnostics=True).diagnostics[layer].keep
            step, dropped = drop_records(keep)
            want = {(r, j): int(step[0, j]) for j in range(n) if dropped[0, j]}
            assert {k: v for k, v in got.items() if k[0] == r} == want
            masks.append(dropped)
    return masks


def test_drops_and_triggers_match_the_full_forward():
    assert_drops_match_full_forward(model_for("mha"), torch.randint(0, 61, (2, 18)).tolist())


def test_memory_is_freed_when_tokens_drop():
    model = model_for("mha", beta=-3.0, seed=1, context=128)
    seq = torch.randint(0, 61, (2, 100)).tolist()
    _, cache = run_compact(model, seq, [4, 4])
    static = model.new_cache(batch=2, capacity=100)   # the dense static cache holding the same 100 tokens
    with torch.no_grad():
        model(torch.tensor(seq), cache=static)
    layer = cache.layers[0]
    assert layer.compactions > 0 and layer.end < 50 and layer.capacity < 100
    assert cache.nbytes() < 0.6 * static.nbytes()


def test_capacity_doubles_when_full():
    model = model_for("mha", prune=False)
    seq = torch.randint(0, 61, (1, 24)).tolist()
    _, cache = run_compact(model, seq, [20])
    assert cache.layers[0].capacity == 32 and cache.layers[0].end == 24 and cache.layers[0].compactions == 0


def test_compacted_cache_is_inference_only_and_needs_positions():
    model = model_for("mha")
    cache = model.new_compact_cache(batch=1)
    with pytest.raises(ValueError, match="needs positions"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    model.train()
    with pytest.raises(RuntimeError, match="inference"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, positions=torch.arange(2)[None])


def test_generate_batch_matches_single_greedy_generation():
    from models.generate import generate, generate_batch
    model = model_for("mhe-mul", context=64).float()
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [1]]
    res = generate_batch(model, prompts, max_new_tokens=10)
    for p, ids in zip(prompts, res.new_ids):
        assert ids == generate(model, p, 10, greedy=True).new_ids
    assert len(res.step_latency_s) == 10 and len(res.drops) == model.config.n_layers
    assert res.decode_tokens_per_s > 0 and all(m > 0 for m in res.cache_bytes)


@pytest.mark.parametrize("pattern, k", [("local", 4), ("strided", 3)])
def test_fixed_patterns_on_the_compacted_cache_equal_the_full_forward(pattern, k):
    model = model_for("mha", prune=False, pattern=pattern, pattern_k=k)
    seqs, _ = assert_ragged_equals_full(model)
    dense = model_for("mha", prune=False)
    with torch.no_grad():  # the pattern really restricts: the same weights without it differ
        assert not torch.allclose(dense(torch.tensor([seqs[0]])).logits, model(torch.tensor([seqs[0]])).logits)


@pytest.mark.parametrize("mixer", ["she", "he", "we", "me"])
def test_extractors_are_refused_by_the_compacted_cache_with_the_reason(mixer):
    from models.generate import generate_batch
    model = DecoderLM(tiny_config(mixer)).eval()
    with pytest.raises(ValueError, match=f"serves attention mixers, not {mixer}.*generate\\(\\)"):
        generate_batch(model, [[1, 2, 3]], max_new_tokens=2)
