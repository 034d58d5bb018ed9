"""An eviction policy replayed over a whole text in one forward (models.pruning.replay) makes the decisions decoding
token by token over the compacted cache makes: the same tokens evicted at the same steps in every layer, the same
log-probabilities, and the sparsity policies.expected_sparsity predicts. On fresh random models of several mixers."""
import pytest
import torch

from models.decode import Decoder
from models.pruning import mean_sparsity, policies, sparsity
from models.memory import REPLAY_MAX_TOKENS as MAX_TOKENS
from models.pruning.replay import replay
from models.scoring import target_logprobs
from tests.test_compact_cache import model_for

IDS = [int(i) for i in torch.randint(0, 61, (40,), generator=torch.Generator().manual_seed(11))]
KW = {"streamingllm": {"sinks": 2}, "snapkv": {"window": 4}}


def make(method, budget):
    return policies.make(method, budget, **KW.get(method.split(":")[0].removesuffix("-layer"), {}))


def decoded(model, ids, policy, prompt=None):
    """Token by token over the compacted cache (prompt mode: the prompt in one call, as generation feeds it):
    log-probabilities of ids[1:] and, per layer, the step that evicted each position (-1: never)."""
    dec = Decoder(model, 1, "compacted", policy)
    x = torch.tensor([ids])
    first = prompt or 1
    logits = [dec.extend(x[:, :first])[0]] + [dec.step(x[0, i:i + 1]) for i in range(first, len(ids))]
    lp = target_logprobs(torch.cat(logits)[:-1], x[0, 1:])
    dropped = torch.full((len(dec.state.layers), len(ids)), -1)
    for layer, _, p, trig in dec.new_drops():
        dropped[layer, p] = trig
    return lp, dropped


CASES = [("mha", {}), ("mqa", {}), ("mhe-mul", {}), ("mhe-add", {}), ("gqa", {"n_kv_heads": 2, "positions": "rope"})]


STEP = [("streamingllm", 9), ("tova", 7), ("h2o-layer", 8), ("snapkv-layer:step", 12)]
ONCE = [("streamingllm:prompt", 9), ("tova:prompt", 7), ("h2o-layer:prompt", 8), ("snapkv-layer", 12)]


@pytest.mark.parametrize("mixer, extra", CASES)
@pytest.mark.parametrize("name, budget", STEP + ONCE)
def test_replay_evicts_what_token_by_token_decoding_evicts(mixer, extra, name, budget):
    model = model_for(mixer, prune=False, context=64, seed=3, **extra)
    prompt = 24 if policies.once(name) else None
    run = replay(model, IDS, make(name, budget), prompt=prompt)
    lp, dropped = decoded(model, IDS, make(name, budget), prompt)
    assert run.visible.shape[1] == 1 and torch.equal(run.dropped_at[:, 0], dropped)   # per layer: one row
    assert (run.dropped_at >= 0).sum() > 0                             # it did evict
    assert torch.allclose(run.logprobs.double(), lp.double(), atol=1e-9, rtol=1e-9)
    # never more visible than the budget (the query itself included), and causal
    vis = run.visible[:, 0]
    assert not vis.triu(1).any() and vis.diagonal(dim1=1, dim2=2).all()
    limit = budget if prompt is None else budget + (len(IDS) - prompt)
    assert int(vis.sum(-1).max()) <= limit + (0 if not policies.parse(name)[0].uses_attention else 1)
    got = float(sparsity(vis.double()).mean())
    assert got == pytest.approx(policies.expected_sparsity(name, budget, len(IDS), prompt), abs=1e-6)


def test_visibility_follows_the_drop_steps():
    """StreamingLLM in step mode hides a token from the query that drops it; the others evict after that query
    attended (in prompt mode: the last prompt query), in every row (KV group) of every layer."""
    model = model_for("gqa", prune=False, context=64, seed=3, n_kv_heads=2)
    for name, budget in STEP + ONCE + [("h2o", 8), ("snapkv", 12), ("oracle", 7), ("oracle:prompt", 7)]:
        run = replay(model, IDS, make(name, budget), prompt=24)
        after = 0 if not policies.parse(name)[0].uses_attention and not policies.once(name) else 1
        t = len(IDS)
        assert run.visible.shape[1] == (2 if policies.parse(name)[0].per_group else 1)
        for layer in range(model.config.n_layers):
            for r in range(run.visible.shape[1]):
                for j in range(t):
                    s = int(run.dropped_at[layer, r, j])
                    end = t if s < 0 else s + after
                    want = torch.zeros(t, dtype=torch.bool)
                    want[j:end] = True
                    assert torch.equal(run.visible[layer, r, :, j], want), (name, layer, r, j)


def test_no_policy_is_the_dense_forward_and_a_pruned_model_runs_with_its_rule_off():
    dense = model_for("mha", prune=False, context=64, seed=3)
    x = torch.tensor([IDS])
    with torch.no_grad():
        want = dense(x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None]).squeeze(-1)
    run = replay(dense, IDS)
    assert torch.allclose(run.logprobs.double(), want.double(), atol=1e-10)
    assert (run.dropped_at == -1).all() and torch.equal(run.visible[0, 0], torch.ones(40, 40, dtype=torch.bool).tril())
    pruned = model_for("mha", prune=True, context=64, seed=3)   # the dense model's weights plus a rule
    missing = pruned.load_state_dict(dense.state_dict(), strict=False).missing_keys
    assert missing and all(".pruning." in k for k in missing)
    with torch.no_grad():
        # its rule would drop tokens
        assert (pruned(x, diagnostics=True, attention_maps=False).diagnostics[0].keep < 0.5).any()
    assert torch.allclose(replay(pruned, IDS).logprobs, run.logprobs, atol=1e-10)
    tova = replay(pruned, IDS, policies.make("tova", 7))
    assert torch.equal(tova.dropped_at, replay(dense, IDS, policies.make("tova", 7)).dropped_at)


def test_expected_sparsity_and_matched_budgets():
    assert policies.expected_sparsity("tova", 48, 48) == 0.0
    assert policies.expected_sparsity("streamingllm", 49, 48) == 0.0
    assert policies.expected_sparsity("snapkv", 64, 100, prompt=50) == 0.0            # the budget holds the prompt
    assert policies.expected_sparsity("snapkv", 40, 100, prompt=100) == 0.0           # no query after the prompt
    for name in ("streamingllm", "tova", "h2o", "snapkv"):
        b = policies.budget_for(name, 0.3, 200, prompt=150)
        err = abs(policies.expected_sparsity(name, b, 200, 150) - 0.3)
        assert all(err <= abs(policies.expected_sparsity(name, c, 200, 150) - 0.3)
                   for c in range(policies.min_budget(name), 201))
    with pytest.raises(ValueError, match="prompt"):
        policies.expected_sparsity("snapkv", 40, 100)


@pytest.mark.parametrize("name, budget, prompt",
                         [("streamingllm", 9, None), ("tova", 7, None), ("h2o", 8, None), ("snapkv", 12, 24)])
def test_one_averaging_with_or_without_the_first_query(name, budget, prompt):
    """mean_sparsity of a replay's masks equals the policy's expected sparsity under both conventions (query 0
    counted as 0, or left out) and over a later range of queries; the two conventions differ by (n-1)/n."""
    model = model_for("mha", prune=False, context=64, seed=3)
    vis = replay(model, IDS, make(name, budget), prompt=prompt).visible.double()
    n = len(IDS)
    for count_first in (True, False):
        got = float(mean_sparsity(vis, count_first).mean())
        assert got == pytest.approx(policies.expected_sparsity(name, budget, n, prompt, count_first=count_first),
                                    abs=1e-6)
    assert float(mean_sparsity(vis, True).mean()) == pytest.approx(float(mean_sparsity(vis, False).mean())
                                                                   * (n - 1) / n)
    late = float(mean_sparsity(vis, False, start=30).mean())
    assert late == pytest.approx(policies.expected_sparsity(name, budget, n, prompt, first=30), abs=1e-6)
    want = sum((1 - (float(vis[0, 0, k].sum()) - 1) / k) for k in range(30, n)) / (n - 30)  # layer 0, by hand
    assert float(mean_sparsity(vis[0, 0], True, start=30)) == pytest.approx(want)


def test_refusals_say_why():
    model = model_for("mha", prune=False, context=64, seed=3)
    with pytest.raises(ValueError, match="prompt"):
        replay(model, IDS, policies.make("snapkv", 12, window=4))
    with pytest.raises(ValueError, match="softmax attention"):
        replay(model_for("we", prune=False, context=64), IDS)
    with pytest.raises(ValueError, match="fixed local pattern"):
        replay(model_for("mha", prune=False, context=64, pattern="local", pattern_k=4), IDS)
    with pytest.raises(ValueError, match="take a window"):
        replay(model, list(range(65)))
    assert MAX_TOKENS >= 1024   # the Pruning page's window
    wide = model_for("mha", prune=False, context=4096, seed=3, n_heads=64, d_model=64)   # 64 heads: 1 GiB of scores
    with pytest.raises(ValueError, match="at most 2048"):                                # per layer at 2,048 tokens
        replay(wide, [1] * 2049)


GROUPED = [("h2o", 8), ("tova-group", 7), ("snapkv:step", 12), ("h2o:prompt", 8), ("tova-group:prompt", 7),
           ("snapkv", 12)]


@pytest.mark.parametrize("mixer, extra", [("mha", {}), ("gqa", {"n_kv_heads": 2, "positions": "rope"})])
@pytest.mark.parametrize("name, budget", GROUPED)
def test_per_group_decoding_evicts_what_the_per_group_replay_evicts(mixer, extra, name, budget):
    """Decoding under a per-KV-group policy (a row of slots per group) drops, in every group of every layer, what
    the replay drops (itself checked against the papers' per-head rules in test_per_group_eviction), with the same
    log-probabilities; the decoder reports a token dropped once every group has dropped it."""
    model = model_for(mixer, prune=False, context=64, seed=3, **extra)
    prompt = 24 if policies.once(name) else None
    run = replay(model, IDS, make(name, budget), prompt=prompt)
    dec = Decoder(model, 1, "compacted", make(name, budget), count_seen=True)
    x = torch.tensor([IDS])
    first = prompt or 1
    logits = [dec.extend(x[:, :first])[0]] + [dec.step(x[0, i:i + 1]) for i in range(first, len(IDS))]
    lp = target_logprobs(torch.cat(logits)[:-1], x[0, 1:])
    n_layers, groups, n = run.dropped_at.shape
    assert groups == model.blocks[0].mixer.n_groups > 1
    dropped = torch.full((n_layers, groups, n), -1)
    for li, layer in enumerate(dec.state.layers):
        for r, p, t in layer.drop_table().tolist():
            dropped[li, r, p] = t
    assert torch.equal(run.dropped_at, dropped)
    assert (dropped >= 0).sum() > 0
    assert torch.allclose(run.logprobs.double(), lp.double(), atol=1e-9, rtol=1e-9)
    gone = {(li, p): t for li, _, p, t in dec.new_drops()}
    assert gone == {(li, p): int(run.dropped_at[li, :, p].max()) for li in range(n_layers) for p in range(n)
                    if bool((run.dropped_at[li, :, p] >= 0).all())}
    held = dec.live(0)   # the mean over groups of what each still holds
    assert held == pytest.approx([float((run.dropped_at[li] < 0).sum(-1).double().mean()) for li in range(n_layers)])
    assert dec.seen_share() > 0


BF16 = [("mha", {}), ("gqa", {"n_kv_heads": 2, "positions": "rope"})]


@pytest.mark.parametrize("mixer, extra", BF16)
@pytest.mark.parametrize("name, budget", STEP + ONCE)
def test_in_bfloat16_replay_and_decode_evict_alike_where_they_see_the_same_states(mixer, extra, name, budget):
    """A bf16 model: layer 0 reads the embeddings, which a whole-text forward and a token-by-token decode share, and
    there each policy's replay evicts exactly what its decode evicts. Both take the softmax in bf16 and hand the
    policy float32; equal scores (common at bf16's 8 bits) go to the later position in both (policies.keep_top).
    Later layers read hidden states the two compute with different blockings, which round differently in bf16: there
    the tables may differ (docs/gpu.md), which is why the app analyses in float32."""
    model = model_for(mixer, prune=False, context=64, seed=3, **extra).to(torch.bfloat16)
    prompt = 24 if policies.once(name) else None
    run = replay(model, IDS, make(name, budget), prompt=prompt)
    _, dropped = decoded(model, IDS, make(name, budget), prompt)
    assert (dropped[0] >= 0).sum() > 0
    assert torch.equal(run.dropped_at[0, 0], dropped[0])
