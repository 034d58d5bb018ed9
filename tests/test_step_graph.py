"""A training step replayed from CUDA graphs (models.step_graph), checked on the CPU where no graph can be captured:
the table slot the captured keep kernel reads (its values for each alpha, at fixed addresses), and GraphedLoss's
bookkeeping (a capture per form of the alpha-sigmoid, the slot refilled before each step) with a stand-in capture
that runs the module itself. The capture proper is tested on a GPU (tests/test_gpu.py)."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

import kernels
from models.pruning import pair_count, sparsity_loss
from models.step_graph import GraphedLoss, form, graphs_holding, schedule_alphas
from models.transformer import DecoderLM
from tests.helpers import randomize, tiny_config

tab = importlib.import_module("kernels.alpha_sigmoid")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy under Triton's interpreter)


@pytest.fixture
def triton_keep(monkeypatch):
    if "log_keep" not in kernels.TRITON or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs triton under TRITON_INTERPRET=1 (the tests' setting)")
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")  # the dispatch a GPU takes
    from kernels import triton_keep
    return triton_keep


def test_the_keep_kernel_reads_each_alpha_from_one_slot_at_fixed_addresses(triton_keep):
    """Refilled between calls with tables of different lengths (1.02's grid has 18,433 points, 1.5's and 8's
    8,193), the slot gives the kernel the values each alpha's own table gives, bit for bit, from the same three
    addresses every time."""
    torch.manual_seed(0)
    x = torch.randn(2, 70, 70) * 4
    alphas = [8.0, 1.02, 1.5, 8.0, 1.02]
    slot = tab.TableSlot("cpu", tab.slot_points(alphas))
    assert slot.p.numel() == tab._grid(1.02)[1] > tab._grid(8.0)[1]
    seen = set()
    for a in alphas:
        want = triton_keep.log_keep(x, alpha=a, sinks=1)
        slot.load(a)
        with tab.use_slot(slot):
            held = tab._table(a, "cpu")
            seen.add(tuple(t.data_ptr() for t in held))
            assert held.p.numel() == tab._table(a, "cpu").p.numel() == tab._grid(a)[1]
            got = triton_keep.log_keep(x, alpha=a, sinks=1)
        for g, w in zip(got, want):
            assert torch.equal(g, w), a
    assert seen == {(slot.p.data_ptr(), slot.d.data_ptr(), slot.params.data_ptr())}
    assert tab._table(1.02, "cpu").p.data_ptr() != slot.p.data_ptr()  # outside use_slot: the kept table


class _Launches:
    """triton_keep._forward_kernel, noting each launch's table pointers (P, D, PARAMS), its other arguments that
    are not tensors, and its keywords: what a CUDA graph keeps from its capture."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(([a.data_ptr() for a in args[1:4]], [a for a in args if not torch.is_tensor(a)], kw))
            return self.real[grid](*args, **kw)
        return launch


def test_a_table_steps_launch_is_the_same_at_every_alpha_while_a_slot_is_in_use(triton_keep, monkeypatch):
    """What a capture keeps of the keep kernel's launch (its pointers, numbers and constexprs) does not depend on
    alpha while a slot is in use: a replay at another alpha reads that alpha's table. Without the slot the table
    pointers move (the test's own check that it sees them)."""
    launches = _Launches(triton_keep._forward_kernel)
    monkeypatch.setattr(triton_keep, "_forward_kernel", launches)
    x = torch.randn(1, 40, 40)
    slot = tab.TableSlot("cpu", tab.slot_points([1.02, 8.0]))
    for a in (1.02, 8.0):
        slot.load(a)
        with tab.use_slot(slot):
            triton_keep.log_keep(x, alpha=a)
    for a in (1.02, 8.0):
        triton_keep.log_keep(x, alpha=a)
    (in_slot, in_slot_8, free, free_8) = launches.calls
    assert in_slot == in_slot_8 and in_slot[0] == [slot.p.data_ptr(), slot.d.data_ptr(), slot.params.data_ptr()]
    assert free[0] != free_8[0] and free[1:] == free_8[1:] == in_slot[1:]


def test_a_slot_refuses_an_alpha_it_does_not_hold_and_a_table_longer_than_itself():
    slot = tab.TableSlot("cpu", tab.slot_points([4.0]))
    slot.load(4.0)
    with tab.use_slot(slot):
        with pytest.raises(RuntimeError, match="holds alpha 4.0"):
            tab._table(3.0, "cpu")
    with pytest.raises(ValueError, match="slot_points"):
        slot.load(1.02)
    assert slot.alpha == 4.0 and torch.equal(slot.p, tab._table(4.0, "cpu").p)   # (nothing half-loaded)
    inner = tab.TableSlot("cpu", tab.slot_points([3.0]))
    inner.load(3.0)
    with tab.use_slot(slot), tab.use_slot(inner):
        assert tab._table(3.0, "cpu").p.data_ptr() == inner.p.data_ptr()
    with tab.use_slot(slot):  # the inner one gave the outer back
        assert tab._table(4.0, "cpu").p.data_ptr() == slot.p.data_ptr()
    assert tab.slot_points([1.0, 2.0, math.inf]) == 1


def test_the_forms_a_schedule_passes_through():
    assert [form(a) for a in (None, 1.0, 1.02, 2.0, 8.0, math.inf)] == ["dense", "sigmoid", "table", "clamp",
                                                                          "table", "step"]
    alphas = schedule_alphas(120, 100, 1.0, 8.0)  # (steps 0..119, the cosine over 100, then held)
    assert len(alphas) == 120 and alphas[0] == 1.0 and alphas[100:] == [8.0] * 20
    graphed = GraphedLoss(DecoderLM(tiny_config("mha", prune=True)), alphas, autocast_dtype=None)
    assert graphed.captured_forms == {"dense", "table"}   # alpha 1 at one step, alpha 2 at none: eager
    assert graphed.slot.p.numel() == max(tab._grid(a)[1] for a in alphas[1:])


def test_a_slot_in_use_is_this_contexts_alone():
    """App sessions run in threads: a slot one thread uses is not what another thread's _table answers from."""
    import threading
    slot = tab.TableSlot("cpu", tab.slot_points([4.0]))
    slot.load(4.0)
    seen = {}
    with tab.use_slot(slot):
        worker = threading.Thread(target=lambda: seen.setdefault("p", tab._table(3.0, "cpu").p.data_ptr()))
        worker.start()
        worker.join()
    assert seen["p"] != slot.p.data_ptr()


class _Capture:
    """make_graphed_callables' stand-in: notes each capture and, like its warm-up, runs the module forward and
    backward once while the slot holds the alpha it was captured at; the returned module runs eagerly after that
    (a graph would replay with the pointers it captured, which the slot test above pins)."""

    def __init__(self):
        self.forms, self.alphas = [], []

    def __call__(self, module, sample_args, allow_unused_input=False):
        assert allow_unused_input
        self.forms.append(form(module.model.blocks[0].mixer.pruning.current_alpha()
                               if module.model.config.prune else None))
        out = module(*sample_args)  # (a warm-up: autograd.grad, nothing reaches .grad)
        torch.autograd.grad(sum(o.sum() for o in out), [p for p in module.parameters() if p.requires_grad],
                            allow_unused=True)
        return module


def _eager_step(model, x, y):
    model.zero_grad(set_to_none=True)
    res = model(x, targets=y)
    loss = res.loss if res.prune_mass is None else res.loss + sparsity_loss(res.prune_mass, 0.3, pair_count(2, 16))
    loss.backward()
    return res.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("prune", [True, False])
def test_a_graphed_loss_captures_once_a_form_and_gives_the_eager_steps_loss_and_gradients(triton_keep, prune):
    """Across a schedule's alphas (the sigmoid, tables of different lengths, the clamp, tables again) the loss and
    every gradient equal the eager step's; one capture per form, in the order the forms first come."""
    torch.manual_seed(0)
    model = DecoderLM(tiny_config("mha", prune=prune, n_layers=2, context=16)).train()
    randomize(model, std=0.1)
    x, y = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    alphas = [1.0, 1.02, 8.0, 2.0, 1.3, 1.02] if prune else [None, None]
    capture = _Capture()
    graphed = GraphedLoss(model, [a for a in alphas if a is not None], autocast_dtype=None, capture=capture,
                          min_steps=1)
    for a in alphas:
        if a is not None:
            model.set_alpha(a)
        want_loss, want_grads = _eager_step(model, x, y)
        model.zero_grad(set_to_none=True)
        lm, mass = graphed(x, y)
        assert (mass is None) == (not prune)
        loss = lm if mass is None else lm + sparsity_loss(mass, 0.3, pair_count(2, 16))
        loss.backward()
        assert torch.equal(lm.detach(), want_loss), a
        got = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(got) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(got, want_grads)), a
        if a is not None and tab.needs_table(a):
            assert graphed.slot.alpha == a
    assert capture.forms == (["sigmoid", "table", "clamp"] if prune else ["dense"])
    assert set(graphed.paths) == set(capture.forms)
    if prune:
        assert graphed.paths["table"].get("log_keep") == "triton"
    with pytest.raises(ValueError, match="replays batches of"):
        graphed(x[:1], y[:1])


def test_what_a_graphed_loss_refuses_and_where_it_runs_eagerly(monkeypatch, caplog):
    model = DecoderLM(tiny_config("mha", prune=True, n_layers=2, context=16)).train()
    x = torch.randint(0, 61, (1, 16))
    model.set_alpha(1.5)
    capture = _Capture()  # a form the run's alphas do not hold runs eagerly
    lm = GraphedLoss(model, [1.0, 2.0], autocast_dtype=None, capture=capture, min_steps=1)(x, x)[0]
    assert capture.forms == [] and torch.equal(lm, model(x, targets=x).loss)
    del lm  # (an eager step's graph alive would stop a first capture where torch cannot redirect its streams)
    # the reference keep path reads the table's range from the host: a captured table step would keep the
    # capture's alpha in every replay
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    with pytest.raises(RuntimeError, match="needs the Triton keep kernel"):
        GraphedLoss(model, [1.5], autocast_dtype=None, capture=_Capture(), min_steps=1)(x, x)
    # a form the run's alphas hold at fewer than min_steps steps runs eagerly, with no capture
    capture = _Capture()
    lm = GraphedLoss(model, [1.5] * 7, autocast_dtype=None, capture=capture)(x, x)[0]
    assert capture.forms == [] and torch.equal(lm, model(x, targets=x).loss)
    del lm

    def broken(module, sample_args, allow_unused_input=False):
        raise RuntimeError("operation not permitted when stream is capturing")
    graphed = GraphedLoss(model, [1.5, 1.0], autocast_dtype=None, capture=broken, min_steps=1)
    with caplog.at_level("WARNING"):
        lm = graphed(x, x)[0]   # a failed capture: said, noted, and every form eager from then on
    assert "runs eagerly" in caplog.text and "not permitted" in graphed.failed["table"]
    assert not graphed.replays(1.5) and not graphed.replays(1.0) and torch.equal(lm, model(x, targets=x).loss)
    del lm
    def out_of_memory(module, sample_args, allow_unused_input=False):
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):  # (eager would fare no better: raised, not turned eager)
        GraphedLoss(model, [1.5], autocast_dtype=None, capture=out_of_memory, min_steps=1)(x, x)
    # a replay's gradients are the graph's own buffers: a gradient left from before would be added to itself
    dense = DecoderLM(tiny_config("mha", n_layers=2, context=16)).train()
    graphed = GraphedLoss(dense, autocast_dtype=None, capture=_Capture())
    graphed(x, x)[0].backward()
    with pytest.raises(ValueError, match="set every .grad to None"):
        graphed(x, x)
    dense.zero_grad(set_to_none=True)
    graphed(x, x)
    dense.eval()
    with pytest.raises(ValueError, match="eval mode"):
        graphed(x, x)


def test_a_graphed_loss_captures_our_attention_kernels_when_asked(triton_keep, monkeypatch):
    """Under MIXSCOPE_CAUSAL_BIAS=triton (the profile's graphed runs with kernels.triton_causal_bias) each form's
    capture takes our attention kernels, and the loss and gradients equal the eager step's on the same path."""
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "triton")
    torch.manual_seed(0)
    model = DecoderLM(tiny_config("gqa", n_kv_heads=2, positions="rope", prune=True, n_layers=2, context=16)).train()
    randomize(model, std=0.1)
    x, y = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    capture = _Capture()
    graphed = GraphedLoss(model, [1.02, 2.0], autocast_dtype=None, capture=capture, min_steps=1)
    for a in (1.02, 2.0):
        model.set_alpha(a)
        with kernels.record_paths() as eager_paths:
            want_loss, want_grads = _eager_step(model, x, y)
        model.zero_grad(set_to_none=True)
        lm, mass = graphed(x, y)
        (lm + sparsity_loss(mass, 0.3, pair_count(2, 16))).backward()
        assert torch.equal(lm.detach(), want_loss), a
        got = [p.grad for p in model.parameters() if p.grad is not None]
        assert len(got) == len(want_grads) and all(torch.equal(g, w) for g, w in zip(got, want_grads)), a
        assert eager_paths["attention"] == "triton"
    assert capture.forms == ["table", "clamp"] and all(p["attention"] == "triton" for p in graphed.paths.values())


def test_models_train_holds_no_earlier_steps_graph_when_it_calls_its_graphed_loss(tmp_path, monkeypatch):
    """A form's capture can follow an eager step of the same run (a form with too few steps runs eagerly first).
    Any autograd graph of that step still alive then keeps the parameters' AccumulateGrad nodes it made on the
    default stream, which the capture's backward would have to wait on: on an H200 (2026-11-28) the first capture
    of a tiny pruned run failed with cudaErrorStreamCaptureImplicit (PyTorch warned of such a node kept alive by
    tensors such as the loss: bench/results/gpu_tests_h200_run3.txt), and took the process's CUDA generator with
    it. models.train, with its GraphedLoss replaced by one that checks this and runs eagerly: when a step asks for
    its loss, no live tensor's graph reaches a parameter of the model (the loss, the mass, or what a module kept,
    as each layer's sparsity mass once was)."""
    import json

    from models import train as train_mod
    from models.step_graph import eager_loss
    from tests.test_train_eval import tiny_corpus, write_config

    calls = []

    class Checked:
        graphs, failed = {}, {}

        def __init__(self, model):
            self.loss, self.params = eager_loss(model, None), list(model.parameters())

        def __call__(self, x, y):
            held = graphs_holding(self.params)
            assert not held, f"step {len(calls)}: live tensors hold an earlier step's graph: {held}"
            calls.append(1)
            return self.loss(x, y)

    monkeypatch.setattr(train_mod, "graphed_loss", lambda model, *a, **k: Checked(model))
    data = tiny_corpus(tmp_path)
    cfg = write_config(tmp_path / "c.json", data, mixer="mha", steps=3, cuda_graph=True, eval_interval=100,
                       checkpoint_interval=100)
    raw = json.loads(cfg.read_text())
    raw["model"] |= {"prune": True, "prune_r": 8}
    cfg.write_text(json.dumps(raw))
    card = train_mod.train(cfg, tmp_path / "m", progress=False)
    assert card["steps"] == 3 and len(calls) == 3


def test_what_graphs_holding_finds():
    """A loss kept alive holds its parameters' graph (it and the activations the graph saved are named), and so
    does a kept autograd node; a loss kept only by a garbage cycle does not; another model's parameter is not
    reached; a tensor subclass whose torch functions raise is read without them; two tensors whose graphs share
    nodes are both named, whichever the collector lists first."""
    model = DecoderLM(tiny_config("mha", n_layers=2, context=16)).train()
    params = list(model.parameters())
    x = torch.randint(0, 61, (1, 16))
    assert graphs_holding(params) == []
    kept = model(x, targets=x).loss
    held = graphs_holding(params)
    assert len(held) == 3 and all(" torch.float32 from " in h and "Backward" in h for h in held), held
    assert graphs_holding([torch.nn.Parameter(torch.ones(1))]) == []
    kept.backward()  # (frees the saved activations: the loss alone holds the graph, then its node alone)
    model.zero_grad(set_to_none=True)
    node = kept.grad_fn
    del kept
    held = graphs_holding(params)  # (the node, or the wrappers of its graph's nodes the earlier walks made)
    assert held and all(h.startswith("an autograd node ") for h in held) and node is not None, held
    cycle = [model(x, targets=x).loss]
    cycle.append(cycle)
    del node, cycle
    assert graphs_holding(params) == []

    class Hostile(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise RuntimeError("no torch functions here")

    hostile = torch.ones(2).as_subclass(Hostile)
    assert graphs_holding(params) == [] and hostile is not None
    shared = torch.nn.Parameter(torch.ones(3))
    grown = shared.exp()
    twice, thrice = grown * 2, grown * 3  # (both graphs pass through grown's node)
    del grown
    assert sorted(graphs_holding([shared])) == ["(3,) torch.float32 from MulBackward0"] * 2, (twice, thrice)


@pytest.mark.skipif(not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"), reason="no such setting")
def test_a_capture_with_an_earlier_steps_graph_alive_redirects_its_streams_or_runs_eagerly(monkeypatch, caplog):
    """Before a first capture, an eager step's loss kept alive holds its parameters' AccumulateGrad nodes. Where
    torch can point such nodes at the capturing stream, the capture runs with that on and the setting is restored
    after, also when the capture raises; where it cannot, the form is not captured and the step runs eagerly, the
    holder named, rather than start a capture that would fail on a GPU. A later form's capture is not checked."""
    model = DecoderLM(tiny_config("mha", n_layers=2, context=16)).train()
    x = torch.randint(0, 61, (1, 16))
    kept = model(x, targets=x).loss
    seen = []

    class Noting(_Capture):
        def __call__(self, module, sample_args, allow_unused_input=False):
            seen.append(torch._C._override_stale_capture_stream())
            return super().__call__(module, sample_args, allow_unused_input)

    before = torch._C._override_stale_capture_stream()
    graphed = GraphedLoss(model, autocast_dtype=None, capture=Noting())
    with caplog.at_level("INFO", logger="models.step_graph"):
        lm, _ = graphed(x, x)
    assert seen == [True] and torch._C._override_stale_capture_stream() == before and graphed.graphs
    assert "points its nodes at the capture's stream" in caplog.text and torch.equal(lm, kept)

    def broken(module, sample_args, allow_unused_input=False):
        assert torch._C._override_stale_capture_stream()
        raise RuntimeError("operation not permitted when stream is capturing")
    graphed = GraphedLoss(model, autocast_dtype=None, capture=broken)
    graphed(x, x)
    assert "not permitted" in graphed.failed["dense"] and "dense" not in graphed.paths
    assert torch._C._override_stale_capture_stream() == before

    monkeypatch.delattr(torch.autograd.graph, "set_override_stale_capture_stream")  # (a torch without it)
    caplog.clear()
    graphed = GraphedLoss(model, autocast_dtype=None, capture=Noting())
    with caplog.at_level("WARNING"):
        lm, _ = graphed(x, x)
    assert seen == [True] and not graphed.graphs and "Backward" in graphed.failed["dense"]
    assert "runs eagerly" in caplog.text and torch.equal(lm, kept) and not graphed.replays(None)
    del kept, lm
    graphed = GraphedLoss(model, autocast_dtype=None, capture=Noting())
    graphed(x, x)
    assert seen == [True, False] and graphed.graphs and not graphed.failed
    # after a first capture its module holds the nodes (on a GPU, made on its warm-up's side stream): a later
    # form's capture goes ahead with a replay's graph alive
    pruned = DecoderLM(tiny_config("mha", prune=True, n_layers=2, context=16)).train()
    capture = Noting()
    graphed = GraphedLoss(pruned, [1.0, 2.0], autocast_dtype=None, capture=capture, min_steps=1)
    pruned.set_alpha(1.0)
    kept = graphed(x, x)[0]
    pruned.set_alpha(2.0)
    graphed(x, x)
    assert kept.grad_fn is not None and graphs_holding(list(pruned.parameters()))
    assert capture.forms == ["sigmoid", "clamp"] and not graphed.failed
