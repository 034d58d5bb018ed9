"""The eviction engine (models.pruning.eviction) against the policies' definitions (the docstrings of
models.pruning.policies), written here as plain Python in float64 over fresh random scores: at every step a row
holds what the definition says, and its query attends over what the definition says. The engine runs twice: over
slots in a shuffled order (a hand-written driver, as the compacted cache's slots are not in position order) and
through the replay (positions as slots). Then: compacted decoding and the replay both go through the engine."""
import math
import sys

import pytest
import torch

from models.decode import Decoder
from models.pruning import eviction, policies
from models.pruning.replay import evict, replay
from tests.test_compact_cache import model_for

R, H, T, PROMPT = 2, 3, 30, 18
KW = {"streamingllm": {"sinks": 2}, "snapkv": {"window": 4, "pool": 3}}
CASES = [("streamingllm", 7), ("tova", 6), ("h2o", 8), ("snapkv:step", 9), ("oracle", 6),
         ("streamingllm:prompt", 7), ("tova:prompt", 6), ("h2o:prompt", 8), ("snapkv", 9), ("oracle:prompt", 6)]


def make(method, budget):
    return policies.make(method, budget, **KW.get(method.split(":")[0], {}))


def fresh_scores(seed):
    """Raw scores [R,h,T,T] with enough spread that no two candidates tie in float32."""
    return torch.randn(R, H, T, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


# ---- the definitions, literally -------------------------------------------------------------------------------

def softmax(row, keys):
    m = max(row[j] for j in keys)
    e = {j: math.exp(row[j] - m) for j in keys}
    z = sum(e.values())
    return {j: e[j] / z for j in keys}


def naive(method, budget, s, slot):
    """s [h][T][T] (one row's raw scores), slot[j]: the slot holding position j (ties between equal scores go to
    the lower slot). Per step n: (the positions query n attends over, the positions held after step n)."""
    name, mode = policies.parse(method)[0].name, policies.parse(method)[1]
    heads = range(len(s))
    full = [[softmax(s[h][m], range(m + 1)) for m in range(T)] for h in heads]
    later = lambda n, j: sum(full[h][m][j] for h in heads for m in range(n + 1, T))  # noqa: E731
    sinks, window, pool = 2, 4, 3
    if mode == "prompt":
        return naive_prompt(name, budget, full, later, sinks, window, pool)
    held, seen, out, acc, votes = [], [], [], {}, {}
    for n in range(T):
        held.append(n)
        if name == "streamingllm":   # positional: decided before the query attends
            held = [j for j in held if j < sinks or j > n - (budget - sinks)]
            seen.append(set(held))
            out.append(set(held))
            continue
        prob = {h: softmax(s[h][n], held) for h in heads}
        seen.append(set(held))
        if name == "tova" and len(held) > budget:
            held.remove(min((j for j in held if j != n), key=lambda j: (sum(prob[h][j] for h in heads) / H, slot[j])))
        elif name == "h2o":
            for j in held:
                acc[j] = acc.get(j, 0.0) + sum(prob[h][j] for h in heads)
            if len(held) > budget:
                held.remove(min((j for j in held if j <= n - budget // 2), key=lambda j: (acc[j], slot[j])))
        elif name == "snapkv":       # the vote of the last `window` queries, max-pooled over the earlier tokens
            votes[n] = {j: sum(prob[h][j] for h in heads) for j in held}
            vote = {j: sum(votes[m].get(j, 0.0) for m in range(n - window + 1, n + 1) if m >= 0) for j in held}
            earlier = [j for j in held if j <= n - window]
            pooled = {j: max(vote[i] for i in earlier if abs(i - j) <= pool // 2) for j in earlier}
            if len(held) > budget:
                held.remove(min(earlier, key=lambda j: (pooled[j], slot[j])))
        elif name == "oracle" and len(held) > budget:
            held.remove(min((j for j in held if j != n), key=lambda j: (later(n, j), slot[j])))
        out.append(set(held))
    return seen, out


def naive_prompt(name, budget, full, later, sinks, window, pool):
    """Prompt mode: the prompt's queries see their whole past; after the last prompt query the prompt is cut to
    the budget; every later token is kept."""
    p, heads = PROMPT, range(len(full))
    got = lambda queries, j: sum(full[h][m][j] for h in heads for m in queries if m >= j)  # noqa: E731
    if name == "streamingllm":
        kept = [j for j in range(p) if j < sinks or j >= p - (budget - sinks)]
    elif name == "tova":             # the last prompt query's weights, averaged over the heads
        kept = sorted(range(p - 1), key=lambda j: (-got([p - 1], j) / H, j))[:budget - 1] + [p - 1]
    elif name == "h2o":              # what the whole prompt paid; the budget/2 most recent, then the heaviest
        recent = list(range(p - budget // 2, p))
        kept = recent + sorted((j for j in range(p) if j not in recent),
                               key=lambda j: (-got(range(p), j), j))[:budget - len(recent)]
    elif name == "snapkv":
        earlier = range(p - window)
        vote = {j: got(range(p - window, p), j) for j in earlier}
        pooled = {j: max(vote[i] for i in earlier if abs(i - j) <= pool // 2) for j in earlier}
        kept = sorted(earlier, key=lambda j: (-pooled[j], -vote[j], j))[:budget - window] + list(range(p - window, p))
    else:                            # oracle: what the queries after the prompt pay, in the full model
        kept = sorted(range(p), key=lambda j: (-later(p - 1, j), j))[:budget]
    seen = [set(range(n + 1)) for n in range(p)] + [set(kept) | set(range(p, n + 1)) for n in range(p, T)]
    return seen, seen[:p - 1] + [set(kept)] + seen[p:]


# ---- the engine over shuffled slots ---------------------------------------------------------------------------

def drive(policy, scores, slot):
    """The engine over a cache whose position j sits in slot slot[j] (no compaction): per row, per step, the
    positions the query attended over and the positions held after the step."""
    rows, t = scores.shape[0], scores.shape[-1]
    order = torch.tensor(slot).argsort()                          # the position each slot holds
    by_slot = scores[..., order]                                  # keys in slot order
    live = torch.zeros(rows, t, dtype=torch.bool)
    pos = torch.full((rows, t), -1, dtype=torch.long)
    state = policy.state(rows, t, "cpu")
    later = hindsight_by_slot(scores, order) if policy.hindsight else None
    seen, held = [], []

    def positions(mask):
        return [{int(order[s]) for s in torch.nonzero(mask[r]).flatten()} for r in range(rows)]

    def softmax_over(n_rows, mask):                                # n_rows [R,h,c,S] in slot order, mask [R,c,S]
        return n_rows.masked_fill(~mask[:, None], float("-inf")).softmax(-1)

    for n in range(t):
        live[:, slot[n]], pos[:, slot[n]] = True, n

        def attend(mask, weights, n=n):
            seen.append(positions(mask))
            if not weights:
                return None
            if later is not None:
                return later[:, :, n]
            return softmax_over(by_slot[:, :, n:n + 1], mask[:, None])[:, :, 0].float()

        keep = eviction.step(policy, live.clone(), pos, torch.full((rows,), n), attend, state)
        if policy.at_prompt_end and n == PROMPT - 1:               # the prompt read, every slot live: compress once
            q_pos = torch.arange(PROMPT).expand(rows, PROMPT)
            probs = lambda a, b, allowed: softmax_over(by_slot[:, :, a:b], allowed)  # noqa: E731
            keep, _ = eviction.compress(policy, live.clone(), pos, q_pos, probs, prompt_later(scores, order))
        live &= keep
        held.append(positions(live))
    return seen, held


def hindsight_by_slot(scores, order):
    """later[r,h,n,s]: what queries after n pay the key in slot s, in the full causal model (float32)."""
    t = scores.shape[-1]
    p = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return (p.flip(-2).cumsum(-2).flip(-2) - p)[..., order].float()


def prompt_later(scores, order):
    """What the queries after the prompt pay each slot (zero for slots past the prompt) in the full model."""
    return hindsight_by_slot(scores, order)[:, :, PROMPT - 1] * (order < PROMPT)


@pytest.mark.parametrize("method, budget", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_engine_decides_what_the_definitions_say(method, budget, seed):
    scores = fresh_scores(seed)
    slot = torch.randperm(T, generator=torch.Generator().manual_seed(100 + seed)).tolist()
    seen, held = drive(make(method, budget), scores, slot)
    visible, dropped_at = evict(make(method, budget), T, scores, PROMPT, "cpu")
    evicted = False
    for r in range(R):
        want_seen, want_held = naive(method, budget, scores[r].tolist(), slot)
        assert [s[r] for s in seen] == want_seen, (method, r)
        assert [h[r] for h in held] == want_held, (method, r)
        in_order_seen, in_order_held = naive(method, budget, scores[r].tolist(), list(range(T)))
        replay_held = [{j for j in range(n + 1) if not 0 <= int(dropped_at[r, j]) <= n} for n in range(T)]
        assert replay_held == in_order_held, (method, r)
        assert [set(torch.nonzero(visible[r, n]).flatten().tolist()) for n in range(T)] == in_order_seen
        evicted |= len(want_held[-1]) < T
    assert evicted


def test_received_sums_the_causal_attention_per_key_in_blocks(monkeypatch):
    """received: sum over the queries of softmax over the live slots at positions <= the query's, per row and
    head, whatever the block size; zeros for no queries."""
    g = torch.Generator().manual_seed(7)
    rows, s, t = 2, 11, 9
    scores = torch.randn(rows, H, t, s, generator=g, dtype=torch.float64)
    pos = torch.randperm(s, generator=g)[None].repeat(rows, 1)
    live = (torch.rand(rows, s, generator=g) > 0.3) | (pos <= s - t + 2)   # every query holds a key
    q_pos = torch.arange(s - t, s)[None].repeat(rows, 1)
    probs = lambda a, b, allowed: scores[:, :, a:b].masked_fill(~allowed[:, None], float("-inf")).softmax(-1)  # noqa
    want = torch.zeros(rows, H, s, dtype=torch.float64)
    for r in range(rows):
        for m in range(2, t):
            keys = [j for j in range(s) if live[r, j] and pos[r, j] <= q_pos[r, m]]
            for h in range(H):
                w = softmax(scores[r, h, m].tolist(), keys)
                for j in keys:
                    want[r, h, j] += w[j]
    for chunk in (1, 4, 256):
        monkeypatch.setattr(eviction, "CHUNK", chunk)
        got = eviction.received(live, pos, q_pos, range(2, t), probs)
        assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-6)
    assert not eviction.received(live, pos, q_pos, range(t, t), probs).any()


def test_which_prompt_queries_a_policy_reads():
    assert eviction.prompt_queries(make("streamingllm:prompt", 7), 20) == range(0)
    assert eviction.prompt_queries(make("tova:prompt", 6), 20) == range(19, 20)
    assert eviction.prompt_queries(make("h2o:prompt", 8), 20) == range(0, 20)
    assert eviction.prompt_queries(make("snapkv", 9), 20) == range(16, 20)
    assert eviction.prompt_queries(make("snapkv", 9), 3) == range(0, 3)
    assert eviction.prompt_queries(make("oracle:prompt", 6), 20, 30) == range(20, 30)
    assert not eviction.compresses(make("h2o:prompt", 8), 1) and eviction.compresses(make("h2o:prompt", 8), 2)
    assert not eviction.compresses(make("h2o", 8), 20) and not eviction.compresses(None, 20)


# ---- one engine for both callers ------------------------------------------------------------------------------

IDS = [int(i) for i in torch.randint(0, 61, (30,), generator=torch.Generator().manual_seed(2))]


@pytest.mark.parametrize("method, budget", [("tova", 6), ("streamingllm", 7), ("h2o:prompt", 8), ("snapkv", 9)])
def test_decoding_and_replay_both_run_the_engine(monkeypatch, method, budget):
    """Wrap the engine's step and compress: both the decode step (models.backends.compacted) and the replay call
    them, and what they decide is what the wrapper saw."""
    calls = []

    def wrap(name):
        real = getattr(eviction, name)

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            calls.append((name, sys._getframe(1).f_globals["__name__"]))
            return out
        monkeypatch.setattr(eviction, name, spy)

    wrap("step")
    wrap("compress")
    model = model_for("gqa", prune=False, context=64, seed=3, n_kv_heads=2)
    prompt = 16 if policies.once(method) else None
    run = replay(model, IDS, make(method, budget), prompt=prompt)
    dec = Decoder(model, 1, "compacted", make(method, budget))
    x = torch.tensor([IDS])
    dec.extend(x[:, :prompt or 1])
    for i in range(prompt or 1, len(IDS)):
        dec.step(x[0, i:i + 1])
    called = {(n, m) for n, m in calls}
    want = "compress" if policies.once(method) else "step"
    assert {(want, "models.backends.compacted"), (want, "models.pruning.replay")} <= called
    assert (run.dropped_at >= 0).any()


def test_a_different_rule_in_the_engine_changes_both_paths(monkeypatch):
    """Replace the engine's step with 'keep everything': neither the decoder nor the replay evicts any more."""
    def keep_all(policy, live, pos, q_pos, attend, state=None):
        attend(live, policy.uses_attention)
        return live
    model = model_for("mha", prune=False, context=64, seed=3)
    before = replay(model, IDS, make("tova", 6))
    assert (before.dropped_at >= 0).any()
    monkeypatch.setattr(eviction, "step", keep_all)
    after = replay(model, IDS, make("tova", 6))
    assert (after.dropped_at < 0).all()
    dec = Decoder(model, 1, "compacted", make("tova", 6))
    dec.extend(torch.tensor([IDS[:1]]))
    for i in range(1, len(IDS)):
        dec.step(torch.tensor(IDS[i:i + 1]))
    assert not list(dec.new_drops())
