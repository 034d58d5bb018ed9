"""The eviction policies of docs/methods.md against brute-force simulations written straight from each rule:
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
def test_step_policies_keep_what_the_policy_says(name, budget):
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
    vote = {j: float(probs[:, :, j].sum(1).sum(0)) for j in earlier}  # over the window, then the heads, as summed
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
    keep = pol.compress(live, pos, torch.full((rows,), n_prompt), probs.sum(2))
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


# --- inside the model: the decode step evicts by the rule, from the model's own attention ---------------------

def spy(policy):
    """Record, per call (layer after layer, step after step), the attention each step's rule was given."""
    calls, step = [], policy.step

    def recording(live, pos, q_pos, probs=None, state=None):
        keep = step(live, pos, q_pos, probs, state)
        if probs is not None:  # the query attended over exactly what the cache held
            assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
            assert ((probs.masked_fill(live[:, None], 0.0) == 0).all()
                    and (probs[live[:, None].expand_as(probs)] > 0).all())
        calls.append((pos.clone(), None if probs is None else probs.clone(), keep.clone()))
        return keep
    policy.step = recording
    return calls


@pytest.mark.parametrize("name, budget", [("streamingllm", 9), ("tova", 7), ("h2o-layer", 8)])
def test_in_the_model_every_layer_evicts_by_the_policy(name, budget):
    from models import trace
    from models.generate import generate
    from tests.test_compact_cache import model_for
    model = model_for("mha", prune=False, context=64, seed=3).float()
    pol = policies.make(name, budget)
    calls = spy(pol)
    prompt = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2, 9]
    res = generate(model, prompt, 20, greedy=True, policy=pol)
    n_layers = model.config.n_layers
    assert res.cache_kind == "compacted" and len(calls) == n_layers * (len(prompt) + 19)
    tr = trace.build(res, type("T", (), {"decode": lambda self, ids: "x"})())
    for e in res.events:
        assert all(n <= budget for n in e.live)                 # never over the budget, in any layer
        held = trace.held_at(tr, e.index)
        assert all(row[-1] for row in held)                     # the newest token is always held
    total = len(prompt) + 19
    for layer in range(n_layers):   # replay the layer's rule by brute force on the attention it was given
        att = torch.zeros(total, H if name == "streamingllm" else model.config.n_heads, total) + 1.0
        for t in range(total):
            pos, probs, _ = calls[t * n_layers + layer]
            if probs is not None:
                for slot in range(pos.shape[1]):
                    if pos[0, slot] >= 0:
                        att[t, :, int(pos[0, slot])] = probs[0, :, slot] + 1e-30
        want = brute_heads(name.removesuffix("-layer"), budget, att, total)
        got = [{p for p in range(len(row)) if row[p]}
               for row in (trace.held_at(tr, s)[layer] for s in range(len(res.events)))]
        # held_at(s) is the cache after step s: the prompt's last token was fed at step 0
        assert got == [want[len(prompt) - 1 + s] for s in range(len(res.events))]
    assert res.events[-1].live == (budget,) * n_layers               # it did evict: the cache sits at the budget


def brute_heads(name, budget, att, total):
    global T, H
    saved = T, H
    T, H = total, att.shape[1]
    try:
        return brute(name, budget, att)
    finally:
        T, H = saved


def test_snapkv_in_the_model_keeps_its_selection_and_everything_after():
    from models.generate import generate
    from tests.test_compact_cache import model_for
    model = model_for("mha", prune=False, context=64, seed=3).float()
    prompt = list(range(3, 33))                                   # 30 tokens
    res = generate(model, prompt, 10, greedy=True, policy=policies.make("snapkv-layer", 16, window=4))
    first, last = res.events[0].live, res.events[-1].live
    assert all(n == 16 for n in first)                            # 12 chosen + the 4-token window
    assert all(n == 16 + 9 for n in last)                          # then every generated token is kept
    with pytest.raises(ValueError, match="fixed pattern"):
        model_for("mha", prune=False, context=64, pattern="local", pattern_k=4).new_compact_cache(
            policy=policies.make("tova", 8))


@pytest.mark.parametrize("name, budget", [("streamingllm", 9), ("tova", 7), ("h2o-layer", 8), ("snapkv-layer", 12),
                                          ("h2o-layer:prompt", 8)])
def test_a_pruned_model_under_a_policy_decodes_with_its_rule_off(name, budget):
    """Its own weights, the policy deciding: the same tokens, drops and cache as the same weights without a rule,
    and no K_int kept."""
    from models.generate import generate
    from tests.test_compact_cache import model_for
    dense = model_for("mha", prune=False, context=64, seed=3).float()
    pruned = model_for("mha", prune=True, context=64, seed=3).float()
    pruned.load_state_dict(dense.state_dict(), strict=False)
    prompt = list(range(3, 23))
    kw = {"window": 4} if name.startswith("snapkv") else {}
    a = generate(dense, prompt, 15, greedy=True, policy=policies.make(name, budget, **kw))
    b = generate(pruned, prompt, 15, greedy=True, policy=policies.make(name, budget, **kw))
    assert b.new_ids == a.new_ids
    assert [e.drops for e in b.events] == [e.drops for e in a.events] and any(e.drops for e in b.events)
    assert ([(e.held_bytes, e.alloc_bytes, e.live) for e in b.events]
            == [(e.held_bytes, e.alloc_bytes, e.live) for e in a.events])
    cache = pruned.new_compact_cache(policy=policies.make(name, budget, **kw))
    assert all("k_int" not in layer.buffers for layer in cache.layers)


def test_token_by_token_scores_equal_the_full_forward_and_count_what_queries_saw():
    from models.evaluate import score_token_by_token
    from models.pruning import sparsity
    from tests.test_compact_cache import model_for
    ids = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 2, 9, 11, 12, 3, 3, 7, 1, 40, 2, 5, 6, 7, 8, 9]
    n = len(ids) - 1
    dense = model_for("mha", prune=False, context=64, seed=3).float()
    with torch.no_grad():
        full = dense(torch.tensor([ids[:-1]]), targets=torch.tensor([ids[1:]])).loss.item() * n
    got = score_token_by_token(dense, ids)
    assert got["nll"] == pytest.approx(full, rel=1e-5) and got["sparsity"] == 0.0 and got["tokens"] == n
    for name, budget, sees in (("streamingllm", 6, 5), ("tova", 6, 6), ("h2o-layer", 6, 6)):
        # StreamingLLM evicts before the query attends (it sees budget - 1 earlier tokens); TOVA and H2O after
        got = score_token_by_token(dense, ids,
                                   policies.make(name, budget, **({"sinks": 2} if name == "streamingllm" else {})))
        assert got["sparsity"] == pytest.approx(sum(1 - min(i, sees) / i for i in range(1, n)) / n)
        assert got["nll"] != pytest.approx(full, rel=1e-6)
    pruned = model_for("mha", context=64, seed=3).float()      # the learned rule: the full forward's keep masks
    with torch.no_grad():
        out = pruned(torch.tensor([ids[:-1]]), targets=torch.tensor([ids[1:]]), diagnostics=True, attention_maps=False)
    want = float(torch.stack([sparsity(r.keep) for r in out.diagnostics]).mean())
    got = score_token_by_token(pruned, ids)
    assert got["sparsity"] == pytest.approx(want, abs=1e-6) and 0 < want < 1
    assert got["nll"] == pytest.approx(out.loss.item() * n, rel=1e-4)


def test_eviction_report_pools_what_token_by_token_scoring_gives(tmp_path):
    """The report's rows (replayed in one forward per window) equal token-by-token scoring of the same windows, and
    its budgets are the matched ones; SnapKV takes part after a prompt; the POS profile covers every rule."""
    import math
    import re

    import numpy as np

    from analysis.reports import eviction
    from models.checkpoint import load_model_dir
    from models.evaluate import score_token_by_token
    stream = np.random.default_rng(0).integers(0, 8192, 200).astype(np.uint16)
    np.save(tmp_path / "test.npy", stream)
    out = tmp_path / "e.md"
    assert eviction.main(["--dense", "assets/models/mha-1024", "--pruned", "assets/models/mha-1024-pruned",
                          "--data", str(tmp_path), "--window", "40", "--windows", "2", "--targets", "0.5",
                          "--out", str(out), "--figure", str(tmp_path / "e.png"),
                          "--pos-figure", str(tmp_path / "p.png")]) == 0
    text = out.read_text()
    whole, split = text.split("## Prompt, then generation")
    assert "| dense | mha-1024 | - | 0.0% |" in whole and "| learned pruning | mha-1024-pruned | - |" in whole
    for name in ("streamingllm", "tova", "h2o"):
        assert f"| {name} | mha-1024 |" in whole
    assert "| snapkv | mha-1024 |" in split and "| snapkv" not in whole
    windows = [[int(t) for t in stream[i * 40:(i + 1) * 40]] for i in range(2)]
    dense = load_model_dir("assets/models/mha-1024").model
    pruned = load_model_dir("assets/models/mha-1024-pruned").model
    learned = [score_token_by_token(pruned, w) for w in windows]
    ppl = math.exp(sum(r["nll"] for r in learned) / sum(r["tokens"] for r in learned))
    sp = sum(r["sparsity"] * r["tokens"] for r in learned) / sum(r["tokens"] for r in learned)
    row = re.search(r"\| learned pruning \| mha-1024-pruned \| - \| ([\d.]+)% \| ([\d.]+) \|", whole)
    assert (float(row.group(2)) == pytest.approx(ppl, rel=1e-5)
            and float(row.group(1)) == pytest.approx(100 * sp, abs=0.05))
    b = policies.budget_for("tova", sp, 39)   # the 39 queries that predict a token
    tova = [score_token_by_token(dense, w, policies.make("tova", b)) for w in windows]
    ppl = math.exp(sum(r["nll"] for r in tova) / sum(r["tokens"] for r in tova))
    row = re.search(rf"\| tova \| mha-1024 \| {b} \| [\d.]+% \| ([\d.]+) \|", whole)
    assert row and float(row.group(1)) == pytest.approx(ppl, rel=1e-5)
    pos_table = text.split("## What each method hides, by part of speech")[1]
    assert all(name in pos_table for name in ("learned pruning", "streamingllm (", "tova (", "h2o ("))
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        eviction.main(["--dense", "x", "--pruned", "y", "--policies", "lru"])


def test_a_padded_decode_step_under_a_policy_is_refused_with_the_right_reason():
    from tests.test_compact_cache import model_for
    model = model_for("mha", prune=False, context=64, seed=3)
    cache = model.new_compact_cache(batch=2, policy=policies.make("tova", 8))
    with pytest.raises(ValueError, match="one token per call"):
        model(torch.tensor([[1, 2], [3, 4]]), cache=cache, positions=torch.tensor([[0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="padding rows"):
        model(torch.tensor([[1], [3]]), cache=cache, positions=torch.tensor([[0], [0]]),
              valid=torch.tensor([[True], [False]]))
