"""Live generation: the streamed trace (drops per step and layer, cache sizes) against generate_batch and the
static cache with the step mask; replay; the --trace files."""
import json

import pytest
import torch

from models import trace
from models.generate import generate, generate_batch, stream
from tests.test_compact_cache import model_for


class Tok:  # the trace decodes tokens; ids are enough here
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("mixer, kw", [("mha", dict(greedy=True)), ("mqa", dict(seed=3, temperature=1.3, top_k=20)),
                                       ("mhe-mul", dict(seed=11, temperature=0.9, top_p=0.9))])
def test_live_trace_equals_generate_batch_and_the_static_step_mask(mixer, kw):
    model = model_for(mixer, context=64, seed=2).float()
    prompt = [5, 9, 2, 7, 7, 1, 3]
    live = generate(model, prompt, 24, **kw)
    assert live.cache_kind == "compacted" and live.drops, "this model should drop something"
    batch = generate_batch(model, [prompt], 24, greedy=kw.get("greedy", False), temperature=kw.get("temperature", 1.0),
                           top_k=kw.get("top_k"), top_p=kw.get("top_p"), seed=kw.get("seed"))
    assert live.new_ids == batch.new_ids[0]
    want = sorted((layer, int(p), int(t)) for layer, table in enumerate(batch.drops) for _, p, t in table.tolist())
    assert sorted(live.drops) == want
    static = generate(model, prompt, 24, cache="static", **kw)
    assert static.cache_kind == "static" and static.new_ids == live.new_ids
    # the static cache keeps every token's memory but the step mask holds the same tokens per layer
    assert [e.live for e in static.events] == [e.live for e in live.events]


def test_each_drop_arrives_with_the_step_that_made_it_and_replay_agrees():
    model = model_for("mha", context=64, seed=4).float()
    prompt = [1, 2, 3, 4, 5]
    res = generate(model, prompt, 20, greedy=True)
    n_layers = model.config.n_layers
    for e in res.events:  # event i's forward fed the prompt (i = 0) or position len(prompt) + i - 1
        for layer, pos, trig in e.drops:
            assert 0 <= layer < n_layers and pos < trig
            assert trig == len(prompt) + e.index - 1 if e.index else trig < len(prompt)
    tr = trace.build(res, Tok(), prompt="p")
    for e in res.events:
        held = trace.held_at(tr, e.index)
        assert [sum(row) for row in held] == list(e.live)
        assert all(len(row) == len(prompt) + e.index for row in held)
    # a token once dropped stays dropped; held counts never exceed what was seen
    last = trace.held_at(tr, res.events[-1].index)
    for d in tr["drops"]:
        assert not last[d["layer"]][d["position"]]


def test_cache_bytes_are_the_real_ones():
    model = model_for("mha", context=64, seed=4).float()
    res = generate(model, [1, 2, 3], 30, greedy=True)
    size = model.wte.weight.element_size()
    spec = model.blocks[0].mixer.cache_spec()
    per_layer = sum(torch.Size(s).numel() for s in spec.values()) * size
    dense_per_layer = sum(torch.Size(s).numel() for n, s in spec.items() if n != "k_int") * size
    for e in res.events:
        assert e.held_bytes == sum(e.live) * per_layer
        assert e.dense_bytes == (3 + e.index) * model.config.n_layers * dense_per_layer
        assert e.alloc_bytes >= e.held_bytes
    assert res.events[-1].held_bytes < res.events[-1].dense_bytes  # it dropped enough to beat dense, K_int included


def test_dense_models_stream_through_the_static_cache_with_nothing_dropped():
    model = model_for("mha", prune=False, context=64).float()
    res = generate(model, [4, 5, 6], 12, greedy=True)
    assert res.cache_kind == "static" and res.drops == []
    n_layers = model.config.n_layers
    for e in res.events:
        assert e.live == (3 + e.index,) * n_layers and e.held_bytes == e.dense_bytes
        assert e.alloc_bytes == model.new_cache(1, 3 + 12).allocated_bytes()
    with pytest.raises(ValueError, match="compacted cache serves attention"):
        generate(model_for("she", prune=False, context=64), [1, 2], 3, cache="compacted")


def test_two_interleaved_streams_equal_two_separate_runs():
    pruned = model_for("mha", context=64, seed=6).float()
    dense = model_for("mha", prune=False, context=64, seed=6).float()
    kw = dict(seed=5, temperature=1.1)
    a_info, b_info = {}, {}
    a = stream(pruned, [3, 1, 4, 1, 5], 16, info=a_info, **kw)
    b = stream(dense, [3, 1, 4, 1, 5], 16, info=b_info, **kw)
    got_a, got_b = [], []
    for ea, eb in zip(a, b):
        got_a.append(ea)
        got_b.append(eb)
    assert [e.token_id for e in got_a] == generate(pruned, [3, 1, 4, 1, 5], 16, **kw).new_ids
    assert [e.token_id for e in got_b] == generate(dense, [3, 1, 4, 1, 5], 16, **kw).new_ids
    assert a_info["cache_kind"] == "compacted" and b_info["cache_kind"] == "static"
    assert a_info["kernel_paths"] and b_info["kernel_paths"]


def test_trace_files(tmp_path):
    model = model_for("mha", context=64, seed=4).float()
    res = generate(model, [1, 2, 3], 10, greedy=True)
    tr = trace.build(res, Tok(), model_dir="m", prompt="p", settings={"greedy": True})
    paths = trace.write(tr, tmp_path / "t")
    assert [p.name for p in paths] == ["t.csv", "t.drops.csv", "t.json"]
    lines = paths[0].read_text().splitlines()
    assert len(lines) == 1 + len(res.events) and lines[0].startswith("step,token_id")
    assert len(paths[1].read_text().splitlines()) == 1 + len(res.drops)
    assert json.loads(paths[2].read_text())["new_ids"] == res.new_ids
    with pytest.raises(FileExistsError, match="already exist"):
        trace.write(tr, tmp_path / "t.json")
    assert trace.write(tr, tmp_path / "t", force=True) == paths


def test_cli_writes_the_trace_and_never_overwrites_it(tmp_path):
    from models.checkpoint import save_model_dir
    from models.tokenizer import train_bpe
    from tests.test_generate_cli import run

    tok = train_bpe(["one two three four five six"] * 10, vocab_size=270, min_frequency=1)
    save_model_dir(tmp_path / "m", model_for("mha", context=64, seed=4, vocab_size=300).float(), tok)
    args = [str(tmp_path / "m"), "--prompt", "one two three", "--max-new-tokens", "12", "--greedy", "--json",
            "--trace", str(tmp_path / "out" / "trace")]
    res = run(*args)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["cache"] == "compacted" and out["drops"] > 0
    tr = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert len(tr["drops"]) == out["drops"] and len(tr["steps"]) == 12 and tr["settings"]["greedy"] is True
    before = (tmp_path / "out" / "trace.json").read_bytes()
    again = run(*args)
    assert again.returncode == 2 and "already exist" in again.stderr
    assert (tmp_path / "out" / "trace.json").read_bytes() == before


def test_twin_summary_compares_the_last_step_and_the_decode_latency():
    from analysis import live
    pruned = model_for("mha", context=64, seed=6).float()
    dense = model_for("mha", prune=False, context=64, seed=6).float()
    a = trace.build(generate(pruned, [3, 1, 4], 20, greedy=True), Tok())
    b = trace.build(generate(dense, [3, 1, 4], 20, greedy=True), Tok())
    s = live.twin_summary(a, b)
    (pa, pb), (aa, ab) = s["held_bytes"], s["allocated_bytes"]
    assert (pa, pb, aa, ab) == (a["steps"][-1]["held_bytes"], b["steps"][-1]["held_bytes"],
                                a["steps"][-1]["alloc_bytes"], b["steps"][-1]["alloc_bytes"])
    assert s["held_saved"] == pytest.approx(1 - pa / pb) and s["allocated_saved"] == pytest.approx(1 - aa / ab)
    import statistics
    ms = lambda tr: statistics.median(x["model_ms"] for x in tr["steps"][1:])  # noqa: E731  (the first has the prefill)
    assert s["latency_ratio"] == pytest.approx(ms(a) / ms(b))
    first_diff = next((i for i, (x, y) in enumerate(zip(a["new_ids"], b["new_ids"])) if x != y), 20)
    assert s["same_prefix"] == first_diff and s["tokens"] == 20
    assert s["own_perplexity"] == (a["perplexity"], b["perplexity"])


@pytest.mark.parametrize("policy", [None, "tova", "h2o:prompt"])
def test_the_twins_price_is_teacher_forced_as_each_model_generates(policy):
    """analysis.twin scores a continuation in one forward (or the policy's replay) with the log-probabilities
    generation itself gave those tokens (greedy, so each model scores its own output exactly as it sampled it),
    and scores the other model's output too; the price compares the two models on each text."""
    import math

    from analysis import budgets, twin
    from models.pruning import policies
    pruned = model_for("mha", context=64, seed=6).float()
    other = model_for("mha", prune=False, context=64, seed=7).float()
    pol = policies.make(policy, 8) if policy else None
    model = other if pol else pruned  # a policy runs on the dense model here (its twin: nothing evicted)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    res = generate(model, prompt, 16, greedy=True, policy=pol)
    got = twin.continuation_logprobs(model, prompt, res.new_ids, pol)
    want = torch.tensor([e.logprob for e in res.events], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    twin_res = generate(pruned if pol else other, prompt, 16, greedy=True)
    scorers = [("a", model, pol), ("b", pruned if pol else other, None)]
    rows = twin.price(scorers, prompt, [("a's", res.new_ids), ("b's", twin_res.new_ids)])
    assert [(r["text"], r["scored by"]) for r in rows] == [("a's", "a"), ("a's", "b"), ("b's", "a"), ("b's", "b")]
    assert rows[0]["perplexity"] == pytest.approx(math.exp(-float(want.mean())), rel=1e-4)
    assert rows[3]["perplexity"] == pytest.approx(twin_res.perplexity, rel=1e-4)
    change = twin.price_change(rows, "a", "b")
    assert change["a's"] == pytest.approx(rows[0]["perplexity"] / rows[1]["perplexity"] - 1)
    most = twin.most_tokens(model, pol)
    assert most == (budgets.replay_most(model.config) if pol else model.config.context)
    with pytest.raises(ValueError, match="at most"):
        twin.continuation_logprobs(model, [1] * most, [2])


def test_the_replay_text_shows_the_token_sampled_at_the_step():
    from analysis import live
    page = live.faded_text_html(["a", "b", "c", "d"], 2, [1.0, 0.0, 1.0])
    assert page.count("<span") == 4 and "not yet in the cache" in page and page.index("not yet") > page.index(">c<")
