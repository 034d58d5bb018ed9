"""Interventions on the learned rule and activation patching (models.pruning.intervene), on fresh random pruned
models in float64: the rule's own decisions forced change nothing; every token forced kept at every layer is the same
weights with the rule off; a forced drop gives the keep structure the equations give with that gate set to 0, and
touches nothing before its query; a patched forward equals the blocks run by hand with the donor's states put in."""
import pytest
import torch

from models.pruning import intervene
from models.pruning.intervene import Force
from kernels.keep_rule import gates
from models.pruning.replay import replay
from models.scoring import head_kl, target_logprobs
from tests.test_compact_cache import model_for

T = 36
IDS = [int(i) for i in torch.randint(0, 61, (T,), generator=torch.Generator().manual_seed(4))]
CASES = [("mha", {"beta": 0.2}),
         ("gqa", {"beta": 1.0, "n_kv_heads": 2, "positions": "rope", "prune_sinks": 2, "prune_distance": True})]


def pruned(mixer, extra):
    model = model_for(mixer, prune=True, seed=7, context=64, n_layers=3, **extra)
    if extra.get("prune_distance"):
        for b in model.blocks:
            with torch.no_grad():
                b.mixer.pruning.lam.fill_(0.3)
    return model


def own_forces(run) -> list[Force]:
    """Every token's own fate at every layer, as forces: kept where the rule kept it, dropped at its own trigger."""
    return [Force(layer, j, keep=int(at) < 0, at=None if int(at) < 0 else int(at))
            for layer, row in enumerate(run.dropped_at) for j, at in enumerate(row[:-1].tolist())]


@pytest.mark.parametrize("mixer, extra", CASES)
def test_forcing_the_rules_own_decisions_changes_nothing(mixer, extra):
    model = pruned(mixer, extra)
    own = intervene.forced(model, IDS)
    assert (own.dropped_at >= 0).sum() > 5, "the random rule should drop something"
    with torch.no_grad():   # the plain forward, whole logits
        lp = target_logprobs(model(torch.tensor([IDS])).logits[0, :-1], torch.tensor(IDS[1:]))
    torch.testing.assert_close(own.logprobs, lp, rtol=0, atol=1e-12)
    again = intervene.forced(model, IDS, own_forces(own))
    assert torch.equal(again.hidden, own.hidden) and torch.equal(again.dropped_at, own.dropped_at)


@pytest.mark.parametrize("mixer, extra", CASES)
def test_every_token_kept_at_every_layer_is_the_rule_switched_off(mixer, extra):
    model = pruned(mixer, extra)
    run = intervene.forced(model, IDS, [Force(0, j, keep=True, onward=True) for j in range(T - 1)])
    assert (run.dropped_at == -1).all()
    off = replay(model, IDS, None)    # the same weights with learned pruning off
    torch.testing.assert_close(run.logprobs, off.logprobs, rtol=0, atol=1e-10)


@torch.no_grad()
def naive_drops(model, ids, layer, forced_token, at):
    """The step that drops each token at `layer`, straight from the equations on the layer's input: gates
    1[x_{n,j} > 0] (the first sinks held), the forced token's gate 0 from query `at`, and I_{k,j} the product of the
    gates of queries j+1..k: a token leaves at the first query whose gate is 0."""
    block = model.blocks[layer]
    x = block.ln_1(intervene.residuals(model, ids, layer))[None]
    rule = block.mixer.pruning
    pos = torch.arange(len(ids))
    xs = (x @ rule.W_Qint) @ (x @ rule.W_Kint).transpose(1, 2) / rule.r ** 0.5 + rule.beta
    if rule.lam is not None:
        xs = xs - rule.lam * (pos[:, None] - pos[None, :]).clamp_min(1).double().log()
    g = gates(xs, float("inf"), rule.sinks)[0].clone()
    g[at:, forced_token] = 0
    out = []
    for j in range(len(ids)):
        step = next((n for n in range(j + 1, len(ids)) if g[n, j] == 0), -1)
        out.append(step)
    return torch.tensor(out)


@pytest.mark.parametrize("mixer, extra", CASES)
@pytest.mark.parametrize("onward", [False, True])
def test_a_forced_drop_is_the_equations_with_that_gate_closed(mixer, extra, onward):
    model = pruned(mixer, extra)
    own = intervene.forced(model, IDS)
    layer = 1
    j = next(j for j in range(4, T - 10) if int(own.dropped_at[layer, j]) == -1 or own.dropped_at[layer, j] > j + 4)
    at = j + 2
    run = intervene.forced(model, IDS, [Force(layer, j, keep=False, at=at, onward=onward)])
    assert torch.equal(run.dropped_at[layer], naive_drops(model, IDS, layer, j, at))
    assert int(run.dropped_at[layer, j]) == at
    assert torch.equal(run.dropped_at[:layer], own.dropped_at[:layer])      # earlier layers: untouched
    assert torch.equal(run.logprobs[:at], own.logprobs[:at])                # queries before `at`: untouched
    assert not torch.equal(run.logprobs[at:], own.logprobs[at:])
    if onward:
        assert all(int(run.dropped_at[i, j]) in range(j + 1, at + 1) for i in range(layer, model.config.n_layers))


@pytest.mark.parametrize("mixer, extra", CASES)
def test_patching_equals_the_blocks_run_by_hand_with_the_donors_states(mixer, extra):
    model = pruned(mixer, extra)
    layer, positions = 2, [20, 30]
    own = intervene.forced(model, IDS)
    same = intervene.patched(model, IDS, layer, positions, intervene.residuals(model, IDS, layer))
    assert torch.equal(same.hidden, own.hidden)                             # its own states: nothing changes
    donor = intervene.residuals(model, IDS, layer, rule=False)             # the dense twin's
    assert not torch.allclose(donor[positions], intervene.residuals(model, IDS, layer)[positions])
    run = intervene.patched(model, IDS, layer, positions, donor)
    with torch.no_grad():
        pos = torch.arange(T)
        x = model.wte(torch.tensor([IDS])) + (0 if model.wpe is None else model.wpe(pos))
        for i, block in enumerate(model.blocks):
            if i == layer:
                x[0, positions] = donor[positions]
            x = block(x, None, None, pos)
        lp = target_logprobs((model.ln_f(x) @ model.output_weight().t())[0, :-1], torch.tensor(IDS[1:]))
    torch.testing.assert_close(run.logprobs, lp, rtol=0, atol=1e-12)
    assert torch.equal(run.logprobs[:positions[0]], own.logprobs[:positions[0]])
    assert not torch.equal(run.logprobs[positions[0]:], own.logprobs[positions[0]:])


@pytest.mark.parametrize("mixer, extra", CASES)
def test_patching_the_pruned_states_into_the_twin(mixer, extra):
    """The other direction: the twin given its own states changes nothing; given the pruned model's states at every
    position entering layer L, it is the pruned model with every token kept from layer L on (the rule off there)."""
    model = pruned(mixer, extra)
    layer = 2
    twin = intervene.twin_run(model, IDS)
    assert (twin.dropped_at < 0).all()
    own = intervene.patched(model, IDS, layer, list(range(T)), intervene.residuals(model, IDS, layer, rule=False),
                            rule=False)
    assert torch.equal(own.hidden, twin.hidden)
    run = intervene.patched(model, IDS, layer, list(range(T)), intervene.residuals(model, IDS, layer), rule=False)
    kept_on = intervene.forced(model, IDS, [Force(layer, j, keep=True, onward=True) for j in range(T - 1)])
    torch.testing.assert_close(run.logprobs, kept_on.logprobs, rtol=0, atol=1e-10)
    assert not torch.allclose(run.logprobs, twin.logprobs, atol=1e-6)


@pytest.mark.parametrize("mixer, extra", CASES)
def test_patching_a_mixer_output_equals_the_blocks_run_by_hand(mixer, extra):
    """site "mixer": the block's attention output is replaced at the positions, the rest of the block (its input,
    the residual sum, the feed-forward) is the model's own; the donor's outputs are the twin's at that layer.
    And at layer 0, whose input both share, patching every position's attention output from the twin equals
    patching layer 1's input from the twin."""
    model = pruned(mixer, extra)
    layer, positions = 1, [20, 30]
    own = intervene.forced(model, IDS)
    mine = intervene.residuals(model, IDS, layer, site="mixer")
    assert torch.equal(intervene.patched(model, IDS, layer, positions, mine, site="mixer").hidden, own.hidden)
    donor = intervene.residuals(model, IDS, layer, rule=False, site="mixer")
    assert not torch.allclose(donor[positions], mine[positions])
    run = intervene.patched(model, IDS, layer, positions, donor, site="mixer")
    with torch.no_grad():
        pos = torch.arange(T)
        x = model.wte(torch.tensor([IDS])) + (0 if model.wpe is None else model.wpe(pos))
        for i, block in enumerate(model.blocks):
            h = block.mixer(block.ln_1(x), None, None, pos)
            if i == layer:
                h[0, positions] = donor[positions]
            x = x + h
            x = x + block.ffn(block.ln_2(x))
        lp = target_logprobs((model.ln_f(x) @ model.output_weight().t())[0, :-1], torch.tensor(IDS[1:]))
    torch.testing.assert_close(run.logprobs, lp, rtol=0, atol=1e-12)
    assert torch.equal(run.logprobs[:positions[0]], own.logprobs[:positions[0]])
    every = list(range(T))
    at_mixer = intervene.patched(model, IDS, 0, every, intervene.residuals(model, IDS, 0, rule=False, site="mixer"),
                                 site="mixer")
    at_input = intervene.patched(model, IDS, 1, every, intervene.residuals(model, IDS, 1, rule=False))
    torch.testing.assert_close(at_mixer.logprobs, at_input.logprobs, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="'residual' stream"):
        intervene.residuals(model, IDS, 0, site="ffn")


def test_head_kl_is_the_kl_of_the_whole_distributions():
    model = pruned(*CASES[0])
    a = intervene.forced(model, IDS)
    b = intervene.forced(model, IDS, [Force(0, 3, keep=False, onward=True)])
    w = model.output_weight().t()
    pa, pb = (a.hidden @ w).log_softmax(-1), (b.hidden @ w).log_softmax(-1)
    want = (pa.exp() * (pa - pb)).sum(-1)
    for chunk in (1, 7, 1000):
        torch.testing.assert_close(head_kl(model, a.hidden, b.hidden, chunk), want, rtol=1e-9, atol=1e-12)
    assert (head_kl(model, a.hidden, a.hidden) == 0).all() and want[5:].max() > 0


def test_refusals_say_why():
    model = pruned(*CASES[0])
    with pytest.raises(ValueError, match="layers 0-"):
        intervene.forced(model, IDS, [Force(3, 3, keep=True)])
    with pytest.raises(ValueError, match="positions 0-34"):
        intervene.forced(model, IDS, [Force(0, T - 1, keep=True)])
    with pytest.raises(ValueError, match="must come after the token"):
        intervene.forced(model, IDS, [Force(0, 5, keep=False, at=5)])
    with pytest.raises(ValueError, match="same text"):
        intervene.patched(model, IDS, 0, [3], torch.zeros(T - 1, model.config.d_model, dtype=torch.float64))
    dense = model_for("mha", prune=False, context=64)
    with pytest.raises(ValueError, match="does not prune"):
        intervene.forced(dense, IDS)


TEXT = ("The committee met again on Tuesday to talk about the harbour and the roads. It was agreed that the new bridge "
        "would open in the spring, after the river had fallen.")


def test_the_command_writes_what_changed_and_refuses_to_overwrite(tmp_path, capsys):
    import json

    from analysis import render
    from analysis.reports import intervene as command
    from analysis.zoo import models_root
    model = str(models_root() / "mha-1024-pruned")
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "out"
    args = [model, "--text", str(tmp_path / "t.txt"), "--layer", "1", "--drop", "5", "--onward", "--out", str(out)]
    assert command.main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["token"] == 5 and summary["from"] == 6
    changed = (out / "changed_drops.csv").read_text().splitlines()
    assert changed[0] == "layer,position,token,dropped_at_before,dropped_at_after,forced" and len(changed) > 1
    assert render.load_figure(out / "intervention_effects.json").data         # the figure's spec redraws
    before = (out / "summary.json").read_bytes()
    assert command.main(args) == 2 and "would be overwritten" in capsys.readouterr().err
    assert (out / "summary.json").read_bytes() == before
    patch = [model, "--text", str(tmp_path / "t.txt"), "--layer", "2", "--patch", "10", "12", "--out",
             str(tmp_path / "p")]
    assert command.main(patch) == 0
    assert json.loads((tmp_path / "p" / "summary.json").read_text())["from"] == 10
    into = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert command.main(patch[:-1] + [str(tmp_path / "q"), "--into", "dense"]) == 0
    other = json.loads((tmp_path / "q" / "summary.json").read_text())
    assert other["settings"]["into"] == "dense" and other["ppl_from_before"] != into["ppl_from_before"]
    assert command.main(patch[:-1] + [str(tmp_path / "m"), "--site", "mixer"]) == 0
    mixer = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert mixer["settings"]["site"] == "mixer" and "attention output at 10, 12" in mixer["change"]
    assert mixer["ppl_from_after"] != into["ppl_from_after"]   # another site, another change
    assert command.main(patch[:-1] + [str(tmp_path / "r"), "--into", "dense", "--donor", model]) == 2
    assert "leave out --donor" in capsys.readouterr().err
    dense = [str(models_root() / "mha"), "--text", str(tmp_path / "t.txt"), "--layer", "0", "--keep", "1", "--out",
             str(tmp_path / "d")]
    assert command.main(dense) == 2 and "does not prune" in capsys.readouterr().err
    far = [model, "--text", str(tmp_path / "t.txt"), "--layer", "0", "--keep", "900", "--out", str(tmp_path / "f")]
    assert command.main(far) == 2 and "positions 0-" in capsys.readouterr().err


def test_an_outcome_counts_what_changed_and_nothing_when_nothing_did():
    from analysis import intervene as change
    model = pruned(*CASES[1])
    labels = [f"t{i}" for i in range(T)]
    own = intervene.forced(model, IDS)
    same = change.outcome(model, own, own, labels, 5)
    assert same["changed"].empty and (same["by_layer"][["changed", "forced"]] == 0).all().all()
    assert (same["effects"]["kl"] == 0).all()
    assert same["summary"]["ppl_from_before"] == same["summary"]["ppl_from_after"]
    forces = [Force(0, 4, keep=False, at=6, onward=True)]
    after = intervene.forced(model, IDS, forces)
    res = change.outcome(model, own, after, labels, change.first_affected(forces), forces)
    diff = (own.dropped_at != after.dropped_at)
    assert len(res["changed"]) == int(diff.sum())                             # a direct count of the tables
    assert res["changed"]["forced"].sum() == sum(bool(diff[i, 4]) for i in range(model.config.n_layers))
    assert res["by_layer"]["changed"].sum() + res["by_layer"]["forced"].sum() == len(res["changed"])
    assert (res["effects"]["kl"][:6] == 0).all() and res["effects"]["kl"][6:].max() > 0
