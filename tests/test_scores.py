"""The Pruning page's score view (analysis.scores): the scores recorded in a diagnostic forward, each token's fate and
closest call, the split of one score over its terms and the soft keep structure, against the equations written out
in loops on fresh random models (the paper's rule and the one with the distance term and sinks)."""
import math

import numpy as np
import pytest
import torch

from analysis import scores
from models.pruning.interaction import drop_records
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config
from tests.test_pruning import literal_keep

RULES = {"paper": dict(prune=True, prune_r=8), "distance+sinks": dict(prune=True, prune_r=8, prune_distance=True,
                                                                      prune_sinks=2)}


def model(rule: str, dtype=torch.float64, seed=7):
    m = DecoderLM(tiny_config("mha", **RULES[rule])).to(dtype).eval()
    randomize(m, std=0.3, seed=seed)
    for b in m.blocks:  # beta near 0 so that the text holds drops and keeps both
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.1)
            if b.mixer.pruning.lam is not None:
                b.mixer.pruning.lam.fill_(0.2)
    return m


def literal_scores(rule, q, k) -> np.ndarray:
    """x_{n,j} = q_n . k_j / sqrt(r) + beta - lambda log(n - j), for j < n, in loops."""
    t = q.shape[0]
    lam = 0.0 if rule.lam is None else float(rule.lam.detach())
    beta, q, k = float(rule.beta.detach()), q.detach(), k.detach()
    x = np.full((t, t), np.nan)
    for n in range(t):
        for j in range(n):
            x[n, j] = float(q[n] @ k[j]) / math.sqrt(rule.r) + beta - lam * math.log(n - j)
    return x


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fates_from_recorded_scores_are_the_forwards_drops(rule, dtype):
    """Every layer: x from the record equals the literal sum, and the trigger of each token read from x is the query
    that dropped it in the forward's own keep mask (float32: the same operations in the same order, so exactly)."""
    m = model(rule, dtype)
    ids = torch.randint(0, 61, (1, 24))
    out = m(ids, diagnostics=True, attention_maps=False)
    seen = 0
    for b, rec in zip(m.blocks, out.diagnostics):
        rule_ = b.mixer.pruning
        assert rec.q_int.dtype == dtype and rec.q_int.shape == (1, 24, 8)
        x = scores.layer_scores(rule_, rec.q_int, rec.k_int)
        want = literal_scores(rule_, rec.q_int[0].double(), rec.k_int[0].double())
        low = np.tril(np.ones((24, 24), dtype=bool), -1)
        np.testing.assert_allclose(x.double().numpy()[low], want[low], atol=1e-5 if dtype == torch.float32 else 1e-12)
        table = scores.fates(x, rule_.sinks)
        trigger, _ = drop_records(rec.keep)
        got = dict(zip(table["position"], table["dropped_at"]))
        for j in range(rule_.sinks, 23):
            assert got[j] == int(trigger[0, j]), (j, got[j], int(trigger[0, j]))
        seen += int((table["fate"] == "dropped").sum())
        assert set(table["position"]) == set(range(rule_.sinks, 23))  # sinks and the last token have no decision
    assert seen > 0


def test_closest_call_is_the_smallest_score_before_the_fate_was_sealed():
    m = model("distance+sinks")
    out = m(torch.randint(0, 61, (1, 24)), diagnostics=True, attention_maps=False)
    rec, rule = out.diagnostics[1], m.blocks[1].mixer.pruning
    x = scores.layer_scores(rule, rec.q_int, rec.k_int).numpy()
    table = scores.fates(torch.from_numpy(x), rule.sinks).set_index("position")
    for j, row in table.iterrows():
        end = row["dropped_at"] if row["dropped_at"] >= 0 else 23
        best = min(range(j + 1, end + 1), key=lambda n: abs(x[n, j]))
        assert row["closest_query"] == best and row["score"] == x[best, j]
        assert (row["score"] <= 0) == (row["dropped_at"] == best)  # a negative closest call is the drop itself
    top = scores.fragile(table.reset_index(), [f"t{i}" for i in range(24)], top=5)
    assert list(top["score"].abs()) == sorted(table["score"].abs())[:5]
    assert list(top["token"]) == [f"t{p}" for p in top["position"]]


@pytest.mark.parametrize("rule", list(RULES))
def test_split_terms_sum_to_the_score(rule):
    m = model(rule)
    out = m(torch.randint(0, 61, (1, 24)), diagnostics=True, attention_maps=False)
    rec, p = out.diagnostics[0], m.blocks[0].mixer.pruning
    x = scores.layer_scores(p, rec.q_int, rec.k_int)
    for n, j in [(5, 2), (23, 0), (17, 16)]:
        terms = scores.split(p, rec.q_int, rec.k_int, n, j)
        assert len(terms) == p.r + 1 + (p.lam is not None)
        assert terms["value"].sum() == pytest.approx(float(x[n, j]), abs=1e-12)
        fig = scores.split_figure(terms, 3, "split")
        assert sum(fig.data[0].y) == pytest.approx(float(x[n, j]), abs=1e-12)  # the other dims are summed, not lost
        assert len(fig.data[0].x) == 3 + 1 + 1 + (p.lam is not None)


@pytest.mark.parametrize("alpha", [1.0, 3.0, math.inf])
def test_soft_keep_is_the_literal_product_and_the_step_at_infinity(alpha):
    m = model("distance+sinks")
    p = m.blocks[0].mixer.pruning
    h = torch.randn(1, 13, 16, dtype=torch.float64)
    x = p.scores(h, p.keys(h), torch.arange(13), torch.arange(13))[0]
    got = scores.soft_keep(x, alpha, p.sinks)
    want = literal_keep(p, h, alpha)[0]
    if math.isinf(alpha):
        want = (want > 0.5).double()
        p.eval()
        torch.testing.assert_close(got, p.log_keep(h)[1][0])  # inference's keep structure
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    assert 0.0 <= scores.soft_sparsity(got) <= 1.0


@pytest.mark.parametrize("rule", list(RULES))
def test_figures_draw_a_bounded_window_and_blank_what_is_not_scored(rule):
    t = 300
    big = DecoderLM(tiny_config("mha", context=t, **RULES[rule])).double().eval()
    randomize(big, std=0.3, seed=2)
    for b in big.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(-0.5)   # most scores negative: the sinks' columns would show them
    out = big(torch.randint(0, 61, (1, t)), diagnostics=True, attention_maps=False)
    rec, p = out.diagnostics[0], big.blocks[0].mixer.pruning
    x = scores.layer_scores(p, rec.q_int, rec.k_int)
    table = scores.fates(x, p.sinks)
    labels = [f"w{i}" for i in range(t)]
    for at in (0, 40):
        z = np.asarray(scores.score_figure(x, table, at, labels, "x", p.sinks).data[0].z, dtype=float)
        assert z.shape == (scores.VIEW, scores.VIEW)
        assert np.isnan(z[np.triu_indices(scores.VIEW)]).all()
        assert np.isnan(z[:, :max(0, p.sinks - at)]).all()   # sinks are never scored
        drawn = 0
        for _, row in table[(table["position"] >= at) & (table["dropped_at"] >= 0)].iterrows():
            j, k = row["position"] - at, row["dropped_at"] - at
            if k < scores.VIEW:
                assert z[k, j] <= 0 and np.isnan(z[k + 1:, j]).all()  # the drop drawn, nothing scored after it
                assert np.isfinite(z[j + 1:k + 1, j]).all()           # every query until then is
                drawn += 1
        assert drawn > 0
    soft = scores.soft_figure(scores.soft_keep(x, 2.0, p.sinks), 290, labels, "I")
    assert np.asarray(soft.data[0].z).shape == (10, 10)
