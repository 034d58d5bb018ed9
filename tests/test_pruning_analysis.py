"""POS alignment on a text with known tags, and the drop tables on a keep matrix with known drops."""
import math
import re

import numpy as np
import pytest
import torch

from analysis import pruning
from analysis.text import tokenize
from models.tokenizer import train_bpe

TEXT = "The cat sat on the mat, and the dog barked loudly."
WORDS = {"The": "DET", "cat": "NOUN", "sat": "VERB", "on": "ADP", "the": "DET", "mat": "NOUN", ",": "PUNCT",
         "and": "CCONJ", "dog": "NOUN", "barked": "VERB", "loudly": "ADV", ".": "PUNCT"}


def test_bpe_tokens_get_the_tag_of_their_word():
    tok = train_bpe([TEXT] * 30, vocab_size=300, min_frequency=1)
    toks = tokenize(tok, TEXT)
    tags = pruning.pos_tags(TEXT, toks.offsets)
    for (a, b), tag in zip(toks.offsets, tags):
        piece = TEXT[a:b].strip()
        word = next(w for w in WORDS if TEXT.find(w, max(0, a - 1)) != -1 and piece and piece in w)
        assert tag == WORDS[word], (piece, tag)
    # byte-level pieces of one word share its tag
    chars = train_bpe(["x"], vocab_size=258, min_frequency=1)  # almost no merges: one token per byte
    t2 = tokenize(chars, "barked.")
    assert pruning.pos_tags("barked.", t2.offsets) == ["VERB"] * 6 + ["PUNCT"]


def test_drop_tables_from_a_known_keep_matrix():
    # 5 tokens; layer 0: token 1 dropped by the query at 3; layer 1: nothing dropped
    k0 = np.tril(np.ones((5, 5)))
    k0[3:, 1] = 0
    keeps = np.stack([k0, np.tril(np.ones((5, 5)))])
    labels, tags = ["A", "b", ",", "c", "d"], ["DET", "NOUN", "PUNCT", "VERB", "NOUN"]
    table = pruning.token_table(keeps, labels, tags)
    row = table[(table.layer == 0) & (table.position == 1)].iloc[0]
    assert (row.dropped and row.dropped_at == 3 and row.trigger_token == "c" and row.trigger_pos == "VERB"
            and row.lifetime == 2)
    assert table[table.layer == 1]["dropped"].sum() == 0
    rates = pruning.pos_drop_rates(table)
    noun0 = rates[(rates.layer == 0) & (rates.pos == "NOUN")].iloc[0]
    assert noun0.tokens == 1 and noun0.drop_rate == 1.0 and noun0.keep_probability == 0.0  # "d" (last) left out
    assert pruning.trigger_counts(table).to_dict("records") == [{"layer": 0, "trigger_pos": "VERB", "drops": 1}]
    sp = pruning.sparsity_per_layer(keeps)
    assert np.isclose(sp.sparsity[0], np.mean([0, 0, 1 / 3, 1 / 4])) and sp.sparsity[1] == 0
    html = pruning.struck_text_html(table, 0)
    assert html.count("<s ") == 1 and "dropped at position 3 by c" in html
    for fig in (pruning.pos_heatmap(rates, "t"), pruning.token_layer_figure(table, "t"),
                pruning.triggers_figure(pruning.trigger_counts(table), "t")):
        assert fig.data
    # the table is built column-wise; it reads as the row-by-row table did (None where nothing was dropped)
    assert np.isnan(table.lifetime[(table.layer == 1)]).all()
    kept = pruning.token_table(keeps[1:], labels + ["extra"], tags + ["X"])   # labels past T are ignored
    assert kept.lifetime.tolist() == [None] * 5 and kept.trigger_token.tolist() == [None] * 5


def test_keep_matrices_from_a_pruned_model():
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=8))
    keeps = pruning.keep_matrices(model, [1, 2, 3, 4, 5])
    assert keeps.shape == (2, 5, 5) and np.all(np.diagonal(keeps, axis1=1, axis2=2) == 1)
    assert set(np.unique(keeps)) <= {0.0, 1.0} and model.training  # the mode it had is restored
    dense = DecoderLM(tiny_config("mha"))
    try:
        pruning.keep_matrices(dense, [1, 2])
    except ValueError as e:
        assert "no context pruning" in str(e)
    else:
        raise AssertionError("a dense model has no keep matrices")
    assert torch.is_grad_enabled()


def test_bucket_eval_on_dense_pruned_and_local_models():
    from analysis.reports.pruning import figure, render
    from models.evaluate import bucket_eval
    from models.transformer import DecoderLM
    from tests.helpers import tiny_config
    import pandas as pd
    stream = list(np.random.default_rng(0).integers(0, 61, size=200))
    buckets = ((2, 8), (8, 16))
    rows = {}
    for name, cfg in {"dense": {}, "local": {"pattern": "local", "pattern_k": 4},
                      "pruned": {"prune": True, "prune_r": 8}}.items():
        model = DecoderLM(tiny_config(name and "mha", context=16, **cfg))
        rows[name] = bucket_eval(model, stream, 16, buckets)
    assert all(r["sparsity"] == 0 for r in rows["dense"])
    # local window 4: a token at position k sees min(k, 3) earlier tokens
    want = np.mean([(k - min(k, 3)) / k for k in range(8, 16)])
    assert rows["local"][1]["sparsity"] == pytest.approx(want)
    assert rows["dense"][0]["tokens"] == 12 * 6 and math.isfinite(rows["pruned"][1]["perplexity"])
    table = pd.DataFrame([{"model": n, "method": n, **r} for n, rs in rows.items() for r in rs])
    assert "| local | local | 8-16 |" in render(table, 16, "cmd") and figure(table).data


def test_real_model_report_from_a_base_and_a_pruned_run(tmp_path):
    import json

    from analysis.reports import real
    from models.checkpoint import save_model_dir
    from models.data import prepare
    from models.transformer import DecoderLM
    from tests.helpers import randomize, tiny_config
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(8):
        (texts / f"{i}.txt").write_text(f"The committee met on day {i}. They spoke of bread, roads and the bridge. "
                                        * 8)
    prepare(tmp_path / "data", [], [str(texts)], vocab_size=300, cache=None, min_frequency=1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json"))
    base = DecoderLM(tiny_config("gqa", vocab_size=300, context=128, positions="rope", n_kv_heads=2))
    randomize(base, std=0.1)
    save_model_dir(tmp_path / "base", base, tok, {})
    pruned = DecoderLM(tiny_config("gqa", vocab_size=300, context=128, positions="rope", n_kv_heads=2, prune=True,
                                   prune_r=4))
    pruned.load_state_dict(base.state_dict(), strict=False)
    for b in pruned.blocks:
        b.mixer.pruning.beta.data.fill_(0.0)   # drops something
    save_model_dir(tmp_path / "run", pruned, tok, {"steps": 3, "trainable_params": 42, "train": {"gamma": 0.3},
                                                    "config": pruned.config.to_dict(), "wall_time_s": 60,
                                                    "device": "cpu"})
    out = tmp_path / "real.md"
    assert real.main([str(tmp_path / "run"), "--base", str(tmp_path / "base"), "--data", str(tmp_path / "data"),
                      "--window", "128", "--pos-docs", "2", "--out", str(out),
                      "--figure", str(tmp_path / "f.png")]) == 0
    text = out.read_text()
    assert "| run | 3 | 42 | 0.3 | 128 | - |" in text and "| base | 100-256 |" in text and "+0.00%" in text
    # the held-out protocol on the default source (the test split), the policies matched to the run's sparsity
    assert "## Against the training-free policies" in text and "### test: every position" in text
    assert "### test: positions >= 100" in text and re.search(r"\| test \| \d+ \| [\d.]+% \| [+-][\d.]+% \[", text)
    assert re.search(r"\| streamingllm \| \d+ \|", text) and "--source test=" in text
    assert "## Sparsity per layer" in text and "| run | " in text and "trigger POS" in text
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert json.dumps(text)  # plain text
    # the protocol from a saved run of analysis.reports.matched: the same tables, nothing run twice
    from analysis.reports import matched
    flags = ["--window", "128", "--source", f"test={tmp_path / 'data'}:test", "--windows", "24"]
    assert matched.main([str(tmp_path / "run"), "--base", str(tmp_path / "base"), *flags,
                         "--out", str(tmp_path / "m.md"), "--json", str(tmp_path / "m.json")]) == 0
    again = tmp_path / "again.md"
    common = ["--data", str(tmp_path / "data"), "--window", "128", "--pos-docs", "2",
              "--figure", str(tmp_path / "f.png")]
    assert real.main([str(tmp_path / "run"), "--base", str(tmp_path / "base"), *common, "--out", str(again),
                      "--matched", str(tmp_path / "m.json")]) == 0
    section = text.split("## Against the training-free policies")[1].split("## Perplexity and sparsity")[0]
    assert section in again.read_text() and "joined by --matched" in again.read_text()
    with pytest.raises(SystemExit):  # a saved run of other models
        real.main([str(tmp_path / "base"), "--base", str(tmp_path / "base"), *common, "--out", str(tmp_path / "x.md"),
                   "--matched", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit):  # settings the saved run fixed
        real.main([str(tmp_path / "run"), "--base", str(tmp_path / "base"), *common, "--out", str(tmp_path / "x.md"),
                   "--matched", str(tmp_path / "m.json"), "--windows", "8"])
    import shutil
    shutil.copytree(tmp_path / "run", tmp_path / "elsewhere" / "run")   # same name, another directory
    with pytest.raises(SystemExit):
        real.main([str(tmp_path / "elsewhere" / "run"), "--base", str(tmp_path / "base"), *common,
                   "--out", str(tmp_path / "x.md"), "--matched", str(tmp_path / "m.json")])
    assert not (tmp_path / "x.md").exists()
    from analysis.reports.real import ran_elsewhere
    saved = json.loads((tmp_path / "m.json").read_text())
    assert ran_elsewhere(saved, [str(tmp_path / "run")], str(tmp_path / "base"), 128) is None
    saved["weights"]["run"] = "0" * 64   # the directory's weights changed since the run
    assert "changed" in ran_elsewhere(saved, [str(tmp_path / "run")], str(tmp_path / "base"), 128)


def test_keep_only_diagnostics_skip_the_attention_probabilities():
    """The Pruning page asks for keep masks alone: same masks as full diagnostics, no [H,T,T] maps held."""
    import torch
    from models.transformer import DecoderLM
    from tests.helpers import randomize, tiny_config
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=4)).eval()
    randomize(model, std=0.3)
    idx = torch.randint(0, 61, (1, 20))
    with torch.no_grad():
        full = model(idx, diagnostics=True).diagnostics
        keep = model(idx, diagnostics=True, attention_maps=False).diagnostics
    assert all(f.attn is not None for f in full) and all(k.attn is None for k in keep)
    assert all(torch.equal(f.keep, k.keep) for f, k in zip(full, keep))
    assert pruning.keep_matrices(model, idx[0].tolist()).dtype.name == "uint8"


def test_keeps_and_logprobs_from_one_forward_equal_the_two_forwards():
    import numpy as np
    import torch
    from analysis import tokens
    from models.transformer import DecoderLM
    from tests.helpers import randomize, tiny_config
    model = DecoderLM(tiny_config("mha", prune=True, prune_r=4)).eval()
    randomize(model, std=0.3)
    ids = torch.randint(0, 61, (20,)).tolist()
    keeps, lp = pruning.keeps_and_logprobs(model, ids)
    assert np.array_equal(keeps, pruning.keep_matrices(model, ids))
    assert np.allclose(lp, tokens.token_logprobs(model, ids), atol=1e-5)


def test_hidden_share_disagreement_and_pos_profile_from_hand_made_masks():
    """Three tokens, one layer: rule a hides token 0 from query 2 on; rule b hides token 1 from query 2 on."""
    import numpy as np

    from analysis import pruning
    a = np.tril(np.ones((3, 3), dtype=np.uint8))
    b = a.copy()
    a[2, 0] = 0
    b[2, 1] = 0
    ta = pruning.token_table(a[None], ["x", "y", "z"], ["NOUN", "VERB", "NOUN"])
    tb = pruning.token_table(b[None], ["x", "y", "z"], ["NOUN", "VERB", "NOUN"], dropped_at=np.array([[-1, 2, -1]]))
    assert ta["hidden_share"].tolist()[:2] == [0.5, 0.0] and np.isnan(ta["hidden_share"].iloc[2])
    assert tb["hidden_share"].tolist()[:2] == [0.0, 1.0]          # query 2 is the only one after token 1
    assert ta["dropped_at"].tolist() == [2, -1, -1] and tb["dropped"].tolist() == [False, True, False]
    d = pruning.disagreement(ta, tb)
    assert d["who"].tolist() == ["a only", "b only", "neither"]
    by_layer = pruning.disagreement_by_layer(d)
    assert (by_layer[["both", "a only", "b only", "neither"]].values.tolist() == [[0, 1, 1, 1]]
            and by_layer["overlap"][0] == 0)
    assert pruning.disputed_tokens(d)["token"].tolist() == ["x", "y"]
    prof = pruning.pos_profile({"a": ta, "b": tb}).set_index(["method", "pos"])
    assert prof.loc[("a", "NOUN"), "hidden_share"] == 0.5 and prof.loc[("b", "VERB"), "hidden_share"] == 1.0
    assert prof.loc[("a", "NOUN"), "token_layers"] == 1                  # the last token is left out
    fig = pruning.disagreement_figure(d, ("a", "b"), "t")
    assert fig.data[0].z.tolist() == [[2, 3, 0]]                         # codes: neither 0, both 1, a only 2, b only 3
