"""Per-KV-group eviction (docs/methods.md) against the original papers' per-head definitions, written here as
plain Python over each layer's own queries and keys in float64, on fresh random MHA and GQA models: every row
(KV group) of every layer holds what the paper's rule says at every step; the attention a group's heads pay
is softmax over what that group holds; the hindsight oracle evicts what later queries attend to least; with
one group the per-group and per-layer forms agree."""
import math

import pytest
import torch

import kernels
from models.backends import attend_by_group
from models.pruning import policies
from models.pruning.replay import LayerReplay, Replay
from models.transformer import evaluating
from tests.test_compact_cache import model_for

IDS = [int(i) for i in torch.randint(0, 61, (36,), generator=torch.Generator().manual_seed(5))]


class Recording(LayerReplay):
    def attend(self, mixer, x, q, k, v, record):
        self.q, self.k, self.mixer = q, k, mixer
        return super().attend(mixer, x, q, k, v, record)


def peaky(model):
    """Sharper attention than the small random init gives (near-uniform weights make every group evict alike)."""
    with torch.no_grad():
        for b in model.blocks:
            b.mixer.W_Q.mul_(8)
    return model


def run(model, policy, prompt=None):
    """The replay, with each layer's q and k kept: (layers, log-probabilities)."""
    cache = Replay(policy, model.config.n_layers, prompt)
    cache.layers = [Recording(policy, prompt) for _ in cache.layers]
    with torch.no_grad(), evaluating(model):
        model(torch.tensor([IDS]), cache=cache)
    return cache.layers


def head_scores(layer):
    """[H][T][T] raw scores as Python floats, and the KV group of each head (head i reads group i // (H/G))."""
    s = kernels.reference.attention_scores(layer.q, layer.k, scale=layer.mixer.scale, **layer.mixer.head_maps())[0]
    h, g = s.shape[0], layer.k.shape[1]
    return s.tolist(), [i // (h // g) for i in range(h)]


def softmax(row, keys):
    m = max(row[j] for j in keys)
    e = {j: math.exp(row[j] - m) for j in keys}
    z = sum(e.values())
    return {j: e[j] / z for j in keys}


def brute(name, budget, scores, heads, group, t, prompt=None, window=4, pool=3):
    """Per step n, the positions group `group` holds after the step, from the papers' definitions."""
    mine = [h for h in range(len(scores)) if heads[h] == group]
    full = [[softmax(scores[h][m], range(m + 1)) for m in range(t)] for h in range(len(scores))]
    later = lambda n, j: sum(full[h][m][j] for h in mine for m in range(n + 1, t))  # noqa: E731
    out, cache, acc = [], [], {}
    if name in ("snapkv", "h2o:prompt", "oracle:prompt"):
        p = prompt
        if name == "snapkv":
            earlier = range(p - window)
            vote = {j: sum(full[h][m][j] for h in mine for m in range(p - window, p)) for j in earlier}
            pooled = {j: max(vote[i] for i in earlier if abs(i - j) <= pool // 2) for j in earlier}
            kept = (sorted(earlier, key=lambda j: (-pooled[j], -vote[j], j))[:budget - window]
                    + list(range(p - window, p)))
        elif name == "h2o:prompt":
            got = {j: sum(full[h][m][j] for h in mine for m in range(j, p)) for j in range(p)}
            recent = list(range(p - budget // 2, p))
            kept = recent + sorted((j for j in range(p) if j not in recent),
                                   key=lambda j: (-got[j], j))[:budget - len(recent)]
        else:
            kept = sorted(range(p), key=lambda j: (-later(p - 1, j), j))[:budget]
        # the last prompt query attended to everything, then the prompt was compressed
        return [set(range(n + 1)) for n in range(p - 1)] + [set(kept) | set(range(p, n + 1)) for n in range(p - 1, t)]
    for n in range(t):
        cache.append(n)
        prob = {h: softmax(scores[h][n], cache) for h in mine}
        if name == "h2o":
            for j in cache:
                acc[j] = acc.get(j, 0.0) + sum(prob[h][j] for h in mine)
            if len(cache) > budget:
                cache.remove(min((j for j in cache if j <= n - budget // 2), key=lambda j: (acc[j], j)))
        elif name == "tova-group" and len(cache) > budget:
            cache.remove(min((j for j in cache if j != n),
                             key=lambda j: (sum(prob[h][j] for h in mine) / len(mine), j)))
        elif name == "oracle" and len(cache) > budget:
            cache.remove(min((j for j in cache if j != n), key=lambda j: (later(n, j), j)))
        out.append(set(cache))
    return out


def held(dropped_at, n):
    """The positions a replay row holds after step n."""
    return {j for j in range(n + 1) if dropped_at[j] < 0 or dropped_at[j] > n}


@pytest.mark.parametrize("mixer, extra", [("mha", {}), ("gqa", {"n_kv_heads": 2, "positions": "rope"})])
@pytest.mark.parametrize("name, budget", [("h2o", 8), ("tova-group", 7), ("oracle", 7), ("snapkv", 12),
                                          ("h2o:prompt", 8), ("oracle:prompt", 9)])
def test_every_group_holds_what_the_papers_rule_says(mixer, extra, name, budget):
    model = peaky(model_for(mixer, prune=False, context=64, seed=4, **extra))
    prompt = 24 if policies.once(name) else None
    kw = {"window": 4, "pool": 3} if name == "snapkv" else {}
    layers = run(model, policies.make(name, budget, **kw), prompt)
    t = len(IDS)
    differs = False
    for layer in layers:
        scores, heads = head_scores(layer)
        g = layer.k.shape[1]
        assert layer.visible.shape == (g, t, t) and g == model.blocks[0].mixer.n_groups
        for r in range(g):
            want = brute(name, budget, scores, heads, r, t, prompt)
            assert [held(layer.dropped_at[r].tolist(), n) for n in range(t)] == want, (name, r)
        differs |= any(not torch.equal(layer.visible[0], layer.visible[r]) for r in range(1, g))
    # the groups decided apart (H2O's heavy hitters on these small models are the first tokens in every group; the
    # others show that each row reads its own heads)
    assert differs or name.startswith("h2o")


def test_attention_by_group_is_each_heads_softmax_over_its_groups_keys():
    g = torch.Generator().manual_seed(0)
    b, h, gr, t, s, d = 2, 6, 3, 5, 9, 4
    q, k, v = torch.randn(b, h, t, d, generator=g).double(), torch.randn(b, gr, s, d, generator=g).double(), \
        torch.randn(b, gr, s, d, generator=g).double()
    allowed = torch.rand(b, gr, t, s, generator=g) > 0.4
    allowed[..., 0] = True
    mixer = type("M", (), {"scale": 0.5, "head_maps": lambda self: {}, "output": lambda self, o: o})()
    got = attend_by_group(mixer, q, k, v, allowed)
    for bi in range(b):
        for hi in range(h):
            gi = hi // (h // gr)
            for ti in range(t):
                keys = [j for j in range(s) if allowed[bi, gi, ti, j]]
                w = softmax([float(q[bi, hi, ti] @ k[bi, gi, j]) * 0.5 for j in range(s)], keys)
                want = sum(w[j] * v[bi, gi, j] for j in keys)
                assert torch.allclose(got[bi, hi, ti], want, atol=1e-12)


def test_one_group_is_the_layer():
    """On MQA (one KV group) the per-group and per-layer forms are the same policy."""
    model = model_for("mqa", prune=False, context=64, seed=4)
    from models.pruning.replay import replay
    for a, b in (("h2o", "h2o-layer"), ("tova-group", "tova"), ("snapkv", "snapkv-layer")):
        kw = {"window": 4} if a == "snapkv" else {}
        x = replay(model, IDS, policies.make(a, 12, **kw), prompt=24)
        y = replay(model, IDS, policies.make(b, 12, **kw), prompt=24)
        assert torch.equal(x.visible, y.visible) and torch.equal(x.logprobs, y.logprobs)
