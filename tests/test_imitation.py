"""train.imitate: the targets against literal versions, the loss against its definition, the cache (format,
resume, a refused mix of recipes), a rule that learns a target it can express, and a tiny run end to end."""
import json
import math

import numpy as np
import pytest
import torch

from kernels.alpha_sigmoid import alpha_sigmoid
from models.checkpoint import load_model_dir
from models.config import ConfigError
from models.pruning import imitation
from kernels.keep_rule import keep_from_gates
from models.pruning.interaction import ContextPruning, mean_sparsity
from models.train import train
from models.transformer import DecoderLM, evaluating
from tests.helpers import randomize, tiny_config
from tests.test_train_eval import curve, data_dir, write_config  # noqa: F401 - the module's corpus fixture


def _probs(h, t, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(h, t, t, generator=g) * 2
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return s, s.masked_fill(~causal, -math.inf).softmax(-1)


def test_keep_target_is_causal_and_monotone():
    until = torch.tensor([0, 5, 2, 3, 7, 7, 6, 7])
    want = imitation.keep_target(until)
    for k in range(8):
        for j in range(8):
            assert bool(want[k, j]) == (j <= k <= int(until[j]))
    assert torch.equal(imitation.until_from_dropped(torch.tensor([-1, 3, -1]), 3), torch.tensor([2, 3, 2]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_target_is_the_last_query_above_the_threshold_at_the_sparsity_asked(seed):
    _, probs = _probs(3, 40, seed)
    until = imitation.attention_until(probs, 0.6)
    got = float(mean_sparsity(imitation.keep_target(until).float(), count_first=False))
    assert abs(got - 0.6) < 0.05
    # literally: the threshold this until implies lies between the weights it keeps and the ones past it
    need = probs.amax(0)
    for j in range(40):
        u = int(until[j])
        assert u >= j
        later = need[u + 1:, j]
        if u > j:
            assert float(need[u, j]) > float(later.max()) if len(later) else True


def test_oracle_target_is_the_hindsight_oracle_stepped_literally():
    scores, probs = _probs(2, 24, 3)
    budget = imitation.policies.budget_for("oracle", 0.5, 24)
    until = imitation.oracle_until(scores, 0.5)
    # straight from the Oracle's definition: after query n attends, while more than `budget` tokens are held,
    # evict the held token (not n itself) that the later queries of the full model attend to least, heads summed
    later = probs.sum(0).flip(0).cumsum(0).flip(0) - probs.sum(0)           # [n, j]: sum over queries > n
    held, want = [], [23] * 24
    for n in range(24):
        held.append(n)
        while len(held) > budget:
            j = min((j for j in held if j != n), key=lambda j: float(later[n, j]))
            held.remove(j)
            want[j] = n
    assert until.tolist() == want


def _rule_model(**over):
    cfg = tiny_config("gqa", positions="rope", n_kv_heads=2, prune=True, prune_r=8, prune_distance=True,
                      prune_sinks=1, **over)
    model = DecoderLM(cfg)
    randomize(model, std=0.3)
    return model


def test_window_targets_take_each_layers_attention_input_and_leave_the_forward_dense():
    model = _rule_model()
    ids = torch.randint(0, model.config.vocab_size, (20,))
    seen = {}
    hooks = [b.ln_1.register_forward_hook(lambda m, i, o, k=k: seen.__setitem__(k, o[0])) for k, b in
             enumerate(model.blocks)]
    with evaluating(model), torch.no_grad():
        for b in model.blocks:
            b.mixer.pruning, b._rule = None, b.mixer.pruning
        try:
            x, until = imitation.window_targets(model, ids, "attention", 0.5)
        finally:
            for b in model.blocks:
                b.mixer.pruning = b._rule
    for h in hooks:
        h.remove()
    assert x.shape == (model.config.n_layers, 20, model.config.d_model) and until.shape == (model.config.n_layers, 20)
    assert all(torch.equal(x[k], seen[k]) for k in seen)


def test_loss_is_the_cross_entropy_of_I_against_the_target_over_decided_pairs():
    torch.manual_seed(0)
    rules = [ContextPruning(12, 4, 0.5, distance=True, sinks=1) for _ in range(2)]
    for r in rules:
        r.train()
        r.alpha = 3.0
    x = torch.randn(2, 3, 10, 12)
    until = torch.randint(0, 10, (2, 3, 10)).maximum(torch.arange(10))
    loss, mass = imitation.imitation_loss(rules, x, until)
    want = []
    for r, xl, ul in zip(rules, x, until):
        q, k = xl @ r.W_Qint, xl @ r.W_Kint
        pos = torch.arange(10)
        s = q @ k.transpose(1, 2) / 2 + r.beta - r.lam * (pos[:, None] - pos[None, :]).clamp_min(1).float().log()
        sig = alpha_sigmoid(s, 3.0)                    # (tested against its definition in test_rule_terms)
        sig[..., :1] = 1
        keep = keep_from_gates(sig).detach()
        terms = []
        for b in range(3):
            for kk in range(10):
                for j in range(1, kk):
                    t = kk <= int(ul[b, j])
                    p = float(keep[b, kk, j])
                    terms.append(-math.log(max(p, 1e-40)) if t else -math.log(max(1 - p, 1e-6)))
        want.append(np.mean(terms))
    assert float(loss) == pytest.approx(float(np.mean(want)), rel=1e-3)
    assert float(mass) == pytest.approx(sum(float(ContextPruning.mass(
        r.log_keep(xl)[1])) for r, xl in zip(rules, x)), rel=1e-4)


def test_a_rule_learns_a_target_it_can_express():
    """A target made by a rule of the same form (a window of 6 plus content): a fresh rule fitted on it agrees with
    it on far more decisions than at the start."""
    torch.manual_seed(1)
    teacher = ContextPruning(16, 4, 0.0, distance=True)
    teacher.init_window(6)
    x = torch.randn(4, 1, 24, 16)
    with torch.no_grad():
        teacher.eval()
        keep = teacher.log_keep(x[:, 0])[1]
    until = torch.where(keep > 0.5, torch.arange(24)[None, :, None], -1).amax(1)          # [B, T]
    student = ContextPruning(16, 4, 2.0, distance=True)
    opt = torch.optim.Adam(student.parameters(), lr=0.02)

    def agreement():
        student.eval()
        with torch.no_grad():
            got = student.log_keep(x[:, 0])[1] > 0.5
        student.train()
        below = torch.ones(24, 24, dtype=torch.bool).tril(-1)
        return float((got == imitation.keep_target(until))[:, below].float().mean())

    before = agreement()
    student.train()
    for i in range(300):   # (alpha to 4: past it a gate saturates at 0 and a pair it should keep has no gradient)
        student.alpha = 1.0 + 3.0 * i / 300
        loss, _ = imitation.imitation_loss([student], x.transpose(0, 1), until[None])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert agreement() > max(0.95, before + 0.1)


def test_cache_is_written_in_shards_resumes_and_refuses_another_recipe(tmp_path):
    model = _rule_model()
    windows = np.random.default_rng(0).integers(0, model.config.vocab_size, (imitation.SHARD + 3, 12))
    with torch.no_grad(), evaluating(model):
        for b in model.blocks:
            b.mixer.pruning = None
        meta = imitation.build_cache(model, windows, tmp_path / "c", "attention", 0.5, "0" * 64, progress=False)
    files = sorted((tmp_path / "c").glob("shard_*.safetensors"))
    assert len(files) == 2 and meta["windows"] == imitation.SHARD + 3
    on_disk = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert on_disk["bytes_per_token"] == imitation.bytes_per_token(model.config.n_layers, model.config.d_model)
    cache = imitation.Cache(tmp_path / "c", len(windows))
    x, until = cache.batch([0, imitation.SHARD + 2], "cpu")
    assert x.shape == (model.config.n_layers, 2, 12, model.config.d_model) and until.dtype == torch.long
    stamp = files[0].stat().st_mtime_ns
    files[1].unlink()
    with torch.no_grad(), evaluating(model):
        imitation.build_cache(model, windows, tmp_path / "c", "attention", 0.5, "0" * 64, progress=False)
    assert files[0].stat().st_mtime_ns == stamp and files[1].exists()     # only the missing shard is made again
    assert torch.equal(imitation.Cache(tmp_path / "c", len(windows)).batch([imitation.SHARD + 2], "cpu")[1],
                       until[:, 1:])
    with pytest.raises(ValueError, match="another recipe"):
        imitation.build_cache(model, windows, tmp_path / "c", "oracle", 0.5, "0" * 64, progress=False)


def test_order_cycles_through_every_window_once_an_epoch():
    seen = np.concatenate([imitation.order(10, s, 4, 0) for s in range(5)])
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:20].tolist()) == list(range(10))
    assert np.array_equal(imitation.order(10, 3, 4, 0), imitation.order(10, 3, 4, 0))


def test_an_imitation_run_trains_the_rule_alone_from_its_cache(tmp_path, data_dir):  # noqa: F811
    dense_cfg = write_config(tmp_path / "dense.json", data_dir, mixer="gqa", steps=2)
    raw = json.loads(dense_cfg.read_text())
    raw["model"] |= {"positions": "rope", "n_kv_heads": 2}
    dense_cfg.write_text(json.dumps(raw))
    train(dense_cfg, tmp_path / "dense", progress=False)
    raw["model"] |= {"prune": True, "prune_r": 8, "prune_distance": True, "prune_sinks": 2}
    raw["train"] |= {"init_from": str(tmp_path / "dense"), "steps": 4, "freeze_base": True, "imitate": "oracle",
                     "imitate_windows": 6, "imitate_sparsity": 0.5, "prune_init": "window", "prune_window": 4}
    (tmp_path / "p.json").write_text(json.dumps(raw))
    card = train(tmp_path / "p.json", tmp_path / "p", progress=False)
    tuned = load_model_dir(tmp_path / "p")
    dense = load_model_dir(tmp_path / "dense").model.state_dict()
    state = tuned.model.state_dict()
    assert all(torch.equal(dense[k], state[k]) for k in dense)
    assert card["train"]["imitate"] == "oracle" and (tmp_path / "p" / "imitation_cache" / "meta.json").exists()
    assert card["imitation"]["target"] == "oracle" and card["imitation"]["distinct_tokens"] == 6 * 16
    losses = [e["loss"] for e in curve(tmp_path / "p") if e["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(v) and v > 0 for v in losses)
    for bad, match in (({"imitate": "future"}, "must be one of"), ({"imitate_sparsity": 1.5}, r"in \(0, 1\)"),
                       ({"freeze_base": False}, "over a frozen base"), ({"distill": True}, "not with distill")):
        (tmp_path / "bad.json").write_text(json.dumps(raw | {"train": raw["train"] | bad}))
        with pytest.raises(ConfigError, match=match):
            train(tmp_path / "bad.json", tmp_path / "bad", progress=False)
