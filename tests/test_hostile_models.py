"""Hostile model directories on a shared server (`make serve`): every file and field a model directory brings in is
checked where it is read (models/config.py, models/checkpoint.py, models/delta.py, models/snapshots.py), and the
answer is a message naming the file and the field, fast, that tells nothing of a file outside the roots.

A generator writes, from one tiny model, a directory for each config.json / card.json / base.json field of the wrong
type, out of range, missing or oversized; each must be refused by loading (models.checkpoint.load_model_dir and
app.loading.load_for_app), the zoo listing (analysis.zoo) and the config planning (analysis.budgets.config_of)
within a second."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from analysis import zoo
from analysis.budgets import config_of
from app import access
from app.loading import load_for_app
from models import checkpoint, delta, snapshots
from models.checkpoint import CheckpointError, load_model_dir, save_delta_dir, save_model_dir
from models.config import LIMITS, ConfigError, ModelConfig
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, randomize, tiny_config

APP = Path(__file__).resolve().parent.parent / "app"
FAST_S = 1.0   # every refusal here answers within this (the red team's 20,000-layer config took 128 s)


@pytest.fixture(scope="module")
def tok():
    return train_bpe(["the cat sat on the mat", "a dog ran"] * 10, vocab_size=270, min_frequency=1)


@pytest.fixture
def serve(tmp_path, monkeypatch):
    """Serve mode with one root (tmp/lab) and an empty models folder (tmp/models); tmp/outside is neither."""
    root, models, outside = tmp_path / "lab", tmp_path / "models", tmp_path / "outside"
    for d in (root, models, outside):
        d.mkdir()
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.setenv("MIXSCOPE_PATH_ROOTS", str(root))
    monkeypatch.setenv("MIXSCOPE_MODELS", str(models))
    monkeypatch.delenv("MIXSCOPE_MAX_WEIGHTS_MB", raising=False)
    return root


@pytest.fixture
def good(serve, tok):
    """A tiny model directory inside the root (random weights: a base a delta can differ from)."""
    model = DecoderLM(tiny_config("mha", vocab_size=300))
    randomize(model, seed=1)
    return save_model_dir(serve / "good", model, tok, {"steps": 3, "train": {"init_from": None}})


def fine_tune(base_dir: Path) -> DecoderLM:
    """A delta's model over `base_dir`: the base's weights plus context pruning's own tensors."""
    base = load_model_dir(base_dir)
    model = DecoderLM(tiny_config("mha", vocab_size=300, prune=True, prune_r=4))
    model.load_state_dict(base.model.state_dict(), strict=False)
    return model.eval()


@pytest.fixture
def a_delta(good, serve, tok):
    """A delta directory inside the root over `good` (base.json: "../good")."""
    return save_delta_dir(serve / "delta", fine_tune(good), tok, "../good")


# ---- the generator: one directory per hostile field -------------------------------------------------------------

BIG_INT = 10**30
CONFIG_CASES = [  # (id, edit of config.json's dict, the field the message must name)
    ("20000 layers", {"n_layers": 20000}, "n_layers"),
    ("red team's prune + string layers + huge width", {"prune": True, "n_layers": "AAAAA", "d_model": 200000000},
     "d_model"),
    ("string layers", {"n_layers": "AAAAA"}, "n_layers"),
    ("layers a float", {"n_layers": 4.5}, "n_layers"),
    ("layers a bool", {"n_layers": True}, "n_layers"),
    ("layers null", {"n_layers": None}, "n_layers"),
    ("layers negative", {"n_layers": -3}, "n_layers"),
    ("heads a string", {"n_heads": "8"}, "n_heads"),
    ("heads zero", {"n_heads": 0}, "n_heads"),
    ("width a string", {"d_model": "wide"}, "d_model"),
    ("vocabulary a list", {"vocab_size": [300]}, "vocab_size"),
    ("mixer a list", {"mixer": ["mha"]}, "mixer"),
    ("mixer unknown", {"mixer": "flash"}, "mixer"),
    ("dropout a string", {"dropout": "none"}, "dropout"),
    ("dropout NaN", {"dropout": float("nan")}, "dropout"),
    ("ln_eps infinite", {"ln_eps": float("inf")}, "ln_eps"),
    ("rope_theta negative", {"rope_theta": -1.0}, "rope_theta"),
    ("prune a string", {"prune": "yes"}, "prune"),
    ("tie_embeddings a number", {"tie_embeddings": 1}, "tie_embeddings"),
    ("norm a number", {"norm": 5}, "norm"),
    ("adapter a dict", {"adapter": {"kind": "phm"}}, "adapter"),
    ("n_kv_heads a string", {"n_kv_heads": "two"}, "n_kv_heads"),
    ("prune_sinks negative", {"prune_sinks": -1}, "prune_sinks"),
    ("a 4,000-digit width", {"d_model": int("9" * 4000)}, "d_model"),
    ("an unknown field", {"colour": "red"}, "colour"),
] + [  # each whole-number field one past its limit, and far past it
    (f"{name} over its limit", {name: most + 1}, name) for name, most in LIMITS.items()
] + [
    (f"{name} 10^30", {name: BIG_INT}, name) for name in ("vocab_size", "context", "d_ff", "prune_r")
] + [  # within every limit, together past the memory budget: refused by what the config builds
    ("over the memory budget", {"n_layers": 100, "d_model": 8192, "n_heads": 64, "d_head": 128, "d_ff": 32768},
     "n_layers"),
    ("a vocabulary over the memory budget", {"vocab_size": 2**20, "d_model": 2**14, "n_heads": 128}, "vocab_size"),
]

CARD_CASES = [  # (id, edit of card.json's dict, the field the message must name)
    ("init_from a number", {"train": {"init_from": 5}}, "train.init_from"),
    ("init_from a list", {"train": {"init_from": ["../x"]}}, "train.init_from"),
    ("init_from with a NUL", {"train": {"init_from": "a\x00b"}}, "train.init_from"),
    ("init_from 10,000 characters", {"train": {"init_from": "x" * 10000}}, "train.init_from"),
    ("train a string", {"train": "fast"}, "train"),
    ("train null", {"train": None}, "train"),
    ("freeze_base a string", {"train": {"freeze_base": "yes"}}, "train.freeze_base"),
    ("data a list", {"data": ["d"]}, "data"),
    ("data.dir a number", {"data": {"dir": 7}}, "data.dir"),
    ("perplexity a string", {"test_perplexity": "low"}, "test_perplexity"),
    ("speed infinite", {"train_tokens_per_s": float("inf")}, "train_tokens_per_s"),
    ("steps negative", {"steps": -1}, "steps"),
    ("steps a float", {"steps": 1.5}, "steps"),
    ("sparsity over 1", {"final_valid_sparsity": 2.0}, "final_valid_sparsity"),
    ("query sparsity a string", {"final_valid_query_sparsity": "most"}, "final_valid_query_sparsity"),
    ("status a number", {"status": 5}, "status"),
    ("weights_dtype unknown", {"weights_dtype": "int8"}, "weights_dtype"),
]

SPEC_CASES = [  # (id, base.json as written, the field the message must name)
    ("source a number", {"source": 5}, "base"),
    ("source missing", {"source": None}, "base"),
    ("source empty", {"source": ""}, "source"),
    ("source with a NUL", {"source": "../go\x00od"}, "source"),
    ("source 10,000 characters", {"source": "x" * 10000}, "source"),
    ("weights_sha256 not hex", {"weights_sha256": "zz"}, "base"),
    ("weights_sha256 missing", {"weights_sha256": None}, "base"),
    ("wheel_sha256 a number", {"wheel_sha256": 5}, "wheel_sha256"),
    ("replaces a string", {"replaces": "everything"}, "replaces"),
    ("replaces of numbers", {"replaces": [1, 2]}, "replaces"),
    ("a registry spec with options", {"source": "pypi:-r http://evil/x"}, "base.json"),
]


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def hostile(case_kind: str, edit, good: Path, a_delta: Path) -> Path:
    """The directory a case describes (written over a copy of `good` or `a_delta`, in place)."""
    if case_kind == "config":
        cfg = json.loads((good / "config.json").read_text())
        cfg.update(edit)
        write_json(good / "config.json", cfg)
        return good
    if case_kind == "card":
        card = json.loads((good / "card.json").read_text())
        card.update(edit)
        write_json(good / "card.json", card)
        return good
    spec = json.loads((a_delta / "base.json").read_text())
    spec.update(edit)
    write_json(a_delta / "base.json", {k: v for k, v in spec.items() if v is not None})
    return a_delta


CASES = ([("config", *c) for c in CONFIG_CASES] + [("card", *c) for c in CARD_CASES]
         + [("base", *c) for c in SPEC_CASES])


def refused_fast(call, *names: str) -> str:
    """call() raises CheckpointError or ConfigError within FAST_S, whose message holds every one of names."""
    start = time.perf_counter()
    with pytest.raises((CheckpointError, ConfigError)) as e:
        call()
    took = time.perf_counter() - start
    assert took < FAST_S, f"{took:.2f} s"
    message = str(e.value)
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.mark.parametrize("kind, case, edit, field", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_each_hostile_field_is_refused_fast_naming_file_and_field(kind, case, edit, field, good, a_delta):
    path = hostile(kind, edit, good, a_delta)
    file = {"config": "config.json", "card": "card.json", "base": "base.json"}[kind]
    refused_fast(lambda: load_model_dir(path), file, field)
    refused_fast(lambda: load_for_app(path), file, field)
    refused_fast(lambda: checkpoint.inspect_model_dir(path), file, field)
    start = time.perf_counter()
    row = zoo.describe(path)                       # the Models page's row: an error, never an exception
    assert time.perf_counter() - start < FAST_S and file in row["error"] and field in row["error"], row
    table = zoo.zoo_table([path])
    assert table["error"].iloc[0] == row["error"]
    if kind == "config":                           # a page's and analysis.export's plan, before anything loads
        refused_fast(lambda: config_of(path), file, field)
        refused_fast(lambda: checkpoint.read_json(path / "config.json"), file, field)   # (the Pruning page's read)
    if kind == "card":
        refused_fast(lambda: checkpoint.read_json(path / "card.json"), file, field)


@pytest.mark.parametrize("name, size, message", [
    ("config.json", 64 * 2**10 + 1, "at most 65,536 are read"),
    ("card.json", 4 * 2**20 + 1, "are read"),
    ("tokenizer.json", 64 * 2**20 + 1, "are read"),
])
def test_oversized_files_are_refused_before_they_are_read(name, size, message, good):
    with open(good / name, "r+b") as f:   # (a sparse file: its size is refused before a byte of it is read)
        f.truncate(size)
    refused_fast(lambda: load_model_dir(good), name, message)


def test_oversized_and_malformed_json_are_messages(good):
    (good / "config.json").write_text("[" * 20_000 + "]" * 20_000)   # nested past the parser's recursion limit
    refused_fast(lambda: load_model_dir(good), "config.json", "not valid JSON")
    (good / "config.json").write_text('{"n_layers": ' + "9" * 5000 + "}")   # past Python's int digit limit
    refused_fast(lambda: load_model_dir(good), "config.json", "not valid JSON")
    (good / "config.json").unlink()
    os.mkfifo(good / "config.json")                                       # a FIFO is never opened for reading
    refused_fast(lambda: load_model_dir(good), "config.json")


def test_missing_files_are_named(good):
    for name in ("config.json", "card.json", "tokenizer.json", "model.safetensors"):
        shutil.copytree(good, good.parent / name)
        (good.parent / name / name).unlink()
        refused_fast(lambda: load_model_dir(good.parent / name), name, "is missing")


def test_a_safetensors_header_that_claims_more_than_the_file_is_refused_unparsed(good):
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + data[8:])
    for call in (lambda: load_model_dir(good), lambda: checkpoint.inspect_model_dir(good)):
        refused_fast(call, "model.safetensors", "header claims")


# ---- where files may be read from -------------------------------------------------------------------------------

HEX = re.compile(r"[0-9a-f]{16}")


def test_a_base_whose_weights_link_out_of_the_root_gets_one_message_telling_nothing(serve, a_delta, good, tmp_path):
    """The base directory is inside the root, its model.safetensors a link out: to /etc/passwd, to a missing
    file, to a large (real safetensors) file outside: one message for all, with no digest and no outside path;
    the model never loads from outside."""
    outside = tmp_path / "outside"
    shutil.move(str(good / "model.safetensors"), outside / "big.safetensors")
    messages = set()
    for target in ("/etc/passwd", str(outside / "missing.safetensors"), str(outside / "big.safetensors")):
        (good / "model.safetensors").unlink(missing_ok=True)
        os.symlink(target, good / "model.safetensors")
        for call in (lambda: load_model_dir(a_delta), lambda: load_for_app(a_delta),
                     lambda: checkpoint.inspect_model_dir(a_delta)):
            message = refused_fast(call, "base.json")
            assert not HEX.search(message) and str(outside) not in message and "/etc" not in message, message
            messages.add(message)
        messages.add(zoo.describe(a_delta)["error"])
        problem = access.model_dir_problem(a_delta)
        assert problem and "base" in problem and "/etc" not in problem and str(outside) not in problem
        messages.add(problem)
    assert len(messages) == 2, messages   # one from the loaders and the listing, one phrasing of it up front
    assert len({m for m in messages if m.startswith(str(a_delta))}) == 1


def test_a_base_json_that_names_a_directory_outside_gets_the_same_message(serve, a_delta, good, tmp_path):
    shutil.copytree(good, tmp_path / "outside" / "base")
    spec = json.loads((a_delta / "base.json").read_text())
    said = set()
    for source in ("../../outside/base", str(tmp_path / "outside" / "base"), "/etc", "../../outside/nothing",
                   "~daemon", "~nosuchuser/base"):
        write_json(a_delta / "base.json", spec | {"source": source})
        message = refused_fast(lambda: load_model_dir(a_delta), "base.json")
        assert not HEX.search(message) and str(tmp_path / "outside") not in message and "/etc" not in message
        said.add(message)
    assert len(said) == 1, said


def test_a_member_file_linking_out_says_the_same_whatever_it_points_at(serve, good, tmp_path):
    said = set()
    for target in ("/etc/passwd", str(tmp_path / "outside" / "missing.json")):
        (good / "card.json").unlink()
        os.symlink(target, good / "card.json")
        for call in (lambda: load_model_dir(good), lambda: checkpoint.inspect_model_dir(good)):
            said.add(refused_fast(call, "card.json", "links outside"))
        said.add(access.model_dir_problem(good))
    assert len(said) == 2, said   # the loaders' message, and model_dir_problem's phrasing


def test_the_weights_cap_counts_the_base(serve, a_delta, good, monkeypatch):
    own = (a_delta / "model.safetensors").stat().st_size
    base = (good / "model.safetensors").stat().st_size
    cap = own + base - 1                           # each file alone is under it, the two together are not
    assert max(own, base) < cap
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: pytest.fail("weights were read"))
    monkeypatch.setattr(delta, "load_file", lambda *a, **k: pytest.fail("weights were read"))
    refused_fast(lambda: load_model_dir(a_delta, max_weight_bytes=cap), "its base's weights", "at most")
    monkeypatch.setenv("MIXSCOPE_MAX_WEIGHTS_MB", repr(cap / 2**20))   # the server's cap, as an operator sets it
    refused_fast(lambda: load_for_app(a_delta), "its base's weights", "at most")
    assert access.max_weight_bytes() == cap


def test_a_config_that_implies_weights_over_the_cap_is_refused_unread(serve, good, monkeypatch):
    params = ModelConfig.load(good / "config.json").param_count()
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: pytest.fail("weights were read"))
    refused_fast(lambda: load_model_dir(good, max_weight_bytes=2 * params - 1), "config.json",
                 "this server opens weights files of at most")


def test_snapshots_that_link_out_of_the_directory_are_not_read(serve, good, tmp_path):
    elsewhere = tmp_path / "outside" / "run"
    snapshots.save(elsewhere, {"blocks.0.ln_1.weight": torch.ones(16)}, 0, {"alpha": 1.0})
    os.symlink(elsewhere / "snapshots", good / "snapshots")
    assert snapshots.listing(good) == []
    assert snapshots.entry(good, good / "snapshots" / "step_000000.safetensors") is None
    assert "snapshots in it links outside" in access.model_dir_problem(good)
    refused_fast(lambda: load_model_dir(good), "snapshots", "links outside")
    os.unlink(good / "snapshots")                  # a folder of its own is read
    snapshots.save(good, {"blocks.0.ln_1.weight": torch.ones(16)}, 0, {"alpha": 1.0})
    assert [s["step"] for s in snapshots.listing(good)] == [0] and access.model_dir_problem(good) is None


@pytest.mark.parametrize("typed", [["~daemon", "~nosuchuser"], ["~daemon/x", "~nosuchuser/x"], ["~", "~root"]])
def test_a_typed_tilde_is_never_expanded(serve, typed):
    """'~daemon' exists on most servers and '~nosuchuser' does not: the answers must not tell them apart."""
    said = {access.outside_roots(p) for p in typed}
    assert len(said) == 1 and "outside the directories" in said.pop()
    said = {access.model_dir_problem(p) for p in typed}
    assert len(said) == 1 and "outside the directories" in said.pop()
    said = {refused_fast(lambda: load_model_dir(p), "outside the directories") for p in typed}
    assert len({s.split(":", 1)[1] for s in said}) == 1


def test_inside_the_root_everything_still_loads(serve, a_delta, good):
    """The checks refuse what they should only: a delta over a base inside the root, a model in the models folder
    reached through a symlink, load in serve mode and list without an error."""
    assert access.model_dir_problem(a_delta) is None and zoo.describe(a_delta)["error"] is None
    merged = load_for_app(a_delta)
    assert merged.config.prune and load_model_dir(good).config.n_layers == 2
    os.symlink(good, Path(os.environ["MIXSCOPE_MODELS"]) / "linked")
    assert load_for_app(Path(os.environ["MIXSCOPE_MODELS"]) / "linked").config.n_layers == 2


# ---- sizes are planned without building -------------------------------------------------------------------------

OPTIONS = [{}, dict(prune=True, prune_r=4), dict(adapter="adapter", adapter_reduction=4),
           dict(adapter="phm", adapter_reduction=4, phm_n=2), dict(adapter="compacter", adapter_reduction=4, phm_n=2),
           dict(adapter="compacter++", adapter_reduction=4, phm_n=2), dict(tie_embeddings=False),
           dict(norm="rmsnorm", ffn="swiglu", ffn_bias=False), dict(positions="rope"), dict(extractor_out=False),
           dict(attn_bias=True), dict(pattern="local", pattern_k=4)]


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_sizes_counted_without_building_equal_the_built_model(mixer):
    """ModelConfig.param_count, checkpoint.expected_shapes and zoo.layered_counts (what the checks and the
    listing use, at a cost that does not grow with n_layers) equal what DecoderLM builds."""
    from models.params import count_parameters, count_trainable
    for extra in OPTIONS:
        try:
            cfg = tiny_config(mixer, n_layers=3, **extra)
        except ConfigError:
            continue
        with torch.device("meta"):
            model = DecoderLM(cfg)
        assert cfg.param_count() == sum(p.numel() for p in model.parameters()), extra
        assert checkpoint.expected_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}, extra
        counts = zoo.layered_counts(cfg, freeze_base=True)
        assert {k: counts[k] for k in count_parameters(model)} == count_parameters(model), extra
        assert counts["trainable"] == count_trainable(model, True)["total"]
        assert counts["kv"] == model.cache_bytes_per_token()


def test_the_configs_budget_is_the_planners(monkeypatch):
    from models import config
    from models.memory import memory_budget
    for mb in ("4096", "300", "1.5e3"):
        monkeypatch.setenv("MIXSCOPE_MEMORY_MB", mb)
        assert config._memory_budget() == memory_budget()


def test_the_budget_bounds_what_a_config_may_build(monkeypatch):
    cfg = dict(mixer="mha", n_layers=12, d_model=2048, n_heads=16, vocab_size=50000, context=2048)
    ModelConfig.from_dict(cfg)                        # 0.7 G parameters: 2.6 GB in float32, within 4 GB ...
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "2048")  # ... over a 2 GB budget
    with pytest.raises(ConfigError, match=r"n_layers=12 .* over the 2\.0 GB memory budget \(MIXSCOPE_MEMORY_MB\)"):
        ModelConfig.from_dict(cfg)
    ModelConfig(**cfg)   # (a config made in code, not read from a file, is not planned against the budget)


def test_the_shipped_models_pass_every_check(monkeypatch):
    monkeypatch.setenv("MIXSCOPE_SERVE", "1")
    monkeypatch.delenv("MIXSCOPE_MODELS", raising=False)
    for path in zoo.find_model_dirs(zoo.models_root()):
        assert access.model_dir_problem(path) is None, path
        assert zoo.describe(path)["error"] is None, path
        checkpoint.read_card(path / "card.json")


# ---- the pages ---------------------------------------------------------------------------------------------------

@pytest.mark.full
def test_the_models_page_shows_a_hostile_directory_as_a_message_and_forgets_it_on_request(serve, good, tok):
    from streamlit.testing.v1 import AppTest
    zoo_dir = Path(os.environ["MIXSCOPE_MODELS"])
    save_model_dir(zoo_dir / "fine", DecoderLM(tiny_config("mha", vocab_size=300)), tok)
    card = json.loads((good / "card.json").read_text()) | {"train": "a string", "data": ["x"]}
    write_json(good / "card.json", card)
    at = AppTest.from_file(str(APP / "Models.py"), default_timeout=120)
    at.session_state["added_paths"] = [str(good)]
    at.run()
    assert not at.exception, at.exception
    assert any("card.json" in e.value and "train" in e.value for e in at.error)
    assert any(c.value.startswith("1 model(s) found") for c in at.caption)
    at.multiselect(key="remove_added").select(str(good)).run()
    at.button(key="remove_added_button").click().run()
    assert not at.exception and at.session_state["added_paths"] == []
    assert not any("card.json" in e.value for e in at.error)


@pytest.mark.full
def test_the_pruning_page_answers_hostile_directories_with_messages(tmp_path, monkeypatch, tok):
    """A config with a string where a number belongs (next to a pruned model: the page compares their sizes to
    choose where to open), and a pruned model whose card's init_from is a number: messages, not Streamlit's error."""
    from streamlit.testing.v1 import AppTest
    cfg = dict(mixer="mha", vocab_size=300, context=24, d_model=16, n_layers=2, n_heads=4, prune=True, prune_r=4)
    save_model_dir(tmp_path / "pruned", DecoderLM(ModelConfig(**cfg)), tok, {"train": {"init_from": 5}})
    (tmp_path / "z-evil").mkdir()
    write_json(tmp_path / "z-evil" / "config.json", {"prune": True, "n_layers": "AAAAA", "d_model": 20})
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path))
    at = AppTest.from_file(str(APP / "views" / "7_Pruning.py"), default_timeout=180).run()
    assert not at.exception, at.exception
    assert any("card.json" in e.value and "train.init_from" in e.value for e in at.sidebar.error)
