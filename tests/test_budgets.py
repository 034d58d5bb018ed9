"""Views and memory budgets (analysis.views, analysis.budgets on models.memory's planner): the pages and
analysis.export draw the same windows; models.evaluate scores in token-sized batches with the head applied in chunks,
equal to the direct computation; every command refuses what would not fit before any model work, naming what fits,
and accepts its largest input."""
import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from analysis import budgets, export, views
from analysis.text import MAX_CHARS, Tokens, decode_upload, tokenize, window
from analysis.zoo import models_root
from models import evaluate, memory
from models.checkpoint import load_model_dir
from models.config import ModelConfig
from models.memory import RUNTIME_BYTES, OverBudget, forward_bytes, weights_bytes
from models.scoring import head_logprobs, target_logprobs
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

REPO = Path(__file__).resolve().parent.parent
VIEWS = REPO / "app" / "views"


def fake_tokens(n: int) -> Tokens:
    return Tokens(list(range(n)), [f"t{i}" for i in range(n)], [(i, i + 1) for i in range(n)])


# ---- one place for the views -----------------------------------------------------------------------------------

def test_pages_and_modules_take_their_limits_from_views():
    src = {p.stem: p.read_text(encoding="utf-8") for p in VIEWS.glob("*.py")}
    assert "from analysis.views import ATTENTION_VIEW as MAX_VIEW" in src["2_Attention"]
    assert "MAX_VIEW = views.ATTRIBUTION_VIEW" in src["5_Attribution"]
    assert "views.view(views.COMPARE_VIEW" in src["6_Compare"]
    assert "MAX_VIEW = views.PRUNING_VIEW" in src["7_Pruning"]
    # no page keeps a literal window of its own
    assert not [name for name, s in src.items() if "MAX_VIEW = 1" in s or "MAX_VIEW = 2" in s]
    from analysis import live, scores, text
    assert text.MAX_CHARS is views.MAX_CHARS == 20_000
    assert scores.VIEW == views.SCORES_VIEW and live.MAX_STRIP == views.LIVE_STRIP   # (to import from views)


@pytest.mark.parametrize("n, context", [(5000, 8192), (600, 256), (100, 512), (40, 24)])
def test_export_draws_the_windows_the_pages_open_on(n, context):
    from app.common import window_picker   # (bare mode: its slider returns its default, the first window)
    toks = fake_tokens(n)
    got = export.app_windows(toks, context)
    for page, size in (("attention", views.ATTENTION_VIEW), ("attribution", views.ATTRIBUTION_VIEW)):
        want, start = window_picker(toks, context, f"test_{page}", size)
        assert start == 0 and got[page].ids == want.ids and got[page].labels == want.labels
    # Compare reads the first COMPARE_VIEW tokens of the text under both models' contexts
    assert got["compare"].ids == window(toks, 0, min(context, views.COMPARE_VIEW)).ids


@pytest.fixture(scope="module")
def mha():
    return load_model_dir(models_root() / "mha")


def test_export_of_the_longest_accepted_text_draws_the_app_windows(tmp_path, mha):
    path = tmp_path / "long.txt"
    words = ("The committee met again on Tuesday to talk about the harbour and the roads. " * 400)[:MAX_CHARS]
    path.write_text(words, encoding="utf-8")
    text = decode_upload(path.name, path.read_bytes())          # the most accepted: 20,000 characters
    assert len(text) == MAX_CHARS and len(tokenize(mha.tokenizer, text).ids) > mha.config.context
    figs = {name: (table, settings) for name, _, table, settings in export.model_figures(mha, text)}
    table, settings = figs["maps_overview"]
    assert settings == {"window_start": 0, "tokens": views.ATTENTION_VIEW}
    assert table["query_pos"].max() == views.ATTENTION_VIEW - 1
    assert len(figs["surprisal"][0]) == views.COMPARE_VIEW - 1
    attr_table, attr = figs["attribution_last"]
    n_attr = min(views.ATTRIBUTION_VIEW, mha.config.context)
    assert attr["position"] == n_attr - 1 and len(attr_table) == n_attr
    assert (attr["method"], attr["steps"]) == views.attribution_default(sum(p.numel() for p in
                                                                              mha.model.parameters()))
    with pytest.raises(Exception, match="limit is 20,000"):
        decode_upload(path.name, (words + "x").encode())
    from analysis import heads    # the Heads page's default view: unit-norm circuits, 2-D
    for kind, gram in heads.circuit_grams(mha.model).items():
        table, settings = figs[f"heads_pca_mha_{kind}"]
        assert settings == {"kind": kind, "dims": 2, "unit_norm": True}
        pd.testing.assert_frame_equal(table, heads.circuit_table(gram, mha.config.n_heads, unit=True)[0])


def test_export_refuses_over_budget_before_loading_or_running(tmp_path, monkeypatch, mha):
    (tmp_path / "t.txt").write_text("Some words to export.", encoding="utf-8")
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "300")   # under the runtime alone: no model fits

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("models.checkpoint.load_model_dir", no_load)
    with pytest.raises(export.ExportError, match=r"over the 0\.3 GB memory budget.*MIXSCOPE_MEMORY_MB"):
        export.export_model(models_root() / "mha", tmp_path / "t.txt", tmp_path / "out")
    assert not (tmp_path / "out").exists()

    def no_forward(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(mha.model, "forward", no_forward)
    with pytest.raises(export.ExportError, match="memory budget"):
        export.model_figures(mha, "Some words to export.")


@pytest.fixture(scope="module")
def smollm2_base(tmp_path_factory):
    """A directory holding only SmolLM2-135M's config: the shipped pruned delta's shape with the base's 8,192-token
    context and no rule. The base itself is built by `make smollm2` and is not in a fresh clone; planning reads only
    the config."""
    cfg = ModelConfig.load(models_root() / "smollm2-pruned-g1.0" / "config.json")
    cfg = dataclasses.replace(cfg, prune=False, context=8192)
    path = tmp_path_factory.mktemp("smollm2-135m")
    cfg.save(path / "config.json")
    real = models_root() / "smollm2-135m" / "config.json"
    if real.is_file():     # where `make smollm2` ran, the stand-in must be the real thing's shape
        assert ModelConfig.load(real).to_dict() == cfg.to_dict()
    return path


def test_smollm2_export_plans_under_4_gb(smollm2_base):
    for path in (smollm2_base, models_root() / "smollm2-pruned-g1.0"):
        cfg = budgets.config_of(path)
        assert budgets.export_bytes(cfg, memory.planned_weights(cfg)) < 4 * 2 ** 30


def test_export_plans_from_the_parameters_whatever_the_weights_dtype(smollm2_base):
    """The Attribution method export plans for follows the parameter count, so bf16 weights change only the
    weights' own bytes (it read weights // 4 as parameters, halving a bf16 model's)."""
    cfg = budgets.config_of(smollm2_base)
    w = memory.planned_weights(cfg)
    assert budgets.export_bytes(cfg, w) - budgets.export_bytes(cfg, w // 2) == w - w // 2


@pytest.mark.parametrize("d_model, d_head, flat", [(16, 8, True), (64, 4, False)])
def test_the_circuit_plan_is_the_form_circuit_gram_takes(monkeypatch, d_model, d_head, flat):
    """budgets.flat_circuits says which form analysis.heads.circuit_gram takes (the flattened one calls bmm);
    the Gram is the same either way."""
    from analysis import heads
    cfg = tiny_config("mha", d_model=d_model, n_heads=4, d_head=d_head)
    model = DecoderLM(cfg).eval()
    randomize(model, seed=1)
    calls, real = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or real(*a))
    grams = heads.circuit_grams(model)
    assert budgets.flat_circuits(cfg) == flat == bool(calls)
    per_layer = [heads.circuit_factors(b.mixer) for b in model.blocks]
    other = heads.circuit_gram([f["QK"] for f in per_layer], method="gram")
    np.testing.assert_allclose(grams["QK"], other, rtol=1e-4, atol=1e-6)
    assert budgets.circuit_bytes(cfg) >= cfg.n_layers * cfg.n_heads * d_model ** 2 * 4 * flat


# ---- models.evaluate: batches by tokens, the head in chunks ------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_head_logprobs_in_chunks_equal_the_whole_logits(tie):
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, vocab_size=97, context=40, tie_embeddings=tie)).eval()
    randomize(model, std=0.3)
    x = torch.randint(0, 97, (3, 40))
    y = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        whole = target_logprobs(model(x).logits, y, chunk=1000)
        for chunk in (1, 7, 64):
            part = head_logprobs(model, model(x, hidden_only=True).hidden, y, chunk=chunk)
            torch.testing.assert_close(part, whole, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="hidden_only"):
        model(x, targets=y, hidden_only=True)


def direct_nll(model, doc, context, stride):
    """Each window's whole logits at once, the scored targets summed: what score_documents did before it chunked."""
    total = 0.0
    with torch.no_grad():
        for b, e, k in evaluate.windows(len(doc), context, stride):
            logits = model(torch.tensor([doc[b:e]])).logits[0]
            total += F.cross_entropy(logits[-k:].double(), torch.tensor(doc[b + 1:e + 1][-k:]), reduction="sum").item()
    return total


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_token_batches_and_head_chunks_equal_direct_scores(dtype, rel):
    model = DecoderLM(tiny_config("mha", vocab_size=200, context=32)).to(dtype).eval()
    randomize(model, std=0.3)
    rng = np.random.default_rng(3)
    docs = [[int(t) for t in rng.integers(0, 200, size=n)] for n in (3, 17, 33, 90, 150, 40)]
    want = sum(direct_nll(model, d, 32, 8) for d in docs)
    for batch_tokens in (1, 32, 100, 10_000):    # one window a forward, one, three, all of a length
        res = evaluate.score_documents(model, docs, stride=8, batch_tokens=batch_tokens)
        assert res["nll"] == pytest.approx(want, rel=rel)
        assert res["tokens"] == sum(len(d) - 1 for d in docs)
    first = evaluate.score_documents(model, docs, stride=8, max_windows=3)
    every = [w for d in docs for w in evaluate.windows(len(d), 32, 8)]   # in document order
    assert len(every) > 3 and first["tokens"] == sum(k for *_, k in every[:3])


def test_batch_rows_follow_the_token_budget_and_the_memory_budget():
    model = DecoderLM(tiny_config("mha", vocab_size=200, context=256)).eval()
    rows = evaluate.BATCH_TOKENS
    assert memory.batch_rows(model, 256, rows) == evaluate.BATCH_TOKENS // 256
    assert memory.batch_rows(model, 8192 * 2, rows) == 1          # at least one window
    cfg = model.config
    fixed = weights_bytes(model) + RUNTIME_BYTES
    budget = fixed + forward_bytes(cfg, 3, 256)
    assert memory.batch_rows(model, 256, rows, budget=budget) == 3
    assert memory.batch_rows(model, 256, rows, budget=fixed + forward_bytes(cfg, 1, 256) - 1) == 0


def test_evaluate_refuses_before_any_forward_naming_the_longest_window_that_fits(monkeypatch):
    model = DecoderLM(tiny_config("mha", vocab_size=200, context=256)).eval()
    cfg, fixed = model.config, weights_bytes(model) + RUNTIME_BYTES
    docs = [[int(t) for t in np.random.default_rng(0).integers(0, 200, size=600)]]

    def no_forward(*a, **k):
        raise AssertionError("the model ran")

    monkeypatch.setattr(model, "forward", no_forward)
    budget = fixed + forward_bytes(cfg, 1, 200)
    with pytest.raises(OverBudget, match="largest window that fits is --window 200$") as e:
        evaluate.score_documents(model, docs, stride=64, budget=budget)
    assert isinstance(e.value, ValueError)   # (what models.evaluate's callers catch)
    monkeypatch.undo()
    res = evaluate.score_documents(model, docs, stride=64, window=200, budget=budget)   # what it named: accepted
    assert res["tokens"] == 599


def test_smollm2_base_plans_its_whole_context_in_4_gb(smollm2_base):
    """The base's 8,192-token window fits the default budget (planned on the meta device: nothing loaded)."""
    cfg = ModelConfig.load(smollm2_base / "config.json")
    with torch.device("meta"):
        model = DecoderLM(cfg)
    assert cfg.context == 8192 and memory.batch_rows(model, 8192, evaluate.BATCH_TOKENS) == 1
    evaluate.check_window(model, 8192)


# ---- the reports ------------------------------------------------------------------------------------------------

def test_report_windows_refused_past_what_fits_and_the_named_one_accepted(smollm2_base):
    cfg = budgets.config_of(smollm2_base)
    memory.check_window([cfg], 1024, budgets.report_window_bytes)   # a report's usual windows fit
    with pytest.raises(OverBudget, match=r"largest window that fits is --window (\d+)") as e:
        memory.check_window([cfg], 3000, budgets.report_window_bytes)
    most = int(str(e.value).rsplit(" ", 1)[1])
    assert 1024 <= most < 3000
    memory.check_window([cfg], most, budgets.report_window_bytes)
    with pytest.raises(OverBudget):
        memory.check_window([cfg], most + 1, budgets.report_window_bytes)
    pruned = budgets.config_of(models_root() / "smollm2-pruned-g1.0")
    memory.check_window([cfg, pruned], pruned.context, budgets.report_window_bytes)   # the reports' default 512
    with pytest.raises(OverBudget, match="context is 512 tokens.*--window 512"):
        memory.check_window([cfg, pruned], 513, budgets.report_window_bytes)


def test_report_commands_refuse_before_loading(monkeypatch, tmp_path, capsys, smollm2_base):
    from analysis.reports import eviction, matched
    from analysis.reports import pruning as pruning_report

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    for module in (eviction, matched, pruning_report):
        monkeypatch.setattr(module, "load_model_dir", no_load)
    base, pruned = str(smollm2_base), str(models_root() / "smollm2-pruned-g1.0")
    out = str(tmp_path / "r.md")
    assert pruning_report.main([base, "--window", "20000", "--out", out, "--figure", ""]) == 2
    assert "context is 8,192 tokens" in capsys.readouterr().err
    monkeypatch.setenv("MIXSCOPE_MEMORY_MB", "1500")
    assert pruning_report.main([base, "--window", "8192", "--out", out, "--figure", ""]) == 2
    assert "largest window that fits is --window" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        eviction.main(["--dense", base, "--pruned", pruned, "--window", "1024", "--out", out])
    assert e.value.code == 2 and "context is 512" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        matched.main([pruned, "--base", base, "--window", "2048", "--source", "test=data/smollm2:test"])
    assert e.value.code == 2 and "--window" in capsys.readouterr().err


def test_forward_bytes_grows_with_what_a_model_masks():
    dense = tiny_config("mha", context=512, vocab_size=1000)
    pruned = tiny_config("mha", context=512, vocab_size=1000, prune=True, prune_r=4)
    assert forward_bytes(pruned, 1, 512) > forward_bytes(dense, 1, 512) + 4 * 4 * 512 ** 2
    # the head's logits never exceed a chunk: doubling the vocabulary adds chunk x vocab floats, not t x vocab
    big = tiny_config("mha", context=512, vocab_size=2000)
    assert forward_bytes(big, 1, 512) - forward_bytes(dense, 1, 512) < 4 * 512 * 1000
    assert math.isfinite(budgets.method_run_bytes(dense, 512))


@pytest.mark.parametrize("mixer", ["mha", "gqa", "el-att", "mhe-mul", "she", "we"])
def test_the_circuit_gram_is_planned_only_where_the_heads_page_draws_one(mixer):
    from analysis import heads
    cfg = tiny_config(mixer, **({"n_kv_heads": 2} if mixer == "gqa" else {}))
    assert budgets.has_circuits(cfg) == bool(heads.circuit_grams(DecoderLM(cfg).eval()))
