"""The Generate page: live pruning on the shipped pruned model beside its dense twin, replay, exports; dense
models keep the plain view (streamlit AppTest, no browser)."""
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parent.parent / "app" / "views" / "1_Generate.py")


def titles(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text") for c in at.get("plotly_chart")]


def heat(at, i: int = 0):
    """The z of the i-th chart's heatmap (plotly ships numpy arrays as base64 typed arrays)."""
    import base64

    import numpy as np
    z = json.loads(at.get("plotly_chart")[i].proto.spec)["data"][0]["z"]
    if isinstance(z, dict):
        return (np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
                .reshape([int(n) for n in z["shape"].split(",")]))
    return np.array(z, dtype=float)


def generate(model: str, n: int = 24, **widgets) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.session_state["model"] = model
    at.run()
    at.number_input(key="gen_n").set_value(n)
    at.number_input(key="gen_seed").set_value(3)
    for key, value in widgets.items():
        at.checkbox(key=key).set_value(value)
    at.button(key="gen_go").click().run()
    assert not at.exception, at.exception
    return at


def test_pruned_model_streams_drops_beside_its_dense_twin_and_replays():
    at = generate("mha-1024-pruned", 24)
    got = titles(at)
    assert any(t.startswith("mha-1024-pruned: what each layer holds after step 23") for t in got)
    assert "cache held per step" in got and "model latency per token" in got
    labels = {m.label: m.value for m in at.metric}
    assert {"cache held: saved", "cache allocated: saved", "latency pruned / dense twin",
            "tokens before the texts part", "perplexity of own output"} <= set(labels)
    assert float(labels["latency pruned / dense twin"].rstrip("x")) > 0
    # the price on the same text: each output scored by both models, teacher-forced
    price = next(d.value for d in at.dataframe if "scored by" in d.value.columns)
    assert len(price) == 4 and set(price["scored by"]) == {"pruned", "dense twin"} and (price["perplexity"] > 1).all()
    assert any("Price on the same text" in m.value for m in at.markdown)
    assert any("compacted cache" in c.value for c in at.caption)
    import numpy as np
    strip = heat(at)
    n_layers = json.loads((Path(PAGE).parents[2] / "assets/models/mha-1024-pruned/config.json").read_text())["n_layers"]
    assert strip.shape[0] == n_layers and (strip == 0).any()  # some dropped
    # every token is in the cache but the last one sampled, which no forward has taken in yet
    assert np.isfinite(strip[:, :-1]).all() and np.isnan(strip[:, -1]).all()
    # replay: an earlier step holds fewer tokens, and the page says which drops that step made
    at.slider(key="gen_step").set_value(5).run()
    assert any(t.endswith("after step 5") for t in titles(at))
    early = heat(at)
    assert np.isfinite(early[0]).sum() == strip.shape[1] - 1 - (23 - 5)  # later tokens not generated yet
    assert (early == 0).sum() < (strip == 0).sum()
    assert any("drops made at step 5" in c.value for c in at.caption)
    at.selectbox(key="gen_fade_layer").select(2).run()
    assert any("by layer 2" in c.value for c in at.caption)
    # exports: the trace's three files and the figures' buttons
    names = {b.proto.label for b in at.get("download_button")}
    assert {"trace.csv", "trace.drops.csv", "trace.json", "PNG", "SVG", "PDF", "CSV", "JSON"} <= names


def test_exports_are_non_empty_files_of_the_right_type():
    import csv
    import io

    from analysis import export, live
    from models import trace
    from models.checkpoint import load_model_dir

    at = generate("mha-1024-pruned", 12, gen_twin=False)
    assert "cache memory saved" not in {m.label for m in at.metric}  # no twin asked for
    path, res, tr = at.session_state["gen_result"]["runs"][0]
    files = trace.files(tr)  # what the trace buttons serve
    steps = list(csv.DictReader(io.StringIO(files[".csv"])))
    assert len(steps) == 12 and int(steps[-1]["tokens_seen"]) == len(res.prompt_ids) + 11
    drops = list(csv.DictReader(io.StringIO(files[".drops.csv"])))
    assert len(drops) == len(res.drops) > 0
    assert json.loads(files[".json"])["new_ids"] == res.new_ids
    labels = live.labels_of(tr, load_model_dir(path).tokenizer)
    fig = live.strip_figure(tr, 11, labels, "strip")  # what the strip's PNG / SVG / PDF buttons render
    assert export.figure_bytes(fig, "png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in export.figure_bytes(fig, "svg")[:400]
    assert export.figure_bytes(live.cache_curve_figure({"m": tr}, "c"), "pdf")[:5] == b"%PDF-"


def test_dense_model_has_no_pruning_widgets():
    at = generate("mha", 8, gen_greedy=True)
    assert not any(k in {w.key for w in at.slider} for k in ("gen_step",))
    assert "cache memory saved" not in {m.label for m in at.metric}
    assert not any("held per step" in (t or "") for t in titles(at))
    assert any("static cache" in c.value and "kernel path: " in c.value and "attention=reference" in c.value
               and "add_norm=reference" in c.value for c in at.caption)
    assert len(at.dataframe[0].value) == 8


def under_policy(model: str, default: str, method: str, budget: int, n: int) -> AppTest:
    """The page on `model`, whose eviction selector opens on `default`, generating n greedy tokens under `rule`."""
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.session_state["model"] = model
    at.run()
    assert at.selectbox(key="gen_evict").value == default
    at.selectbox(key="gen_evict").select(method).run()
    at.number_input(key="gen_budget").set_value(budget)
    at.number_input(key="gen_n").set_value(n)
    at.checkbox(key="gen_greedy").set_value(True)
    at.button(key="gen_go").click().run()
    assert not at.exception, at.exception
    return at


def test_a_dense_model_under_a_policy_streams_its_evictions_beside_itself_with_nothing_evicted():
    at = under_policy("mha", "none", "h2o-layer", 12, 20)
    (path, res, tr), (_, twin, _) = at.session_state["gen_result"]["runs"]
    assert at.session_state["gen_result"]["labels"] == ["h2o-layer", "nothing evicted"]
    assert res.cache_kind == "compacted" and twin.cache_kind == "static"
    assert max(res.events[-1].live) == 12 and any(e.drops for e in res.events)   # held to the budget, drops recorded
    labels = {m.label for m in at.metric}
    assert {"cache held: saved", "latency h2o-layer / nothing evicted"} <= labels
    # the price: the policy's own output, scored through its replay, is scored as generation scored it (greedy)
    price = next(d.value for d in at.dataframe if "scored by" in d.value.columns)
    own = price[(price["text"] == "h2o-layer's output") & (price["scored by"] == "h2o-layer")]["perplexity"]
    assert float(own.iloc[0]) == pytest.approx(res.perplexity, rel=1e-4)
    import numpy as np
    strip = heat(at)
    assert (np.nan_to_num(strip, nan=1) == 0).any()                             # the strip shows evicted tokens
    assert any(s.value == "h2o-layer vs nothing evicted" for s in at.subheader)


def test_a_pruned_model_under_a_policy_runs_beside_its_own_rule():
    at = under_policy("mha-1024-pruned", "learned", "streamingllm", 8, 16)
    (_, res, _), (_, own, _) = at.session_state["gen_result"]["runs"]
    assert at.session_state["gen_result"]["labels"] == ["streamingllm", "learned rule"]
    assert max(res.events[-1].live) == 8 and own.cache_kind == "compacted"
    assert any("learned rule is off" in c.value for c in at.caption)


def test_an_extractor_offers_no_eviction_and_says_why():
    at = AppTest.from_file(PAGE, default_timeout=300)
    at.session_state["model"] = "we"
    at.run()
    assert not at.exception and "gen_evict" not in {w.key for w in at.selectbox}
    assert any("Extractor" in c.value and "eviction" in c.value for c in at.caption)
