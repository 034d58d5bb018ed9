"""The two deviations from the paper's rule (ModelConfig.prune_distance, prune_sinks) and distillation:
the literal equation in loops, then every path (full forward, static cache, compacted cache, Triton kernel)
against it."""
import math

import pytest
import torch

from kernels import reference
from models.config import ModelConfig
from models.transformer import DecoderLM
from tests.helpers import cached_logits, randomize, tiny_config
from tests.test_compact_cache import assert_drops_match_full_forward, assert_ragged_equals_full
from tests.test_pruning import literal_keep

RULE = dict(prune=True, prune_r=8, prune_distance=True, prune_sinks=2)


def model_with_terms(mixer="mha", beta=0.6, lam=0.35, seed=5, **cfg):
    m = DecoderLM(tiny_config(mixer, **(RULE | cfg))).double().eval()
    randomize(m, std=0.2, seed=seed)
    for b in m.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(beta)
            b.mixer.pruning.lam.fill_(lam)
    return m


@pytest.mark.parametrize("alpha", [1.0, 2.5, math.inf])
def test_keep_structure_with_distance_and_sinks_matches_the_literal_product(alpha):
    m = model_with_terms()
    p = m.blocks[0].mixer.pruning
    p.train()
    p.alpha = alpha
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    _, keep = p.log_keep(x)
    want = literal_keep(p, x, alpha)
    if math.isinf(alpha):
        want = (want > 0.5).to(want.dtype)  # the step: a product of 0/1 factors
    torch.testing.assert_close(keep, want, atol=1e-10, rtol=1e-8)
    assert torch.all(keep[:, :, :2].tril() == torch.ones(11, 2, dtype=keep.dtype).tril())  # sinks always kept


def test_the_distance_term_drops_far_tokens_first():
    """With beta > 0 and no content (W_Qint = 0), a token lives while lam log(n - j) < beta: a sliding window
    of exp(beta / lam) (rounded down), plus the sinks."""
    m = model_with_terms(beta=1.0, lam=0.5)
    p = m.blocks[0].mixer.pruning
    with torch.no_grad():
        p.W_Qint.zero_()
    _, keep = p.log_keep(torch.randn(1, 20, 16, dtype=torch.float64))
    window = math.floor(math.exp(1.0 / 0.5) - 1e-9)  # n - j < e^2 = 7.39: lags 1..7 survive
    k, j = torch.meshgrid(torch.arange(20), torch.arange(20), indexing="ij")
    want = ((k - j <= window) & (j <= k)) | ((j < 2) & (j <= k))
    assert torch.equal(keep[0].bool(), want)


def test_zero_lambda_and_no_sinks_are_the_papers_rule():
    plain = DecoderLM(tiny_config("mha", prune=True, prune_r=8)).double().eval()
    randomize(plain, std=0.2, seed=3)
    terms = DecoderLM(tiny_config("mha", prune=True, prune_r=8, prune_distance=True)).double().eval()
    state = plain.state_dict()
    for b in range(terms.config.n_layers):
        state[f"blocks.{b}.mixer.pruning.lam"] = torch.zeros((), dtype=torch.float64)
    terms.load_state_dict(state)
    idx = torch.randint(0, 61, (2, 15))
    with torch.no_grad():
        a, b_ = plain(idx, diagnostics=True, attention_maps=False), terms(idx, diagnostics=True, attention_maps=False)
    torch.testing.assert_close(a.logits, b_.logits, rtol=0, atol=0)
    assert "lam" not in dict(plain.blocks[0].mixer.pruning.named_parameters())  # old checkpoints load as they were


@pytest.mark.parametrize("chunks", [[1] * 16, [5, 1, 7, 3]], ids=["per-token", "chunked"])
@pytest.mark.parametrize("mixer", ["mha", "mqa", "mhe-mul", "gqa"])
def test_static_cache_decode_equals_full_forward_with_the_terms(mixer, chunks):
    model = model_with_terms(mixer, beta=0.3, lam=0.2)
    idx = torch.randint(0, 61, (3, 16))
    with torch.no_grad():
        full = model(idx, diagnostics=True)
        steps, cache = cached_logits(model, idx, chunks)
    torch.testing.assert_close(steps, full.logits, rtol=1e-6, atol=1e-6)
    keep = full.diagnostics[0].keep
    assert torch.equal(cache.layers[0].alive[:, :16], keep[:, -1].bool())
    assert 0 < keep.tril(-1).sum() < 3 * 16 * 15 / 2


@pytest.mark.parametrize("mixer", ["mha", "mqa", "mhe-add", "gqa"])
def test_compacted_cache_equals_full_forward_with_the_terms(mixer):
    model = model_with_terms(mixer, beta=0.3, lam=0.2)
    _, cache = assert_ragged_equals_full(model, n=18)
    assert len(cache.layers[0].drop_table()) > 0


def test_compacted_drops_and_triggers_match_the_full_forward_with_the_terms():
    model = model_with_terms("mha", beta=0.3, lam=0.25)
    for dropped in assert_drops_match_full_forward(model, torch.randint(0, 61, (2, 20)).tolist()):
        assert not dropped[0, :2].any()  # the sinks


@pytest.mark.parametrize("valid", [True, False], ids=["all-real", "padding-row"])
def test_triton_compact_decode_with_the_terms_matches_the_reference(valid):
    from kernels import triton_attention
    from tests.test_kernels_triton import prune_state
    b, h, g, s, r, d = 3, 6, 3, 70, 8, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    state = prune_state(b, s, r, beta=0.8) | {"lam": 0.3, "sinks": 3}
    state["valid"][-1] = valid
    if valid:
        state["valid"] = None
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=state, n_split=2)
    want, want_keep = reference.decode(q, k, v, scale=0.25, prune=state)
    assert torch.equal(keep, want_keep)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    literal = state["live"].clone()  # the rule from its equation, slot by slot
    for i in range(b):
        for j in range(s):
            pos, qp = int(state["pos"][i, j]), int(state["q_pos"][i])
            if not literal[i, j] or pos >= qp or pos < 3 or (not valid and i == b - 1):
                continue
            x = float(state["q_int"][i] @ state["k_int"][i, j]) / math.sqrt(r) + 0.8 - 0.3 * math.log(qp - pos)
            literal[i, j] = x > 0
    assert torch.equal(keep, literal)
    assert (state["live"] & ~keep).any() and (state["live"] & (state["pos"] < 3) & (state["pos"] >= 0)).any()


def test_config_refuses_negative_sinks_and_keeps_the_defaults():
    from models.config import ConfigError
    with pytest.raises(ConfigError, match="prune_sinks"):
        tiny_config("mha", prune=True, prune_sinks=-1)
    cfg = ModelConfig()
    assert cfg.prune_distance is False and cfg.prune_sinks == 0


def test_distillation_loss_is_the_kl_to_the_rule_off_model():
    from models.train import distill_loss, rule_off
    model = model_with_terms("gqa", beta=0.3, lam=0.2)
    dense = DecoderLM(tiny_config("gqa")).double().eval()
    dense.load_state_dict(model.state_dict(), strict=False)
    idx = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        student = model(idx).logits
        with rule_off(model):
            teacher = model(idx).logits
        torch.testing.assert_close(teacher, dense(idx).logits, rtol=0, atol=0)
        assert model.blocks[0].mixer.pruning is not None  # switched back on
        p, q = teacher.softmax(-1), student.softmax(-1)
        literal = sum(float((p[b, t] * (p[b, t].log() - q[b, t].log())).sum())
                      for b in range(2) for t in range(12)) / 24
        assert float(distill_loss(student, teacher)) == pytest.approx(literal, rel=1e-6)
        assert float(distill_loss(teacher, teacher)) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("dtype,window", [(torch.float64, 9), (torch.float32, 9), (torch.float32, 179),
                                          (torch.float32, 337)])
def test_the_window_init_is_streamingllm_before_training(dtype, window):
    """train.prune_init "window": with the content term at 0 the rule keeps exactly what StreamingLLM at budget
    window + sinks keeps, query by query (the policy's own step, on an uncompacted cache), in float32 too (179 and
    337 put lambda log(n - j) - beta within rounding of 0 at the edge if beta were lambda log(window)), in the
    full forward and in the static cache's step rule."""
    from models.pruning.policies import StreamingLLM
    m = model_with_terms(prune_sinks=4).to(dtype)
    p = m.blocks[0].mixer.pruning
    p.init_window(window)
    assert p.lam.item() == 4.0 and p.beta.item() == pytest.approx(4.0 * math.log(window - 0.5))
    with torch.no_grad():
        p.W_Qint.zero_()
    t = window + 30
    x = torch.randn(1, t, 16, dtype=dtype)
    _, keep = p.log_keep(x)
    stepped = p.step_keep(x, p.keys(x), torch.ones(1, t, dtype=torch.bool))
    policy = StreamingLLM(window + 4, sinks=4)
    for q in range(t):
        pos = torch.arange(q + 1)[None]
        want = policy.step(torch.ones(1, q + 1, dtype=torch.bool), pos, torch.tensor([q]))
        assert torch.equal(keep[0, q, :q + 1].bool(), want[0]), q
        assert torch.equal(stepped[0, q, :q + 1], want[0]), q


def test_the_window_init_and_alpha_start_are_checked(tmp_path):
    import json
    from models.config import ConfigError
    from models.train import load_run_config
    plain = DecoderLM(tiny_config("mha", prune=True, prune_r=8)).double()
    with pytest.raises(ValueError, match="distance term"):
        plain.blocks[0].mixer.pruning.init_window(9)
    cfg = tmp_path / "c.json"
    for model, train, message in [({"prune": True}, {"prune_init": "window"},
                                   "needs model.prune and model.prune_distance"),
                                  ({"prune": True, "prune_distance": True}, {"prune_init": "window", "prune_window": 0},
                                   "prune_window must be an integer"),
                                  ({"prune": True, "prune_distance": True},
                                   {"prune_init": "window", "prune_window": 128},
                                   "integer in \\[1, model.context=128\\)"),
                                  ({"prune": True}, {"prune_window": 50}, "but prune_init is 'paper'"),
                                  ({"prune": True}, {"alpha_start": 9.0}, "1 <= alpha_start <= alpha_end"),
                                  ({"prune": True}, {"alpha_start": "2"}, "1 <= alpha_start <= alpha_end")]:
        cfg.write_text(json.dumps({"model": {"context": 128} | model, "train": {"eval_stride": 64} | train}))
        with pytest.raises(ConfigError, match=message):
            load_run_config(cfg)
