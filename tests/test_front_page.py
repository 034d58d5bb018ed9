"""The front page (app/Models.py, through the entry point): the story, the main result from the committed report,
the one click to the flagship on the Pruning page when its base is here, and the models below."""
import json
import re
import shutil
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from analysis import headline
from analysis.zoo import models_root
from models.delta import WEIGHTS, base_dir_for, read_base_spec

APP = Path(__file__).resolve().parent.parent / "app"
FLAGSHIP_DIR = models_root() / headline.FLAGSHIP


def front() -> AppTest:
    return AppTest.from_file(str(APP / "main.py"), default_timeout=180)


def texts(at) -> list[str]:
    """Everything the page writes as text a reader sees."""
    return [e.value for kind in ("markdown", "caption", "info", "warning", "error", "subheader", "header", "title")
            for e in getattr(at, kind)]


def chart_titles(at) -> list[str]:
    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text") for c in at.get("plotly_chart")]


@pytest.fixture
def fake_base():
    """The flagship's registry base as present (the page only checks that its weights file is there; nothing here
    loads it), removed afterwards: CI has no fetched bases."""
    where = base_dir_for(read_base_spec(FLAGSHIP_DIR)["source"], FLAGSHIP_DIR)
    existed = (where / WEIGHTS).exists()
    if not existed:
        where.mkdir(parents=True, exist_ok=True)
        (where / WEIGHTS).write_bytes(b"")
    yield
    if not existed:
        shutil.rmtree(where)
        # the pages cache what they read of the models folder (the Pruning page's choice of model among them) by the
        # folder's own files: a base gone again must not stay cached as present for the tests that follow
        st.cache_data.clear()


def test_the_first_screen_tells_the_story_and_shows_the_main_result_without_the_base():
    assert FLAGSHIP_DIR.is_dir()
    at = front().run()
    assert not at.exception and not at.error
    shown = " ".join(texts(at))
    assert "adaptively sparse attention" in shown and "eviction policies" in shown
    titles = chart_titles(at)
    # the committed report's sources, in domain and held out, each with the flagship's measured line
    assert any("test (in domain)" in t for t in titles) and any("kjv (held out)" in t for t in titles)
    report = headline.read_main_report()
    for part in headline.headline(report, models_root()):
        assert part["line"] in shown.replace("\\", "")
    # no base: said how to get it, and no button that would open a model that cannot load
    assert any("SmolLM2-135M, is not on this machine yet" in i.value for i in at.info)
    assert not [b for b in at.button if b.key == "front_go"]
    # the models below: the real ones first, then the zoo with its efficiency view
    heads = [s.value for s in at.subheader]
    assert heads.index("Other models") < heads.index("Small models: the toy zoo")
    real, zoo = at.dataframe[0].value, at.dataframe[1].value
    assert headline.FLAGSHIP in set(real["model"]) and "mha" not in set(real["model"])
    assert {"mha", "sha", "mhe-add", "mhe-mul", "me"} <= set(zoo["model"])
    assert any("perplexity vs attention parameters" in t for t in titles)


def test_with_the_base_one_click_opens_the_flagship_on_the_pruning_page_with_every_policy(fake_base):
    at = front().run()
    assert not at.exception
    samples = headline.samples()
    assert len(samples) >= 2
    choice = list(samples)[1]
    at.selectbox(key="front_sample").select(choice).run()
    assert at.text_area(key=f"front_text_{choice}").value == samples[choice]
    at.button(key="front_go").click().run()
    assert at.session_state["shared_text"] == samples[choice]
    assert at.session_state["prune_all"] is True
    assert at.query_params.get("model") in (headline.FLAGSHIP, [headline.FLAGSHIP])


def test_own_text_is_checked_on_the_click(fake_base):
    at = front().run()
    at.selectbox(key="front_sample").select("my own text").run()
    assert not at.button(key="front_go").disabled and not at.warning
    at.button(key="front_go").click().run()
    assert any("empty" in w.value for w in at.warning) and "prune_all" not in at.session_state
    at.text_area(key="front_text_my own text").input("A text of my own, typed just now.").run()
    at.button(key="front_go").click().run()
    assert at.session_state["shared_text"] == "A text of my own, typed just now."


def test_without_a_report_the_page_still_lists_the_models(monkeypatch, tmp_path):
    monkeypatch.setattr(headline, "REPORT", tmp_path / "no-report")
    at = front().run()
    assert not at.exception and not at.error
    assert not any("sparsity against perplexity cost" in t for t in chart_titles(at))
    assert len(at.dataframe) == 2


def test_a_source_is_held_out_only_when_no_run_was_fine_tuned_on_it():
    report = headline.read_main_report()
    trained = headline.trained_dirs(report, models_root())
    assert trained == {"data/smollm2"}   # the cards of the report's learned runs
    man = {"sources": {"test": {"spec": "data/smollm2:test"}, "kjv": {"spec": "data/heldout_kjv:all"},
                       "mine": {"spec": "my_texts/"}, "every": {"spec": "data/smollm2:all"}}}
    assert headline.source_kind(man, "test", trained).startswith("in domain: the test split")
    assert headline.source_kind(man, "kjv", trained).startswith("held out")
    assert headline.source_kind(man, "every", trained).startswith("in domain: its training split included")
    assert headline.source_kind(man, "mine", trained) is None
    assert headline.source_kind(man, "kjv", set()) is None   # no card read: nothing is claimed


def test_no_text_on_the_front_page_sends_the_reader_to_a_file():
    """A browser user has the page, not the checkout: no README, docs/ or .md file named on the first screen."""
    at = front().run()
    for text in texts(at):
        assert not re.search(r"README|docs/|\w\.md\b|papers", text), text
