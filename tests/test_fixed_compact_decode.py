"""The compacted cache with fixed shapes (models.pruning.fixed_compact, new_compact_cache(fixed=True); models.graphs
captures its steps on a GPU): a decode step writes at a device-side cursor and reads the buffers up to it, compaction
moves the live slots to the front of the same buffers between steps, and the buffers only grow. On the CPU: it
decodes what the dynamic compacted cache decodes (logits, every drop and its trigger, live counts) through
compactions and growth, for the learned rule and for dense models on the compacted cache, on fresh random weights;
nothing after the cursor is read; the kernels' `lengths` keep nothing after it."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from models import graphs
from models.decode import Decoder
from models.pruning import policies
from tests.helpers import randomize, tiny_config
from models.transformer import DecoderLM

CONFIGS = [dict(mixer="mha", prune=True), dict(mixer="mha", prune=True, prune_distance=True, prune_sinks=2),
           dict(mixer="gqa", n_kv_heads=2, positions="rope", prune=True), dict(mixer="mhe-mul", prune=True),
           dict(mixer="mqa"), dict(mixer="mha")]


def model_for(overrides: dict, seed: int) -> DecoderLM:
    model = DecoderLM(tiny_config(context=96, **overrides)).double().eval()
    randomize(model, std=0.3, seed=seed)
    for block in model.blocks if model.config.prune else ():
        block.mixer.pruning.beta.data.fill_(0.0)  # a random beta may keep everything: some drop, some stay
    return model


def run(model, idx, n_prompt: int, fixed: bool, noise: bool = False):
    dec = Decoder(model, idx.shape[0], "compacted", capacity=16, fixed=fixed)
    if noise:  # what a reused cache left in its buffers after the cursor must change nothing
        for layer in dec.state.layers:
            for buf in layer.buffers.values():
                buf.normal_(0, 50.0)
    drops = []
    with torch.inference_mode():
        out = [dec.prefill(idx[:, :n_prompt].tolist(), last_only=False)]
        drops += dec.new_drops()
        for i in range(n_prompt, idx.shape[1]):
            out.append(dec.step(idx[:, i])[:, None])
            drops += dec.new_drops()
    return torch.cat(out, 1), sorted(drops), dec


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_fixed_shapes_decode_what_the_compacted_cache_decodes(overrides):
    seed = int(torch.randint(0, 10_000, ()))
    model = model_for(overrides, seed)
    idx = torch.randint(0, 61, (2, 90))
    got, got_drops, fixed = run(model, idx, 7, fixed=True, noise=True)
    want, want_drops, plain = run(model, idx, 7, fixed=False)
    assert torch.allclose(got, want, atol=1e-10, rtol=0), f"seed {seed}"
    assert got_drops == want_drops, f"seed {seed}"
    assert fixed.live(0) == plain.live(0) and fixed.live(1) == plain.live(1)
    layers = fixed.state.layers
    assert all(int(layer.cursor) == layer.end for layer in layers)
    if not overrides.get("prune"):
        assert fixed.state.allocations > 0     # 16 slots to begin with, nothing dropped: it grew
    else:
        assert len(got_drops) > 0 and sum(layer.compactions for layer in layers) > 0, f"seed {seed}"
        for layer in layers:  # compacted in place: nothing after `end`, the live slots in position order
            n = layer.end
            assert n < 90 and not bool(layer.live[:, n:].any()) and bool((layer.pos[:, n:] == -1).all())
            pos = layer.pos[:, :layer.end].masked_fill(~layer.live[:, :layer.end], -1)
            for row in pos:
                seen = row[row >= 0]
                assert torch.equal(seen, seen.sort().values)


def test_extend_after_the_prompt_then_steps_again():
    """A call of several tokens between fixed-shape steps takes the dynamic path and the cursors follow it."""
    model = model_for(CONFIGS[0], seed=5)
    idx = torch.randint(0, 61, (2, 60))
    want, want_drops, _ = run(model, idx, 7, fixed=False)
    dec = Decoder(model, 2, "compacted", capacity=16, fixed=True)
    drops = []
    with torch.inference_mode():
        out = [dec.prefill(idx[:, :7].tolist(), last_only=False)]
        out += [dec.step(idx[:, i])[:, None] for i in range(7, 30)]
        out.append(dec.extend(idx[:, 30:40]))
        out += [dec.step(idx[:, i])[:, None] for i in range(40, 60)]
        drops = dec.new_drops()
    assert torch.allclose(torch.cat(out, 1), want, atol=1e-10, rtol=0)
    assert sorted(drops) == want_drops
    assert int(dec.state.next_pos[0]) == 60


def test_compact_decode_lengths_keep_nothing_after_them(monkeypatch):
    """kernels.compact_decode with `lengths`: the slots from lengths[b] on are neither read nor kept (garbage
    there, even live bits, changes nothing), on the reference and on the Triton kernel (interpreter)."""
    b, h, s, d, r, n = 2, 4, 48, 16, 8, 20
    q = torch.randn(b, h, 1, d)
    k, v = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    pos = torch.arange(s).expand(b, -1).contiguous()
    live = torch.rand(b, s) < 0.8
    prune = {"q_int": torch.randn(b, r), "k_int": torch.randn(b, s, r), "beta": 0.1, "live": live, "pos": pos,
             "q_pos": torch.full((b,), n - 1), "valid": None, "lam": 0.3, "sinks": 1}
    cut = {**prune, "k_int": prune["k_int"][:, :n], "live": live[:, :n], "pos": pos[:, :n]}
    want, want_keep = kernels.reference.decode(q, k[:, :, :n], v[:, :, :n], scale=0.25, prune=cut)
    lengths = torch.full((b,), n)
    for path in ("reference", "triton"):
        monkeypatch.setenv("MIXSCOPE_KERNELS", path)
        got, keep = kernels.compact_decode(q, k, v, scale=0.25, prune=prune, lengths=lengths)
        assert torch.allclose(got, want, atol=2e-5), path
        assert torch.equal(keep[:, :n], want_keep) and not bool(keep[:, n:].any()), path
    from kernels import triton_attention
    from tests.test_kernels_triton import _Poisoned
    monkeypatch.setattr(triton_attention, "torch", _Poisoned())  # fresh buffers hold garbage (a keep of True)
    for block_n, n_split in ((16, 3), (16, 2), (32, 1)):  # the splits share the rows' lengths, not the buffer
        got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=prune, lengths=lengths, block_n=block_n,
                                            n_split=n_split)
        assert torch.allclose(got, want, atol=2e-5) and torch.equal(keep[:, :n], want_keep), (block_n, n_split)
        assert not bool(keep[:, n:].any()), (block_n, n_split)  # written, not left as it was allocated


@pytest.mark.parametrize("block_n,n_split", [(16, 4), (16, 6), (64, 1)])
def test_decode_splits_follow_each_rows_length(block_n, n_split):
    """With `lengths`, the decode kernel's splits divide each row's filled part (rows of 1, 17, 50 and 96 of
    96 slots, GQA), equal to the reference over each row's own slots."""
    from kernels import triton_attention
    b, h, g, s, d = 4, 4, 2, 96, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    lengths = torch.tensor([1, 17, 50, 96])
    got = triton_attention.decode(q, k, v, scale=0.25, lengths=lengths, block_n=block_n, n_split=n_split)
    for r, n in enumerate(lengths.tolist()):
        want = kernels.reference.attention(q[r:r + 1], k[r:r + 1, :, :n], v[r:r + 1, :, :n], scale=0.25,
                                           causal=False)[0]
        assert torch.allclose(got[r:r + 1], want, atol=2e-5), (r, n)


def test_the_keep_pass_switch_decodes_the_same_and_is_part_of_a_capture_key(monkeypatch):
    """MIXSCOPE_KEEP_PASS=1: the fixed-shape compacted decode on Triton (interpreter) runs the keep pass first,
    with the same logits and drops as without it; a captured step is keyed by the switch, so flipping it never
    replays a graph recorded the other way; a bad value is refused."""
    from kernels import triton_attention
    model = DecoderLM(tiny_config(context=96, prune=True, mixer="gqa", n_kv_heads=2)).eval()
    randomize(model, std=0.3, seed=11)
    for block in model.blocks:
        block.mixer.pruning.beta.data.fill_(0.0)
    idx = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(11))
    asked = []
    decode = triton_attention.decode
    monkeypatch.setattr(triton_attention, "decode", lambda *a, **kw: asked.append(kw["keep_pass"]) or decode(*a, **kw))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    keys = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("MIXSCOPE_KEEP_PASS", switch)
        keys[switch] = graphs._weights(model)
        asked.clear()
        logits, drops, _ = run(model, idx, 5, fixed=True)
        assert asked and set(asked) == {switch == "1"}, switch
        keys[switch + " out"] = (logits, drops)
    assert torch.allclose(keys["1 out"][0], keys["0 out"][0], atol=1e-5) and keys["1 out"][1] == keys["0 out"][1]
    assert keys["0 out"][1], "nothing dropped: the keep decisions were not compared"
    assert keys["0"] != keys["1"]
    monkeypatch.setenv("MIXSCOPE_KEEP_PASS", "yes")
    with pytest.raises(ValueError, match="MIXSCOPE_KEEP_PASS must be 0 or 1"):
        kernels.keep_pass()


def test_fixed_shapes_are_refused_under_a_policy_and_for_ragged_rows():
    model = model_for(dict(mixer="mha"), seed=1)
    with pytest.raises(ValueError, match="eviction policy"):
        Decoder(model, 1, "compacted", policy=policies.make("streaming", 8), fixed=True)
    with pytest.raises(ValueError, match="ragged"):
        Decoder(model, 2, "compacted", ragged=True, fixed=True)


def test_the_pool_hands_out_emptied_compacted_entries():
    model = model_for(CONFIGS[0], seed=2)
    entry = graphs.checkout(model, 1, 32, "compacted")
    dec_state = entry.state
    with torch.inference_mode():
        dec_state.layers[0].live[:, :3] = True
        dec_state.layers[0].pos[:, :3] = torch.arange(3)
        dec_state.layers[0].end = 3
        dec_state.fix_shapes(torch.tensor([[3]]))
    graphs.give_back(model, entry)
    again = graphs.checkout(model, 1, 32, "compacted")
    assert again is entry
    layer = again.state.layers[0]
    assert layer.end == 0 and int(layer.cursor) == 0 and not bool(layer.live.any()) and int(again.state.next_pos) == 0
    assert graphs.checkout(model, 1, 32, "static") is not entry   # another kind, another entry
    graphs.release(model)


@pytest.mark.parametrize("overrides", [dict(mixer="mha", prune_distance=True),
                                       dict(mixer="gqa", n_kv_heads=2, positions="rope", norm="rmsnorm", ffn="swiglu")],
                         ids=["mha-distance", "smollm2-like"])
def test_the_triton_decode_kernel_takes_the_fixed_shape_path(overrides, monkeypatch):
    """The whole fixed-shape decode through the Triton kernels (interpreter), against the dynamic cache on the
    reference: the kernel reads each row up to the cursor and keeps nothing after it; every write of a step is one
    kernel (kernels.step_write, a rotary model's rotation of q and K too), and its norms and SwiGLU run fused."""
    model = DecoderLM(tiny_config(context=96, prune=True, **overrides)).eval()
    randomize(model, std=0.3, seed=7)
    for block in model.blocks:
        block.mixer.pruning.beta.data.fill_(0.0)
    idx = torch.randint(0, 61, (2, 40), generator=torch.Generator().manual_seed(7))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    want, want_drops, _ = run(model, idx, 5, fixed=False)
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    got, got_drops, dec = run(model, idx, 5, fixed=True, noise=True)
    assert dec.kernel_paths.get("compact_decode") == "triton" and dec.kernel_paths.get("add_norm") == "triton"
    assert dec.kernel_paths.get("step_write") == "triton"
    if overrides.get("positions") == "rope":
        assert dec.kernel_paths.get("silu_mul") == "triton"
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert got_drops == want_drops and len(want_drops) > 0


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_a_one_token_call_with_diagnostics_between_fixed_steps(path, monkeypatch):
    """A fixed-shape compacted cache fed one token with diagnostics (not a fixed-shape step: the general insert,
    then the cursors follow the host's count), then fixed-shape steps again: the dynamic cache's logits
    throughout, and every layer's cursor and read length where its host count is."""
    monkeypatch.setenv("MIXSCOPE_KERNELS", path)
    model = model_for(dict(mixer="gqa", n_kv_heads=2, positions="rope", prune=True), seed=11)
    if path == "triton":
        model = model.float()
    idx = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(11))
    outs = []
    for fixed in (False, True):
        cache = model.new_compact_cache(batch=1, capacity=16, fixed=fixed)
        pos = torch.arange(12)[None]
        with torch.inference_mode():
            got = [model(idx[:, :5], cache=cache, positions=pos[:, :5]).logits]
            if fixed:
                cache.fix_shapes(pos[:, 5:6])
            got.append(model(idx[:, 5:6], cache=cache, positions=pos[:, 5:6], diagnostics=True).logits)
            for i in range(6, 12):
                if fixed:  # what models.decode.Decoder does around a fixed-shape step
                    cache.make_room()
                    got.append(model(idx[:, i:i + 1], cache=cache).logits)
                    cache.advance(1)
                else:
                    got.append(model(idx[:, i:i + 1], cache=cache, positions=pos[:, i:i + 1]).logits)
        outs.append(torch.cat(got, 1))
        if fixed:
            assert all(int(layer.cursor) == layer.end and int(layer.filled) == layer.end + 1 for layer in cache.layers)
    assert torch.allclose(outs[1], outs[0], atol=1e-4 if path == "triton" else 1e-10, rtol=0)


def test_a_pooled_cache_grown_in_inference_mode_is_reset_outside_it_and_decodes_again():
    """The app decodes under inference mode; the cache grows there; the pool resets it from anywhere and the
    next generation over it decodes what a fresh cache decodes."""
    model = model_for(dict(mixer="mha"), seed=8)  # dense: nothing dropped, so 16 slots must grow
    idx = torch.randint(0, 61, (1, 50), generator=torch.Generator().manual_seed(8))
    first = Decoder(model, 1, "compacted", capacity=16, fixed=True)
    with torch.inference_mode():
        first.prefill([idx[0, :30].tolist()])
        for i in range(30, 50):
            first.step(idx[:, i])
    assert first.state.allocations > 0
    state = first.state
    state.reset()  # outside inference mode, as graphs.checkout does
    assert all(layer.end == 0 and not bool(layer.live.any()) for layer in state.layers)
    again = Decoder(model, 1, "compacted", capacity=16, fixed=True)
    again.state = state  # (what graphs.checkout hands a decoder: the emptied cache)
    other = idx.flip(1)
    want, want_drops, _ = run(model, other, 6, fixed=False)
    with torch.inference_mode():
        got = [again.prefill(other[:, :6].tolist(), last_only=False)]
        got += [again.step(other[:, i])[:, None] for i in range(6, 50)]
    assert torch.allclose(torch.cat(got, 1), want, atol=1e-10, rtol=0)


def test_one_token_extends_and_a_decoder_started_by_extend_keep_fixed_shapes():
    """extend() of one token is a fixed-shape step too (room made, context checked), and a decoder whose first
    call is extend() (no prefill) fixes its shapes after it, as the static cache's does."""
    model = model_for(CONFIGS[0], seed=9)
    idx = torch.randint(0, 61, (2, 96), generator=torch.Generator().manual_seed(9))
    want, want_drops, _ = run(model, idx, 5, fixed=False)
    for kind in ("compacted", "static"):
        dec = Decoder(model, 2, kind, capacity=16 if kind == "compacted" else None, fixed=True)
        with torch.inference_mode():
            out = [dec.extend(idx[:, :5])]
            assert (dec.state.next_pos if kind == "compacted" else dec.state.cursor) is not None
            out += [dec.extend(idx[:, i:i + 1]) for i in range(5, 96)]
            with pytest.raises(ValueError, match="context window"):
                dec.extend(idx[:, :1])
        assert torch.allclose(torch.cat(out, 1), want, atol=1e-10, rtol=0), kind
        if kind == "compacted":
            assert sorted(dec.new_drops()) == want_drops
            # 16 slots to begin with: room was made before one-token extends (a full cache would have refused)
            assert dec.state.allocations + sum(layer.compactions for layer in dec.state.layers) > 0


class HostReads(TorchDispatchMode):
    """Every aten op run inside, by name and argument shapes; the ones that read a device value on the host."""
    READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
             "aten.item.default"}

    def __init__(self):
        super().__init__()
        self.ops, self.reads = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args
                       if isinstance(a, (torch.Tensor, int, float, bool)))
        self.ops.append((str(func), shapes))
        if str(func) in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides,kind", [(CONFIGS[1], "compacted"), (CONFIGS[2], "compacted"),
                                            (dict(mixer="mha"), "compacted"), (CONFIGS[0], "static")],
                         ids=["mha-distance-sinks", "gqa-rope", "dense-on-compacted", "static-pruned"])
def test_a_fixed_shape_step_reads_nothing_on_the_host_and_repeats_its_ops(overrides, kind):
    """What a CUDA graph needs of a step: no device value read on the host, and the same ops on the same
    shapes at every step until the cache reallocates (then the step is captured again)."""
    model = model_for(overrides, seed=10)
    idx = torch.randint(0, 61, (2, 90), generator=torch.Generator().manual_seed(10))
    dec = Decoder(model, 2, kind, capacity=16 if kind == "compacted" else None, fixed=True)
    seen = {}
    with torch.inference_mode():
        dec.prefill(idx[:, :7].tolist())
        for i in range(7, 90):
            if kind == "compacted":
                dec.before_fixed_step()
            epoch = getattr(dec.state, "allocations", 0)
            token = idx[:, i:i + 1]
            with HostReads() as rec:
                dec.model(token, cache=dec.state, last_only=True)
            dec.state.advance(1)
            dec.lengths = [n + 1 for n in dec.lengths]
            assert rec.reads == [], f"step {i} reads on the host: {rec.reads}"
            assert seen.setdefault(epoch, rec.ops) == rec.ops, f"step {i}: other ops than the epoch's first step"
    if kind == "compacted" and not model.config.prune:
        assert len(seen) > 1  # it grew: a new epoch, a new capture


def test_the_reference_keeps_nothing_after_lengths_on_its_general_path():
    b, h, s, d, r = 2, 2, 12, 8, 4
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    prune = {"q_int": torch.randn(b, r), "k_int": torch.randn(b, s, r), "beta": 5.0,
             "live": torch.ones(b, s, dtype=torch.bool), "pos": torch.arange(s).expand(b, -1),
             "q_pos": torch.full((b,), 5), "valid": torch.tensor([True, False])}
    _, keep = kernels.reference.decode(q, k, v, scale=0.3, prune=prune, lengths=torch.tensor([6, 6]))
    assert bool(keep[:, :6].all()) and not bool(keep[:, 6:].any())


def test_a_compacted_decode_call_launches_no_conversion_kernels(monkeypatch):
    """Around its two kernels, triton_attention.decode over a fixed-shape cache's buffers (bool live mask, int64
    positions, the cursor expanded over the batch) runs no op that would be a kernel of its own: a decode step
    replayed from a CUDA graph at batch 1 is bound by its kernel count (there were seven: five dtype
    conversions, a fill of ones, a zero fill and a bool copy of the keep mask)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kernels import triton_attention

    class Launch:  # the kernels themselves are not aten ops; stand in for them
        def __getitem__(self, grid):
            return lambda *a, **kw: None

    monkeypatch.setattr(triton_attention, "_decode_kernel", Launch())
    monkeypatch.setattr(triton_attention, "_merge_kernel", Launch())

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    b, h, s, d, r = 2, 4, 64, 16, 8
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    prune = {"q_int": torch.randn(b, r), "k_int": torch.randn(b, s, r), "beta": 0.1, "live": torch.rand(b, s) < 0.8,
             "pos": torch.arange(s).expand(b, -1).contiguous(), "q_pos": torch.full((b,), 30), "valid": None,
             "lam": 0.3, "sinks": 1}
    cursor = torch.tensor([31])
    noting = dict(prune, trig=torch.full((b, s), -1))  # noting its drops in the cache's live and trig (a step's path)
    with Ops() as ops:
        triton_attention.decode(q, k, v, scale=0.25, prune=prune, lengths=cursor.expand(b))
        triton_attention.decode(q, k, v, scale=0.25, prune=noting, lengths=cursor.expand(b))
    assert ops.seen <= {"empty", "new_empty", "view", "expand", "detach", "alias"}, ops.seen
