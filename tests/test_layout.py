"""The layout's promises: models/ stays free of plotting and analysis, the documented commands still start,
and "which parameters train" has one answer, found by structure."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.adapters import KINDS, get_adapter_params, set_trainable_params, trainable_params
from models.params import components, count_parameters, count_trainable
from models.transformer import DecoderLM
from tests.helpers import ALL_MIXERS, ATTENTION, tiny_config

REPO = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_models_import_no_plotting_tables_or_analysis():
    files = sorted((REPO / "models").rglob("*.py"))
    assert len(files) > 20
    offenders = {str(f.relative_to(REPO)): sorted(imported_modules(f) & {"plotly", "pandas", "analysis", "streamlit"})
                 for f in files}
    assert {f: bad for f, bad in offenders.items() if bad} == {}


@pytest.mark.parametrize("module", ["models.data", "models.train", "models.evaluate", "models.generate",
                                    "models.import_hf", "analysis.reports.zoo", "analysis.reports.pruning",
                                    "analysis.reports.adapters"])
def test_documented_commands_start(module):
    args = [sys.executable, "-m", module] + (["prepare"] if module == "models.data" else []) + ["--help"]
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def legacy_rule(name: str) -> bool:
    """The substring rule the structural collector replaced (adapters, norms, pruning)."""
    return "adapter" in name or ".ln_" in name or name.startswith("ln_f") or ".pruning." in name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prune", [False, True])
def test_adapter_params_by_structure_equal_the_legacy_names(kind, prune):
    model = DecoderLM(tiny_config("mha", adapter=kind, adapter_reduction=4, phm_n=2, prune=prune, prune_r=4))
    found = get_adapter_params(model)
    named = dict(model.named_parameters())
    assert set(found) == {n for n in named if legacy_rule(n)}
    assert all(found[n] is named[n] for n in found)          # the model's own tensors, not copies
    assert ("adapter_A" in found) == kind.startswith("compacter")
    assert any(".pruning." in n for n in found) == prune


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_every_parameter_has_one_component_and_dense_models_train_everything(mixer):
    model = DecoderLM(tiny_config(mixer, prune=mixer in ATTENTION and mixer != "el-att"))
    owner = components(model)
    assert set(owner) == {n for n, _ in model.named_parameters()}
    assert set(trainable_params(model)) == set(owner)
    assert count_trainable(model) == count_parameters(model)


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_counts_and_tables_agree_on_what_trains(kind):
    model = DecoderLM(tiny_config("mqa", adapter=kind, adapter_reduction=4, phm_n=2, prune=True, prune_r=4))
    set_trainable_params(model, trainable_params(model))
    by_grad = count_parameters(model, trainable_only=True)
    assert count_trainable(model) == by_grad
    assert by_grad["mixer"] == by_grad["feed_forward"] == by_grad["embeddings"] == 0
    assert by_grad["adapters"] > 0 and by_grad["pruning"] > 0 and by_grad["norms"] > 0
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == by_grad["total"]


def test_structure_not_names_decides():
    """A parameter named like an adapter is not one: renaming cannot move it between components."""
    model = DecoderLM(tiny_config("mha"))
    model.blocks[0].ffn.register_parameter("adapter_like", torch.nn.Parameter(torch.zeros(3)))
    assert components(model)["blocks.0.ffn.adapter_like"] == "feed_forward"
    assert "blocks.0.ffn.adapter_like" not in get_adapter_params(model)


@pytest.mark.parametrize("mixer", ["mha", "gqa", "mhe-mul"])
def test_a_frozen_base_trains_context_pruning_alone(mixer):
    model = DecoderLM(tiny_config(mixer, prune=True, prune_r=4))
    chosen = trainable_params(model, freeze_base=True)
    assert chosen and all(".pruning." in n for n in chosen)
    counts = count_trainable(model, freeze_base=True)
    assert counts["total"] == counts["pruning"] == count_parameters(model)["pruning"]
