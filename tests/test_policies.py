"""The eviction policies of papers.md section 5 against brute-force simulations written straight from each rule:
which positions a layer holds after every step, for random attention, several budgets and rows; the budget is
never exceeded and the current token is always kept."""
import pytest
import torch

from models.pruning import policies

T, H = 40, 3


def random_attention(rows: int, seed: int) -> torch.Tensor:
    """[rows, T, H, T] positive weights; step t's query only ever looks at the slots still live (renormalised)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, T, H, T, generator=g) + 1e-3


def run_vectorised(policy, att: torch.Tensor) -> list[list[set[int]]]:
    """The policy over a cache whose slot t holds position t (slots are shuffled to check that nothing reads slot
    order). Returns, per row and step, the set of positions held after the step."""
    rows = att.shape[0]
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(7))       # position -> slot
    pos = torch.full((rows, T), -1, dtype=torch.long)
    live = torch.zeros(rows, T, dtype=torch.bool)
    state = policy.state(rows, T, "cpu")
    held = [[] for _ in range(rows)]
    for t in range(T):
        pos[:, perm[t]] = t
        live[:, perm[t]] = True
        q_pos = torch.full((rows,), t)
        w = torch.zeros(rows, H, T)
        w[:, :, perm] = att[:, t].clone()                    # by slot
        w = w.masked_fill(~live[:, None], 0.0)
        probs = w / w.sum(-1, keepdim=True)
        live = policy.step(live, pos, q_pos, probs, state)
        for r in range(rows):
            held[r].append({int(pos[r, i]) for i in range(T) if live[r, i]})
    return held


def brute(name: str, budget: int, att_row: torch.Tensor, sinks: int = 4) -> list[set[int]]:
    cache, acc, out = [], {}, []
    for t in range(T):
        cache.append(t)
        w = {p: [float(att_row[t, h, p]) for h in range(H)] for p in cache}
        norm = [sum(w[p][h] for p in cache) for h in range(H)]
        prob = {p: [w[p][h] / norm[h] for h in range(H)] for p in cache}
        if name == "streamingllm":
            cache = [p for p in cache if p < sinks or p > t - (budget - sinks)]
        elif name == "tova" and len(cache) > budget:
            cache.remove(min((p for p in cache if p != t), key=lambda p: sum(prob[p]) / H))
        elif name == "h2o":
            for p in cache:
                acc[p] = acc.get(p, 0.0) + sum(prob[p])
            if len(cache) > budget:
                cache.remove(min((p for p in cache if p <= t - budget // 2), key=lambda p: acc[p]))
        out.append(set(cache))
    return out


@pytest.mark.parametrize("name", ["streamingllm", "tova", "h2o"])
@pytest.mark.parametrize("budget", [5, 8, 13])
def test_step_policies_keep_what_the_rule_says(name, budget):
    att = random_attention(3, seed=budget)
    got = run_vectorised(policies.make(name, budget), att)
    for r in range(3):
        want = brute(name, budget, att[r])
        assert got[r] == want
        assert all(len(s) <= budget and t in s for t, s in enumerate(got[r]))


def test_streamingllm_holds_the_sinks_and_the_recent_window():
    got = run_vectorised(policies.make("streamingllm", 10, sinks=4), random_attention(1, 0))[0]
    assert got[-1] == {0, 1, 2, 3} | set(range(T - 6, T))


def brute_snapkv(budget, window, pool, n_prompt, probs):  # probs [H, W, n_prompt]
    earlier = list(range(n_prompt - window))
    vote = {j: float(probs[:, :, j].sum()) for j in earlier}
    pooled = {j: max(vote[i] for i in range(max(0, j - pool // 2), min(len(earlier), j + pool // 2 + 1)))
              for j in earlier}
    best = sorted(earlier, key=lambda j: (-pooled[j], -vote[j], j))[:max(0, budget - window)]
    return set(best) | set(range(n_prompt - window, n_prompt))


@pytest.mark.parametrize("budget, window, pool, n_prompt", [(12, 4, 3, 30), (20, 8, 7, 60), (40, 8, 7, 30),
                                                           (9, 1, 5, 25)])
def test_snapkv_keeps_the_observation_window_and_the_pooled_top(budget, window, pool, n_prompt):
    g = torch.Generator().manual_seed(n_prompt + budget)
    rows, s = 2, n_prompt + 5                                  # a few unused slots
    perm = torch.stack([torch.randperm(s, generator=g) for _ in range(rows)])
    pos = torch.full((rows, s), -1, dtype=torch.long)
    for r in range(rows):
        pos[r, perm[r, :n_prompt]] = torch.arange(n_prompt)
    live = pos >= 0
    by_pos = torch.rand(rows, H, window, n_prompt, generator=g).round(decimals=1)  # coarse: ties happen
    probs = torch.zeros(rows, H, window, s)
    for r in range(rows):
        probs[r][:, :, perm[r, :n_prompt]] = by_pos[r]
    pol = policies.make("snapkv", budget, window=window, pool=pool)
    keep = pol.select(live, pos, torch.full((rows,), n_prompt), probs)
    for r in range(rows):
        got = {int(pos[r, i]) for i in range(s) if keep[r, i]}
        assert got == brute_snapkv(budget, window, pool, n_prompt, by_pos[r])
        assert len(got) == min(budget, n_prompt)


def test_bad_budgets_and_names_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        policies.make("tova", 0)
    with pytest.raises(ValueError, match="sinks"):
        policies.make("streamingllm", 4, sinks=4)
    with pytest.raises(ValueError, match="window"):
        policies.make("snapkv", 16, window=16)
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'.*h2o"):
        policies.make("lru", 8)
