"""Every page of the app against the real models in assets/models (streamlit AppTest, no browser)."""
import json
import re
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from analysis import maps
from analysis.zoo import find_model_dirs, models_root

APP = Path(__file__).resolve().parent.parent / "app"
PAGES = ["Models.py"] + sorted(p.name for p in (APP / "views").glob("*.py"))


@pytest.fixture(scope="module", autouse=True)
def zoo():
    names = {p.name for p in find_model_dirs(models_root())}
    missing = {"mha", "sha", "mhe-mul", "mhe-add", "we", "me"} - names
    assert not missing, f"the shipped zoo in {models_root()} lacks {missing}"
    return names


def last_layer(model: str) -> int:
    return json.loads((models_root() / model / "config.json").read_text())["n_layers"] - 1


def page(name: str) -> AppTest:
    """A page alone; the Models page through the entry point (its default page), so that tests can switch from it
    to the other pages as a browser does."""
    path = APP / "main.py" if name == "Models.py" else APP / "views" / name
    return AppTest.from_file(str(path), default_timeout=180)


def titles(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text") for c in at.get("plotly_chart")]


def test_one_entry_point_declares_every_page_and_no_page_edits_sys_path():
    import re
    declared = re.findall(r'st\.Page\("([^"]+)"', (APP / "main.py").read_text())
    assert sorted(declared) == sorted(["Models.py"] + [f"views/{p}" for p in PAGES[1:]])
    at = AppTest.from_file(str(APP / "main.py"), default_timeout=180).run()
    assert not at.exception and at.title[0].value == "mixscope"
    at.switch_page("views/2_Attention.py").run()
    assert not at.exception and at.title[0].value == "Attention"
    assert not [p.name for p in APP.rglob("*.py") if "sys.path" in p.read_text()]
    # a pages/ folder beside main.py puts Streamlit in its legacy mode: a first visit to /Pruning would run that
    # page alone, with its own sidebar ("main", ...), and main.py's navigation would never take over
    assert not (APP / "pages").exists()


@pytest.mark.parametrize("name", PAGES)
def test_page_renders_without_exceptions(name):
    at = page(name).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    # a browser user has the page, not the checkout: no text sends them to a file of it (a report's recorded
    # command line, shown as data, names its output directory)
    shown = [e.value for kind in ("markdown", "caption", "info", "warning", "subheader", "header", "title")
             for e in getattr(at, kind) if not e.value.startswith("python -m ")]
    assert not [t for t in shown if re.search(r"README|docs/|\w\.md\b|papers", t)]


def listed(at) -> list[str]:
    """Every model the front page's tables name."""
    return [m for d in at.dataframe if "model" in d.value for m in d.value["model"]]


def zoo_table(at):
    """The front page's toy-zoo table (the real models' comes first)."""
    return next(d.value for d in at.dataframe if "mha" in set(d.value["model"]))


def test_models_page_table_and_efficiency_view(zoo):
    at = page("Models.py").run()
    table = zoo_table(at)
    assert set(zoo) - {p.name for p in models_root().glob("smollm2-*")} <= set(table["model"])
    assert {"attention params", "test ppl", "PRR", "PEoP", "KV-cache bytes/token"} <= set(table.columns)
    assert table.loc[table["mixer"] == "mha", "PRR"].iloc[0] == pytest.approx(1.0)
    assert any("perplexity vs attention parameters" in t for t in titles(at))
    at.text_input(key="extra_path").input("/nonexistent/model").run()
    assert any("does not exist" in e.value for e in at.error)
    assert len(zoo_table(at)) == len(table)   # the others keep working
    for bad, why in [("/tmp/a\x00b", "no control characters"), ("/tmp/" + "n" * 300, "at most 255 bytes")]:
        at.text_input(key="extra_path").input(bad).run()   # refused before the filesystem sees it; nothing breaks
        assert not at.exception and any(why in e.value for e in at.error)
        assert len(zoo_table(at)) == len(table)
    at.switch_page("views/2_Attention.py").run()
    assert not at.exception


def test_a_model_added_by_path_reaches_the_other_pages(tmp_path):
    import shutil
    shutil.copytree(models_root() / "me", tmp_path / "my-model")
    at = page("Models.py").run()
    at.text_input(key="extra_path").input(str(tmp_path / "my-model")).run()
    assert "my-model" in listed(at)
    at.switch_page("views/4_Extractors.py").run()
    assert "my-model" in at.sidebar.selectbox(key="model").options


def test_two_models_with_one_name_both_open(tmp_path):
    """A run called `mha` beside the shipped `mha`: both are listed, told apart by where they live, and each opens."""
    import shutil
    shutil.copytree(models_root() / "me", tmp_path / "mha")   # an Extractor under the shipped MHA's name
    at = page("Models.py").run()
    at.text_input(key="extra_path").input(str(tmp_path / "mha")).run()
    assert {"mha (shipped)", f"mha ({tmp_path})"} <= set(listed(at))
    at.switch_page("views/4_Extractors.py").run()
    at.sidebar.selectbox(key="model").select(f"path:{tmp_path / 'mha'}").run()
    assert not at.exception and not any("(me):" in i.value for i in at.info)        # the Extractor opened
    at.sidebar.selectbox(key="model").select("mha").run()
    assert any(i.value.startswith("mha (shipped) (mha):") for i in at.info)       # the shipped MHA, refused here


def test_a_symlinked_model_keeps_its_folder_name_as_its_id(tmp_path):
    """A models folder of symlinks (a lab linking its runs in, the browser benchmark's zoo): each model's id is its
    name there, so `?model=NAME` opens it (the id was once taken after resolving the link, 'path:...', and the query
    parameter fell back to the first model)."""
    from analysis.zoo import model_id, model_labels
    (tmp_path / "linked").symlink_to(models_root() / "me")
    (tmp_path / "real").mkdir()
    assert model_id(tmp_path / "linked", tmp_path) == "linked" and model_id(tmp_path / "real", tmp_path) == "real"
    assert model_id(models_root() / "me", tmp_path).startswith("path:")       # outside the root, as given
    (tmp_path / "real" / "mha").mkdir()
    # through a link and back up: not a folder of the root, however the text reads (it opens elsewhere)
    assert model_id(tmp_path / "linked" / ".." / "real", tmp_path).startswith("path:")
    assert model_labels([tmp_path / "linked"], tmp_path) == {"linked": "linked"}


def test_generate_streams_and_reports_speed():
    at = page("1_Generate.py").run()
    at.number_input(key="gen_n").set_value(8)
    at.checkbox(key="gen_greedy").check()
    at.button(key="gen_go").click().run()
    assert not at.exception
    metrics = {m.label: m.value for m in at.metric}
    assert float(metrics["tokens/s (decode)"]) > 0 and "cache held" in metrics
    assert any("kernel path: " in c.value and "attention=reference" in c.value and "add_norm=reference" in c.value
               for c in at.caption)
    assert len(at.dataframe[0].value) == 8


def test_generate_refuses_an_empty_prompt():
    at = page("1_Generate.py").run()
    at.text_area(key="gen_prompt").input("   ").run()
    at.button(key="gen_go").click().run()
    assert "prompt is empty" in at.warning[0].value


def test_attention_selectors_change_the_view_without_rerunning_the_model(monkeypatch):
    st.cache_data.clear()
    calls = []
    real = maps.mixing_maps
    monkeypatch.setattr(maps, "mixing_maps", lambda *a, **k: calls.append(1) or real(*a, **k))
    at = page("2_Attention.py").run()
    assert titles(at)[-1] == f"mha: layer {last_layer('mha')}, head 0"
    at.selectbox(key="attn_layer").select(1).run()
    at.selectbox(key="attn_head").select(2).run()
    assert titles(at)[-1] == "mha: layer 1, head 2" and len(calls) == 1


def test_attention_long_text_gets_a_window_and_bad_text_a_message():
    at = page("2_Attention.py").run()
    at.text_area(key="text_area").input("the river and the town " * 120).run()
    assert any("Window start" in s.label for s in at.slider)
    at.text_area(key="text_area").input("x" * 20_001).run()   # the box takes at most 20,000 characters
    assert len(at.text_area(key="text_area").value) <= 20_000 and not at.exception
    at.text_area(key="text_area").input("").run()
    assert "empty" in at.warning[0].value


def test_attention_page_on_extractor_and_mhe_add():
    at = page("2_Attention.py").run()
    at.sidebar.selectbox(key="model").select("we").run()
    assert "Extractor mixing weights" in titles(at)[0]
    at.radio(key="attn_summary").set_value("rms").run()        # WE: the RMS beside the signed mean
    assert titles(at)[0] == "we: RMS over channels of the lag weights, per layer" and not at.exception
    at.sidebar.selectbox(key="model").select("she").run()      # SHE: per-lag norms, never the signed mean
    assert titles(at)[0].startswith("she: norm of d x_ext_i / d x_j") and not at.exception
    assert any(t.startswith("she: Frobenius norm of W^ext per lag") for t in titles(at))
    at.sidebar.selectbox(key="model").select("mhe-add").run()
    assert any("e^K" in i.value for i in at.info)


def test_heads_page_mhe_and_side_by_side():
    at = page("3_Heads.py").run()
    assert titles(at)[0].startswith("mhe-mul: e_Q")
    at.selectbox(key="a_kind").select("g").run()
    assert titles(at)[0].startswith("mhe-mul: g")
    at.sidebar.checkbox(key="heads_side").check().run()
    assert not at.exception and any(t.startswith("mha: QK circuits") for t in titles(at))
    assert "mha: cosine similarity of QK circuits, all layers" in titles(at)
    at.selectbox(key="b_layer").set_value(1).run()
    assert "mha: cosine similarity of QK circuits, layer 1" in titles(at) and not at.exception
    at.sidebar.selectbox(key="model").select("me").run()
    assert any("no attention heads" in i.value for i in at.info)


def test_extractors_page():
    at = page("4_Extractors.py").run()
    assert titles(at)[0].startswith("me: the lag weight")
    at.sidebar.selectbox(key="model").select("we").run()
    assert any("lag x channel" in t for t in titles(at))
    assert titles(at)[0].startswith("we: the lag's weights over channels, signed mean and RMS")
    at.sidebar.selectbox(key="model").select("she").run()
    assert titles(at)[0].startswith("she: Frobenius norm of the lag's d x d matrix") and not at.exception
    at.sidebar.selectbox(key="model").select("mha").run()
    assert any("not an Extractor model" in i.value for i in at.info)


def test_attribution_methods():
    at = page("5_Attribution.py").run()
    first = titles(at)[0]
    assert "integrated gradients" in first
    at.selectbox(key="attr_method").select("saliency").run()
    assert "saliency" in titles(at)[0] and not at.exception
    at.radio(key="attr_target").set_value("the model's top choice").run()
    at.slider(key="attr_pos").set_value(3).run()
    assert "after position 3" in at.markdown[0].value


def test_compare_two_models():
    at = page("6_Compare.py").run()
    assert {"per-token surprisal", f"A - B: layer {last_layer('mha')}, head 0"} <= set(titles(at))
    assert len(at.metric) == 4


def test_compare_times_a_fresh_forward_on_each_run_and_keeps_the_maps():
    """The latency is measured on every run, never read from a cache (a cached time showed the first visitor's);
    the maps are kept for the layer and head pickers. (In a browser those rerun their fragment alone; AppTest reruns
    the whole page.)"""
    from app import common
    at = page("6_Compare.py").run()
    model_a = common.load(str(common.model_paths()[[p.name for p in common.model_paths()].index("mha")])).model
    forwards = []
    hook = model_a.register_forward_hook(lambda *_: forwards.append(1))
    try:
        at.run()
        assert len(forwards) == 2 and not at.exception   # model A's two timed forwards; its maps from the cache
        at.selectbox(key="cmp_layer").select(0).run()
        assert len(forwards) == 4 and "A mha: layer 0" in titles(at)
    finally:
        hook.remove()
