"""The Pruning page on a pruned model fine-tuned from a dense base (tiny, made here)."""
import json
from pathlib import Path

import pytest
import torch

from models.pruning import policies
from streamlit.testing.v1 import AppTest

from analysis.zoo import models_root
from models.checkpoint import load_model_dir, save_model_dir
from models.config import ModelConfig
from models.transformer import DecoderLM

PAGE = str(Path(__file__).resolve().parent.parent / "app" / "views" / "7_Pruning.py")


@pytest.fixture
def pruned_zoo(tmp_path, monkeypatch):
    tok = load_model_dir(models_root() / "mha").tokenizer
    base_cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    base = save_model_dir(tmp_path / "base", DecoderLM(ModelConfig(**base_cfg)), tok)
    pruned = DecoderLM(ModelConfig(**base_cfg, prune=True, prune_r=8))
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.0)  # random interactions around the threshold: some drops
    save_model_dir(tmp_path / "pruned", pruned, tok, {"train": {"init_from": str(base)}})
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path))
    return tmp_path


def titles(at):
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def test_pruning_page(pruned_zoo):
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "pruned"       # opens on a pruned model, not "base"
    assert not at.exception, at.exception
    assert (at.selectbox(key="prune_method").value == "learned"
            and len(at.selectbox(key="prune_method").options) == 1 + len(policies.REGISTRY))
    t = titles(at)
    assert "mha, learned pruning: tokens dropped per layer" in t and any("part of speech" in x for x in t)
    labels = {m.label for m in at.metric}
    assert {"mean sparsity (all layers)", "perplexity (pruned)", "perplexity (nothing evicted)",
            "perplexity (dense base)"} <= labels
    first = at.markdown[0].value
    at.selectbox(key="prune_layer").select(1).run()
    assert at.markdown[0].value != first or "<s " not in first


def test_score_view_shows_the_layers_scores_closest_calls_and_soft_rule(pruned_zoo):
    """Opened: layer 1's x_{n,j} heatmap, the closest calls (a drop's own score is negative), one call's terms summed
    to its score, and the soft rule's sparsity moving with alpha toward the step's."""
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    at.selectbox(key="prune_layer").select(1).run()
    assert not any(t.startswith("layer 1: x_n,j") for t in titles(at))   # closed until asked (one more forward)
    at.toggle(key="prune_scores").set_value(True).run()
    assert not at.exception, at.exception
    assert any(t.startswith("layer 1: x_n,j") for t in titles(at))
    close = at.dataframe[-1].value
    assert len(close) and (close["score"].abs().diff().dropna() >= 0).all()   # nearest the threshold first
    split_title = next(t for t in titles(at) if "term by term" in t)
    assert f"x_{close['closest_query'][0]},{close['position'][0]}" in split_title
    soft = {a: next(m for m in at.metric if m.label.startswith("sparsity of this layer")) for a in (1.0,)}
    at.slider(key="prune_scores_alpha").set_value(8.0).run()
    sharp = next(m for m in at.metric if m.label.startswith("sparsity of this layer at alpha 8"))
    assert soft[1.0].delta == sharp.delta      # the step's sparsity, for reference, does not move with alpha
    assert soft[1.0].value != sharp.value


def window_length(zoo) -> int:
    """Tokens the page shows: the sample text, at most the tiny model's context of 64."""
    from analysis.text import tokenize
    from app.common import SAMPLE_TEXT
    return min(64, len(tokenize(load_model_dir(zoo / "base").tokenizer, SAMPLE_TEXT).ids))


def page_sparsity(name, budget, n, prompt=None):
    """policies.expected_sparsity counts query 0 (nothing earlier) as 0; the page averages over queries 1..n-1."""
    from models.pruning import policies
    return policies.expected_sparsity(name, budget, n, prompt) * n / (n - 1)


def metric(at, label):
    return next(m for m in at.metric if m.label == label).value


def test_a_dense_model_runs_every_policy_at_its_budget(pruned_zoo):
    """On the dense base (no learned rule) the page offers the four policies; the sparsity shown is the one the
    budget implies, and a token budget or SnapKV's prompt are honoured."""
    from models.pruning import policies
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("base").run()
    assert not at.exception, at.exception
    method = at.selectbox(key="prune_method")
    assert [o.split()[0] for o in method.options] == ["StreamingLLM", "TOVA", "TOVA", "H2O", "H2O", "SnapKV", "SnapKV",
                                                      "Oracle"]   # no learned rule; per layer and per KV group
    n = window_length(pruned_zoo)
    for name in ["streamingllm", "tova", "h2o", "snapkv"]:
        at.selectbox(key="prune_method").select(name).run()
        assert not at.exception, (name, at.exception)
        budget = max(policies.min_budget(name), round(0.25 * n))
        prompt = max(2, 3 * n // 4) if name == "snapkv" else None
        want = page_sparsity(name, budget, n, prompt)
        assert metric(at, "mean sparsity (all layers)") == f"{want:.1%}", name
        assert f"mha, {name} at {budget} tokens: tokens dropped per layer" in titles(at)
    at.selectbox(key="prune_method").select("h2o").run()
    at.radio(key="prune_budget_unit").set_value("tokens").run()
    at.number_input(key="prune_budget_tok").set_value(10).run()
    assert metric(at, "mean sparsity (all layers)") == f"{page_sparsity('h2o', 10, n):.1%}"
    cache = next(m for m in at.metric if m.label == "cache held after the text")   # H2O holds its budget, no more
    assert cache.delta == f"saved {1 - 10 / n:.0%} of dense"
    at.selectbox(key="prune_method").select("snapkv").run()
    at.number_input(key="prune_budget_prompt").set_value(n - 4).run()
    assert metric(at, "mean sparsity (all layers)") == f"{page_sparsity('snapkv', 33, n, n - 4):.1%}"


def test_side_by_side_at_matched_sparsity_and_every_policy(pruned_zoo):
    from models.pruning import policies
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    n = window_length(pruned_zoo)
    learned = float(metric(at, "mean sparsity (all layers)").rstrip("%")) / 100
    at.selectbox(key="prune_compare").select("h2o").run()
    assert not at.exception, at.exception
    summary = at.dataframe[1].value
    second = list(summary["method"])[1]
    assert list(summary["method"])[0] == "learned pruning" and second.startswith(policies.title("h2o") + " at ")
    budget = int(second.rsplit(" at ", 1)[1].split()[0])
    assert abs(summary["sparsity"][0] - learned) < 1e-3
    assert budget == policies.budget_for("h2o", summary["sparsity"][0] * (n - 1) / n, n)
    assert abs(summary["sparsity"][1] - page_sparsity("h2o", budget, n)) < 1e-6
    assert all(abs(page_sparsity("h2o", budget, n) - summary["sparsity"][0]) <=
               abs(page_sparsity("h2o", b, n) - summary["sparsity"][0]) for b in range(1, n + 1))   # the nearest
    assert "who drops each token by the end of the text" in titles(at)
    assert "hidden from later queries, by part of speech (all layers)" in titles(at)
    by_layer = at.dataframe[2].value
    assert (len(by_layer) == 2
            and (by_layer.filter(like="only").sum(axis=1) + by_layer["both"] + by_layer["neither"] == n).all())
    at.toggle(key="prune_all").set_value(True).run()
    assert not at.exception, at.exception
    every = at.dataframe[-1].value
    assert list(every["method"]) == ["learned pruning", "streamingllm", "tova", "tova-group", "h2o", "h2o-layer",
                                     "snapkv", "snapkv-layer", "oracle"]
    for _, r in every.iloc[1:].iterrows():   # matched (a budget is a whole number of tokens), or at its smallest budget
        assert abs(r["sparsity"] - learned) < 0.05 or r["budget"] == policies.min_budget(r["method"]), r["method"]
    assert "every method at matched sparsity: hidden from later queries, by part of speech" in titles(at)


def test_an_extractor_is_turned_away_with_the_reason(pruned_zoo):
    tok = load_model_dir(pruned_zoo / "base").tokenizer
    save_model_dir(pruned_zoo / "we", DecoderLM(ModelConfig(mixer="we", vocab_size=8192, context=64, d_model=32,
                                                            n_layers=2, n_heads=4)), tok)
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    at.sidebar.selectbox(key="model").select("we").run()
    assert any("Extractor" in i.value for i in at.info) and not at.exception


def test_pruning_page_opens_on_the_largest_model_that_drops_most(pruned_zoo):
    tok = load_model_dir(pruned_zoo / "pruned").tokenizer
    cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4, prune=True, prune_r=8)
    for name, sparsity in (("a-drops-little", 0.1), ("b-drops-most", 0.6)):
        save_model_dir(pruned_zoo / name, DecoderLM(ModelConfig(**cfg)), tok, {"final_valid_sparsity": sparsity})
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "b-drops-most"
    save_model_dir(pruned_zoo / "c-larger", DecoderLM(ModelConfig(**dict(cfg, n_layers=3))), tok)
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert at.sidebar.selectbox(key="model").value == "c-larger"   # size first


def test_a_large_model_on_a_cpu_runs_the_reference_forward_when_asked(pruned_zoo, monkeypatch):
    """Past MIXSCOPE_LARGE_MODEL parameters on a CPU, the page shows the method's own numbers after one forward;
    the perplexity with nothing evicted (and the dense base) wait for their toggles."""
    monkeypatch.setenv("MIXSCOPE_LARGE_MODEL", "1000")
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert not at.exception, at.exception
    labels = {m.label: m for m in at.metric}
    assert "perplexity (nothing evicted)" not in labels and "perplexity (dense base)" not in labels
    assert labels["perplexity (pruned)"].proto.delta == ""
    at.toggle(key="prune_reference").set_value(True).run()
    labels = {m.label: m for m in at.metric}
    ppl, ppl0 = float(labels["perplexity (pruned)"].value), float(labels["perplexity (nothing evicted)"].value)
    delta = labels["perplexity (pruned)"].proto.delta
    assert delta.endswith("% vs nothing evicted")
    assert abs(float(delta.split("%")[0]) - 100 * (ppl / ppl0 - 1)) < 0.05   # (from the metrics' rounded values)


@pytest.mark.parametrize("view", ["prune_compare", "prune_all"])
def test_a_large_models_comparisons_compute_the_reference_they_are_read_against(pruned_zoo, monkeypatch, view):
    """With the reference switch off, turning on the side-by-side or every-policy view computes the perplexity with
    nothing evicted for them, and the metrics row shows it too."""
    monkeypatch.setenv("MIXSCOPE_LARGE_MODEL", "1000")
    at = AppTest.from_file(PAGE, default_timeout=180).run()
    assert "perplexity (nothing evicted)" not in {m.label for m in at.metric}
    if view == "prune_compare":
        at.selectbox(key="prune_compare").select("h2o").run()
        column = at.dataframe[1].value["vs nothing evicted"]
    else:
        at.toggle(key="prune_all").set_value(True).run()
        column = at.dataframe[-1].value["vs_nothing_evicted"]
    assert not at.exception, at.exception
    assert column.notna().all() and not at.toggle(key="prune_reference").value
    assert "perplexity (nothing evicted)" in {m.label for m in at.metric}
