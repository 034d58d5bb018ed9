"""Training snapshots along the alpha schedule (models.snapshots) and their replay (analysis.timeline, the Pruning
page's timeline): the snapshots sit at the planned steps with the schedule's alpha and hold only what trains; the
last equals the finished model and the first the rule as initialised; a stopped run resumes keeping what it wrote;
replaying a snapshot equals a model built with those tensors by hand, and leaves the model it was given as it was."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from streamlit.testing.v1 import AppTest

from analysis import pruning, timeline
from models import snapshots
from models.checkpoint import load_model_dir
from kernels.alpha_sigmoid import alpha_schedule
from models.train import train
from tests.test_train_eval import data_dir, write_config  # noqa: F401 (a fixture)

PAGE = str(Path(__file__).resolve().parent.parent / "app" / "views" / "7_Pruning.py")


def pruned_config(tmp_path, data_dir, **train):   # noqa: F811
    cfg = write_config(tmp_path / "c.json", data_dir, mixer="mha", steps=6, freeze_base=True,
                       prune_init="calibrated", gamma=1.0, lr=5e-2, alpha_start=1.0, alpha_end=8.0, **train)
    raw = json.loads(cfg.read_text())
    raw["model"] |= {"prune": True, "prune_r": 8}
    cfg.write_text(json.dumps(raw))
    return cfg


def test_snapshot_steps():
    assert snapshots.snapshot_steps(100, None, 4) == [0, 25, 50, 75, 100]
    assert snapshots.snapshot_steps(100, 40, 2) == [0, 20, 40, 100]   # along the alpha schedule, and the end
    assert snapshots.snapshot_steps(3, None, 8) == [0, 1, 2, 3]        # no step twice
    assert snapshots.snapshot_steps(100, None, 0) == []
    snaps = [{"step": i} for i in range(50)]
    kept = snapshots.keep_evenly(snaps, 8)
    assert len(kept) == 8 and kept[0]["step"] == 0 and kept[-1]["step"] == 49


def tensors(snaps) -> list[dict]:
    return [load_file(str(s["path"])) for s in snaps]


def test_a_run_snapshots_along_the_schedule_and_resumes_to_the_same_snapshots(tmp_path, data_dir):   # noqa: F811
    cfg = pruned_config(tmp_path, data_dir, snapshots=3)
    whole = tmp_path / "whole"
    train(cfg, whole, progress=False)
    snaps = snapshots.listing(whole)
    assert [s["step"] for s in snaps] == [0, 2, 4, 6]
    for s in snaps:
        assert s["alpha"] == pytest.approx(alpha_schedule(s["step"], 6, 1.0, 8.0))
    final = load_model_dir(whole).model.state_dict()
    last = load_file(str(snaps[-1]["path"]))
    assert set(last) == {k for k in final if ".pruning." in k}                 # the rule alone: the base is frozen
    assert all(torch.equal(last[k], final[k]) for k in last)
    start = load_file(str(snaps[0]["path"]))
    assert any(not torch.equal(start[k], last[k]) for k in last)               # the rule moved

    # stopped after step 3 (state at 3), with a snapshot past the state left behind (as a kill between a snapshot
    # and the next checkpoint leaves one): the resumed run writes it again on its own path
    out = tmp_path / "resumed"
    assert train(cfg, out, progress=False, stop_after=3)["status"] == "interrupted"
    assert [s["step"] for s in snapshots.listing(out)] == [0, 2]
    snapshots.save(out, {k: v + 1 for k, v in last.items()}, 4, {"alpha": 0.0})
    train(cfg, out, progress=False)
    again = snapshots.listing(out)
    assert [s["step"] for s in again] == [0, 2, 4, 6]
    for a, b in zip(tensors(snaps), tensors(again)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_fresh_run_does_not_keep_another_runs_snapshots(tmp_path, data_dir):   # noqa: F811
    out = tmp_path / "m"
    snapshots.save(out, {"blocks.0.mixer.pruning.beta": torch.zeros(())}, 5, {"alpha": 1.0})
    train(pruned_config(tmp_path, data_dir, snapshots=1), out, progress=False)
    assert [s["step"] for s in snapshots.listing(out)] == [0, 6]


def test_replaying_a_snapshot_equals_the_model_built_by_hand(tmp_path, data_dir):   # noqa: F811
    out = tmp_path / "m"
    train(pruned_config(tmp_path, data_dir, snapshots=2), out, progress=False)
    loaded = load_model_dir(out)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    ids = list(range(3, 19))
    tags = ["NOUN", "VERB"] * 8
    labels = [str(i) for i in ids]
    snaps = snapshots.listing(out)
    res = timeline.join([timeline.at_snapshot(loaded.model, s, ids, tags, labels) for s in snaps])
    assert all(torch.equal(v, before[k]) for k, v in loaded.model.state_dict().items())   # left as it was
    by_hand = load_model_dir(out).model
    with torch.no_grad():
        for k, v in load_file(str(snaps[0]["path"])).items():
            by_hand.get_parameter(k).copy_(v)
    keeps, _ = pruning.keeps_and_logprobs(by_hand, ids)
    want = pruning.sparsity_per_layer(keeps)["sparsity"].to_numpy()
    got = res["layers"][res["layers"]["step"] == 0]["sparsity"].to_numpy()
    np.testing.assert_allclose(got, want)
    q, j = np.tril_indices(len(ids), -1)
    sink = [keeps[layer][q[j < 4], j[j < 4]].mean() for layer in range(len(keeps))]
    np.testing.assert_allclose(res["layers"][res["layers"]["step"] == 0]["sink_share"], sink)
    final = pruning.sparsity_per_layer(pruning.keeps_and_logprobs(loaded.model, ids)[0])["sparsity"].to_numpy()
    np.testing.assert_allclose(res["layers"][res["layers"]["step"] == 6]["sparsity"], final)
    assert list(res["steps"]["step"]) == [0, 3, 6]


def test_a_snapshot_of_another_model_is_refused(tmp_path, data_dir):   # noqa: F811
    out = tmp_path / "m"
    train(pruned_config(tmp_path, data_dir, snapshots=1), out, progress=False)
    model = load_model_dir(out).model
    rule = {k: v.detach() for k, v in model.named_parameters() if ".pruning." in k}
    wrong = dict(rule) | {"blocks.0.mixer.pruning.beta": torch.zeros(3)}
    with pytest.raises(snapshots.SnapshotError, match="not one of this model's"):
        snapshots.load_into(model, snapshots.save(tmp_path / "a", wrong, 0, {"alpha": 1.0}))
    short = {k: v for k, v in rule.items() if not k.startswith("blocks.1.")}
    with pytest.raises(snapshots.SnapshotError, match="lacks the rule's"):
        snapshots.load_into(model, snapshots.save(tmp_path / "b", short, 0, {"alpha": 1.0}))
    (out / "snapshots" / "step_000009.safetensors").write_bytes(b"not a safetensors file")
    misnamed = snapshots.save(tmp_path / "c", rule, 3, {"alpha": 1.0})
    misnamed.rename(out / "snapshots" / "step_000004.safetensors")            # its header says step 3
    (out / "snapshots" / "step_000007.safetensors").symlink_to(snapshots.path_of(out, 6))   # a link
    assert [s["step"] for s in snapshots.listing(out)] == [0, 6]   # damaged, misnamed, linked: left out


def test_too_many_snapshots_of_a_whole_model_are_refused():
    with pytest.raises(snapshots.SnapshotError, match="freeze the base"):
        snapshots.check_size({"w": torch.empty(2**26)}, 10)


def test_the_pruning_page_replays_the_snapshots(tmp_path, data_dir, monkeypatch):   # noqa: F811
    train(pruned_config(tmp_path, data_dir, snapshots=2), tmp_path / "models" / "run", progress=False)
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path / "models"))
    at = AppTest.from_file(PAGE, default_timeout=180)
    at.session_state["model"] = "run"
    at.run()
    assert not at.exception, at.exception
    at.toggle(key="prune_timeline").set_value(True).run()
    assert not at.exception, at.exception
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert "each layer's sparsity at step 6" in titles
    at.select_slider(key="prune_timeline_at").set_value(0).run()
    titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
    assert not at.exception and "each layer's sparsity at step 0" in titles
