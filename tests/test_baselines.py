"""PRR and PEoP take their MHA and SHA references by directory, the same way in the results table and the app."""
import pytest

from analysis.reports import zoo as report
from analysis.zoo import zoo_table
from models.checkpoint import save_model_dir
from models.evaluate import paper_metrics, zoo_references
from models.params import count_parameters
from models.tokenizer import train_bpe
from models.transformer import DecoderLM
from tests.helpers import tiny_config


@pytest.fixture
def zoo(tmp_path):
    """mha and sha, plus a pruned MHA named so that it sorts last and first around them."""
    tok = train_bpe(["a b c"] * 5, vocab_size=260, min_frequency=1)
    specs = {"a-pruned": ("mha", {"prune": True, "prune_r": 4}, 150.0), "mha": ("mha", {}, 100.0),
             "sha": ("sha", {}, 120.0), "zz-pruned": ("mha", {"prune": True, "prune_r": 4}, 90.0)}
    for name, (mixer, extra, ppl) in specs.items():
        model = DecoderLM(tiny_config(mixer, vocab_size=300, **extra))
        save_model_dir(tmp_path / name, model, tok, {"test_perplexity": ppl, "status": "ok",
                                                      "config": model.config.to_dict()})
    return tmp_path


def test_references_are_the_mha_and_sha_directories(zoo):
    attn = {m: count_parameters(DecoderLM(tiny_config(m, vocab_size=300)))["mixer"] for m in ("mha", "sha")}
    assert zoo_references(zoo) == {"mha": (100.0, attn["mha"]), "sha": (120.0, attn["sha"])}
    assert zoo_references(zoo / "nowhere") == {}


def test_results_table_and_app_agree(zoo):
    cards = report.load_cards(zoo)
    table = {r["model"]: r for r in report.rows(cards, zoo)}
    app = zoo_table(sorted(p for p in zoo.iterdir()), root=zoo).set_index("model")
    assert table["mha"]["prr"] == pytest.approx(1.0) and app.loc["mha", "PRR"] == pytest.approx(1.0)
    refs = zoo_references(zoo)
    for name in ("a-pruned", "zz-pruned", "sha"):
        want = paper_metrics(table[name]["ppl"], table[name]["attn"], refs["mha"], refs["sha"])
        assert table[name]["prr"] == pytest.approx(want["prr"]) == app.loc[name, "PRR"]
    assert table["zz-pruned"]["prr"] == pytest.approx(1.1)   # 1 - (90 - 100) / 100: against mha, not itself


def test_without_references_there_are_no_metrics(zoo):
    import shutil
    shutil.rmtree(zoo / "mha")
    table = {r["model"]: r for r in report.rows(report.load_cards(zoo), zoo)}
    assert all(r["prr"] is None for r in table.values())
