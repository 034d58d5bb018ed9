"""Every Triton kernel against its PyTorch reference on fresh random inputs, in Triton's CPU interpreter
(TRITON_INTERPRET=1, set in conftest; float32 there: bf16 tl.dot is broken in the interpreter).

Kernel outputs are allocated poisoned (NaN, or 7 for the int8 keep mask) so an element a kernel forgets to
write fails the comparison. The model-level tests run whole models with MIXSCOPE_KERNELS=triton.
"""
import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402
from kernels import reference, triton_attention, triton_lag  # noqa: E402
from models.transformer import DecoderLM  # noqa: E402
from tests.helpers import ATTENTION, cached_logits, randomize, tiny_config  # noqa: E402


class _Poisoned:
    """torch, except that fresh buffers come pre-filled with garbage."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else 7)

    def empty(self, *a, **kw):
        return self._poison(torch.empty(*a, **kw))

    def empty_like(self, *a, **kw):
        return self._poison(torch.empty_like(*a, **kw))


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    monkeypatch.setattr(triton_attention, "torch", _Poisoned())
    monkeypatch.setattr(triton_lag, "torch", _Poisoned())


def close(got, want, tol=2e-5):
    assert not got.isnan().any(), "the kernel left elements unwritten"
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def head_maps(kind, h, d):
    if kind == "mul":
        return {"q_mul": 1 + 0.5 * torch.randn(h, d), "o_mul": 1 + 0.5 * torch.randn(h, d)}
    if kind == "add":
        return {"q_add": torch.randn(h, d), "o_add": torch.randn(h, d)}
    return {}


# (batch, query heads, K/V groups, new positions T, cache + new positions S, head width)
PREFILL = [(2, 4, 4, 5, 5, 16), (1, 3, 3, 1, 1, 16), (2, 6, 2, 7, 13, 12), (1, 5, 1, 70, 70, 16),
           (3, 3, 1, 33, 96, 8), (1, 1, 1, 129, 129, 32)]


@pytest.mark.parametrize("b,h,g,t,s,d", PREFILL)
@pytest.mark.parametrize("bias", [False, True])
def test_prefill_matches_reference(b, h, g, t, s, d, bias):
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    log_mask = None
    if bias:  # a pruning-style log-mask: finite values and some -inf, never on the diagonal
        log_mask = torch.randn(b, 1, t, s).masked_fill(torch.rand(b, 1, t, s) < 0.3, float("-inf"))
        log_mask[..., torch.arange(t), torch.arange(s - t, s)] = 0.0
    got = triton_attention.prefill(q, k, v, scale=d ** -0.5, bias=log_mask)
    want, _ = reference.attention(q, k, v, scale=d ** -0.5, bias=log_mask)
    close(got, want)


@pytest.mark.parametrize("kind", ["mul", "add"])
@pytest.mark.parametrize("t,s", [(1, 1), (9, 9), (4, 21), (40, 40)])
def test_prefill_head_embeddings_from_one_shared_kv(kind, t, s):
    h, d = 6, 16
    q, k, v = torch.randn(2, 1, t, d), torch.randn(2, 1, s, d), torch.randn(2, 1, s, d)
    maps = head_maps(kind, h, d)
    got = triton_attention.prefill(q, k, v, scale=0.25, **maps)
    want, _ = reference.attention(q, k, v, scale=0.25, **maps)
    assert got.shape == (2, h, t, d)
    close(got, want)


def test_prefill_without_causal_mask_uses_bias_only():
    q, k, v = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16)
    mask = torch.zeros(2, 1, 4, 10).masked_fill(torch.rand(2, 1, 4, 10) < 0.5, float("-inf"))
    mask[..., 0] = 0.0
    close(triton_attention.prefill(q, k, v, scale=0.3, bias=mask, causal=False),
          reference.attention(q, k, v, scale=0.3, bias=mask, causal=False)[0])


def with_maps(shapes, kind):
    """Each shape plain, and with head maps where it has one K/V group (the only case MHE has)."""
    return [(*shape, m) for shape in shapes for m in ("none", kind) if m == "none" or shape[2] == 1]


@pytest.mark.parametrize("b,h,g,s,d,kind", with_maps([(3, 6, 2, 37, 16), (2, 5, 1, 200, 12), (1, 1, 1, 1, 16),
                                                      (4, 8, 8, 64, 32)], "mul"))
@pytest.mark.parametrize("n_split", [1, 3, None])
def test_decode_mixed_lengths_matches_reference(b, h, g, s, d, kind, n_split):
    maps = head_maps(kind, h, d)
    q = torch.randn(b, 1 if maps else h, 1, d)
    k, v = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    lengths = torch.randint(1, s + 1, (b,))
    lengths[0] = s
    got = triton_attention.decode(q, k, v, scale=0.3, lengths=lengths, n_split=n_split, **maps)
    close(got, reference.decode(q, k, v, scale=0.3, lengths=lengths, **maps))


def test_decode_with_bias_equals_prefill_of_one_token():
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    bias = torch.zeros(2, 1, 1, 50).masked_fill(torch.rand(2, 1, 1, 50) < 0.4, float("-inf"))
    bias[..., -1] = 0.0
    close(triton_attention.decode(q, k, v, scale=0.3, bias=bias, n_split=4),
          reference.attention(q, k, v, scale=0.3, bias=bias)[0])


def prune_state(b, s, r, beta, live_share=0.7):
    pos = torch.stack([torch.randperm(s) for _ in range(b)])       # slots are not in position order
    live = torch.rand(b, s) < live_share
    q_pos = torch.tensor([int(pos[i][live[i]].max()) if live[i].any() else 0 for i in range(b)])
    own = pos == q_pos[:, None]
    live |= own                                                      # the new token is in its slot
    unused = torch.rand(b, s) < 0.1
    pos = pos.masked_fill(unused & ~own, -1)
    live &= pos >= 0
    return {"q_int": torch.randn(b, r), "k_int": torch.randn(b, s, r), "beta": beta, "live": live, "pos": pos,
            "q_pos": q_pos, "valid": torch.ones(b, dtype=torch.bool)}


@pytest.mark.parametrize("b,h,g,s,r,kind", with_maps([(3, 4, 1, 40, 8), (2, 6, 3, 70, 16), (1, 5, 5, 1, 8),
                                                      (2, 3, 1, 129, 12)], "add"))
@pytest.mark.parametrize("keep_pass", [False, True])
@pytest.mark.parametrize("terms", [{}, {"lam": 0.3, "sinks": 2}])  # the distance term and sink tokens
def test_compact_decode_matches_reference(b, h, g, s, r, kind, keep_pass, terms):
    d = 16
    maps = head_maps(kind, h, d)
    q = torch.randn(b, 1 if maps else h, 1, d)
    k, v = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    state = prune_state(b, s, r, beta=0.1) | terms
    state["valid"][-1] = b == 1                                    # a padding row (when there are several)
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=state, n_split=2, keep_pass=keep_pass, **maps)
    want, want_keep = reference.decode(q, k, v, scale=0.25, prune=state, **maps)
    assert torch.equal(keep, want_keep)
    close(got, want)
    if s > 1:
        assert (state["live"] & ~want_keep).any(), "this setting must drop something"


@pytest.mark.parametrize("b,h,g,s,kind", with_maps([(3, 4, 1, 40), (2, 6, 3, 70), (1, 5, 5, 1)], "mul"))
@pytest.mark.parametrize("keep_pass", [False, True])
def test_compact_decode_with_every_row_real_equals_the_general_rule(b, h, g, s, kind, keep_pass):
    """valid None (the decode step's fast path: no padding rows) keeps and attends exactly as valid = all True,
    in the reference's short path and in the kernel."""
    d, maps = 16, head_maps(kind, h, 16)
    q = torch.randn(b, 1 if maps else h, 1, d)
    k, v = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    state = prune_state(b, s, 8, beta=0.1)
    want, want_keep = reference.decode(q, k, v, scale=0.25, prune=state, **maps)
    fast = dict(state, valid=None)
    got, keep = reference.decode(q, k, v, scale=0.25, prune=fast, **maps)
    assert torch.equal(keep, want_keep)
    close(got, want)
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=fast, n_split=2, keep_pass=keep_pass, **maps)
    assert torch.equal(keep, want_keep)
    close(got, want)


def in_place_state(state, extra: int = 5):
    """prune_state with the cache's drop notes: live and trig as [B,S] views of wider buffers (the cache's slots
    up to `end` of its capacity), trig holding earlier notes (-1 never dropped, -2 collected, a position)."""
    b, s = state["live"].shape
    live = torch.zeros(b, s + extra, dtype=torch.bool)
    live[:, :s] = state["live"]
    trig = torch.randint(-2, 30, (b, s + extra))
    return dict(state, live=live[:, :s], trig=trig[:, :s]), live, trig


@pytest.mark.parametrize("b,h,g,s,lengths", [(3, 4, 1, 40, None), (2, 6, 3, 70, None), (2, 6, 3, 70, [33, 70]),
                                             (1, 9, 3, 129, [100])])
@pytest.mark.parametrize("valid", [None, "padding"])
@pytest.mark.parametrize("keep_pass", [False, True])
def test_compact_decode_notes_its_drops_in_place_as_the_reference_does(b, h, g, s, lengths, valid, keep_pass):
    """prune["trig"]: keep written over the cache's live mask and the query's position noted where it dropped a
    slot, by the kernel (group 0 writes while other groups read the same live bits; with keep_pass the keep pass
    writes and every group reads) as by the reference; the slots past the views are untouched."""
    d = 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    base = prune_state(b, s, 8, beta=0.1)
    if valid is None:
        base["valid"] = None
    elif b > 1:
        base["valid"][-1] = False
    lens = None if lengths is None else torch.tensor(lengths)
    if lens is not None:  # the cache's slots from a row's length on are empty (nothing live, no position)
        past = torch.arange(s) >= lens[:, None]
        base["live"] &= ~past
        base["pos"] = base["pos"].masked_fill(past, -1)
    want_state, want_live, want_trig = in_place_state(base)
    old_live, old_trig = want_live.clone(), want_trig.clone()
    want, want_keep = reference.decode(q, k, v, scale=0.25, prune=want_state, lengths=lens)
    got_state, got_live, got_trig = in_place_state(base)
    got_trig.copy_(old_trig)
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=got_state, lengths=lens, n_split=3,
                                        keep_pass=keep_pass)
    close(got, want)
    assert torch.equal(got_live, want_live) and torch.equal(got_trig, want_trig)
    assert keep.data_ptr() == got_live.data_ptr() and torch.equal(keep, want_keep)
    dropped = old_live[:, :s] & ~want_live[:, :s]
    assert dropped.any(), "this setting must drop something"
    assert torch.equal(want_trig[:, :s][dropped], base["q_pos"][:, None].expand(b, s)[dropped])
    assert torch.equal(want_trig[:, :s][~dropped], old_trig[:, :s][~dropped])
    assert torch.equal(got_trig[:, s:], old_trig[:, s:]) and torch.equal(got_live[:, s:], old_live[:, s:])


class _NoMerge:
    """Stands in for _merge_kernel where the decode must merge its own splits."""

    def __getitem__(self, grid):
        raise AssertionError("the separate merge kernel was launched")


@pytest.mark.parametrize("b,h,g,s,d,kind", with_maps([(3, 6, 2, 37, 16), (2, 5, 1, 200, 12), (1, 1, 1, 1, 16),
                                                      (1, 9, 3, 129, 64), (2, 8, 2, 512, 16)], "mul")
                         + [(2, 4, 1, 50, 16, "add"), (2, 4, 1, 512, 16, "add")])
@pytest.mark.parametrize("n_split", [1, 3, 8, None])  # (at 512 slots: 8 real splits, and the merge's loads of several)
def test_decode_merges_its_own_splits_with_merge_counts(b, h, g, s, d, kind, n_split, monkeypatch):
    """With a decode state's counts, the split that finishes last combines the partials (and applies MHE's output
    maps) in the decode kernel: the reference's output, the separate merge's bits, no merge launch, and the counts
    left at zero for the next call (here called twice). Only the first B*G counts are used (the others hold a mark
    that must stay)."""
    maps = head_maps(kind, h, d)
    q = torch.randn(b, 1 if maps else h, 1, d)
    k, v = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    lengths = torch.randint(1, s + 1, (b,))
    counts = torch.zeros(b * g + 3, dtype=torch.int32)
    counts[b * g:] = 7
    want = reference.decode(q, k, v, scale=0.3, lengths=lengths, **maps)
    separate = triton_attention.decode(q, k, v, scale=0.3, lengths=lengths, n_split=n_split, **maps)
    monkeypatch.setattr(triton_attention, "_merge_kernel", _NoMerge())
    for _ in range(2):
        got = triton_attention.decode(q, k, v, scale=0.3, lengths=lengths, n_split=n_split, merge_counts=counts,
                                      **maps)
        close(got, want)
        assert torch.equal(got, separate)  # the separate merge sums as the last split does: the same bits
        assert not counts[:b * g].any() and bool((counts[b * g:] == 7).all())
    with pytest.raises(ValueError, match="merge_counts"):
        triton_attention.decode(q, k, v, scale=0.3, merge_counts=counts.long())
    with pytest.raises(ValueError, match="merge_counts"):
        triton_attention.decode(q, k, v, scale=0.3, merge_counts=counts[:b * g - 1])


@pytest.mark.parametrize("keep_pass", [False, True])
def test_compact_decode_merges_its_own_splits_and_notes_its_drops(keep_pass):
    b, h, g, s, d = 2, 6, 3, 70, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    base = prune_state(b, s, 8, beta=0.1)
    base["valid"] = None
    lens = torch.tensor([33, 70])
    past = torch.arange(s) >= lens[:, None]  # the cache's slots from a row's length on hold nothing
    base["live"] &= ~past
    base["pos"] = base["pos"].masked_fill(past, -1)
    want_state, want_live, want_trig = in_place_state(base)
    old_trig = want_trig.clone()
    want, _ = reference.decode(q, k, v, scale=0.25, prune=want_state, lengths=lens)
    got_state, got_live, got_trig = in_place_state(base)
    got_trig.copy_(old_trig)
    counts = torch.zeros(b * g, dtype=torch.int32)
    got, _ = triton_attention.decode(q, k, v, scale=0.25, prune=got_state, lengths=lens, n_split=4,
                                     merge_counts=counts, keep_pass=keep_pass)
    close(got, want)
    assert torch.equal(got_live, want_live) and torch.equal(got_trig, want_trig) and not counts.any()


def test_compact_decode_refuses_in_place_notes_on_a_copy():
    state, live, trig = in_place_state(prune_state(2, 20, 8, beta=0.1))
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 1, 20, 16), torch.randn(2, 1, 20, 16)
    with pytest.raises(ValueError, match="in place"):
        triton_attention.decode(q, k, v, scale=0.25, prune=dict(state, live=live.t().contiguous().t()[:, :20]))


@pytest.mark.parametrize("keep_pass", [False, True])
def test_compact_decode_all_dropped_but_self(keep_pass):
    b, h, s, r, d = 2, 4, 33, 8, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, 1, s, d), torch.randn(b, 1, s, d)
    state = prune_state(b, s, r, beta=-1e4, live_share=1.0)       # every score negative
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=state, keep_pass=keep_pass)
    assert torch.equal(keep, state["pos"] == state["q_pos"][:, None])
    own = (state["pos"] == state["q_pos"][:, None]).float().argmax(1)
    close(got, v[torch.arange(b), 0, own][:, None, None].expand(b, h, 1, d))  # attends to itself alone


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("b,s,c,start", [(2, 1, 3, 0), (2, 9, 5, 0), (2, 40, 33, 0), (1, 40, 7, 39), (2, 70, 20, 13)])
def test_lag_conv_matches_reference(per_channel, b, s, c, start):
    x = torch.randn(b, s, c)
    w = torch.randn(s + 3, c) if per_channel else torch.randn(s + 3)
    close(triton_lag.lag_conv(x, w, start), reference.lag_conv(x, w, start, method="direct"), tol=1e-4)


def test_lag_conv_refuses_matrix_lags_and_bad_start():
    with pytest.raises(ValueError, match="per-lag"):
        triton_lag.lag_conv(torch.randn(1, 4, 2), torch.randn(4, 2, 2))
    with pytest.raises(ValueError, match="start"):
        triton_lag.lag_conv(torch.randn(1, 4, 2), torch.randn(4), start=4)


def test_training_takes_the_reference_path_with_a_real_backward(monkeypatch):
    """The kernels are inference-only: with a gradient wanted, even a forced Triton dispatch runs the
    reference (SDPA), whose backward is autograd's; under no_grad the same call runs Triton, same values."""
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    h, d = 4, 16
    leaves = [torch.randn(2, 1, 7, d), torch.randn(2, 1, 7, d), torch.randn(2, 1, 7, d), torch.randn(2, 1, 7, 7),
              torch.randn(h, d), torch.randn(h, d)]
    ts = [t.clone().requires_grad_() for t in leaves]
    q, k, v, bias, qm, om = ts
    with kernels.record_paths() as paths:
        out, _ = kernels.attention(q, k, v, scale=0.3, bias=bias, q_mul=qm, o_mul=om)
    assert paths["attention"] == "reference" and out.grad_fn is not None
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in ts)
    with torch.no_grad(), kernels.record_paths() as paths:
        fast, _ = kernels.attention(*leaves[:3], scale=0.3, bias=leaves[3], q_mul=leaves[4], o_mul=leaves[5])
    assert paths["attention"] == "triton"
    close(fast, out.detach(), tol=1e-5)


def test_extractor_training_gets_gradients_through_the_dispatch(monkeypatch):
    """A Triton output has no grad_fn: the lag convolution must take the reference when training, else the
    Extractor's lag weights would silently never learn on a GPU."""
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    x, w = torch.randn(2, 9, 5, requires_grad=True), torch.randn(9, 5, requires_grad=True)
    with kernels.record_paths() as paths:
        kernels.lag_conv(x, w).square().sum().backward()
    assert paths["lag_conv"] == "reference"
    assert w.grad is not None and w.grad.abs().sum() > 0


@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("shape", ["[1,1,1,S]", "[B,1,1,S]", "[B,S]"])
def test_decode_with_a_pattern_bias_at_any_batch(b, shape):
    """The local/strided baselines pass one bias row shared by the batch; pruning-free decode must take
    it at batch > 1 (it crashed with reshape(b, s) before)."""
    h, g, s, d = 4, 2, 33, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    allowed = torch.rand(s) > 0.4
    allowed[-1] = True
    row = torch.zeros(s).masked_fill(~allowed, float("-inf"))
    bias = {"[1,1,1,S]": row.view(1, 1, 1, s), "[B,1,1,S]": row.expand(b, 1, 1, s).clone() + torch.randn(b, 1, 1, s),
            "[B,S]": row.expand(b, s).clone()}[shape]
    want = reference.decode(q, k, v, scale=0.25, bias=bias.reshape(-1, 1, 1, s).expand(b, 1, 1, s))
    close(triton_attention.decode(q, k, v, scale=0.25, bias=bias), want)


def test_decode_refuses_a_bias_that_does_not_cover_the_cache():
    q, k = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 10, 16)
    with pytest.raises(ValueError, match="cover the cache"):
        triton_attention.decode(q, k, k, scale=0.25, bias=torch.zeros(2, 1, 1, 9))


@pytest.mark.parametrize("pattern", ["local", "strided"])
def test_pattern_models_decode_at_batch_three_on_triton(pattern, monkeypatch):
    model = DecoderLM(tiny_config("mha", n_layers=1, pattern=pattern, pattern_k=4)).eval()
    randomize(model, std=0.2)
    idx = torch.randint(0, 61, (3, 13))
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    with torch.no_grad(), kernels.record_paths() as paths:
        inc, _ = cached_logits(model, idx, [5, 1, 1, 6])
    assert paths["attention"] == "triton"
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    with torch.no_grad():
        full = model(idx).logits
    close(inc, full, tol=1e-4)


@pytest.mark.parametrize("mixer", ATTENTION + ["me", "we", "he"])
def test_models_on_triton_equal_the_reference_path(mixer, monkeypatch):
    model = DecoderLM(tiny_config(mixer, n_layers=1)).eval()
    randomize(model, std=0.2)
    idx = torch.randint(0, 61, (2, 13))
    results = {}
    for path in ("reference", "triton"):
        monkeypatch.setenv("MIXSCOPE_KERNELS", path)
        with torch.no_grad():
            results[path] = (model(idx).logits, cached_logits(model, idx, [5, 1, 1, 6])[0])
    full_ref, inc_ref = results["reference"]
    full_tri, inc_tri = results["triton"]
    close(full_tri, full_ref, tol=1e-4)
    close(inc_tri, full_ref, tol=1e-4)   # incremental decode on Triton == full forward
    close(inc_ref, full_ref, tol=1e-4)


@pytest.mark.parametrize("mixer", ["mha", "mhe-mul"])
def test_pruned_compacted_generation_on_triton_equals_the_full_forward(mixer, monkeypatch):
    from tests.test_compact_cache import compact_on_triton_and_full, model_for
    pairs, cache = compact_on_triton_and_full(model_for(mixer, beta=0.02).float(), monkeypatch)
    for got, full in pairs:
        close(got, full, tol=1e-4)
    assert len(cache.layers[0].drop_table()) > 0


def test_causality_of_the_prefill_kernel():
    q, k, v = torch.randn(1, 4, 20, 16), torch.randn(1, 4, 20, 16), torch.randn(1, 4, 20, 16)
    base = triton_attention.prefill(q, k, v, scale=0.3)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[:, :, 12:] += 5
    v2[:, :, 12:] -= 5
    q2[:, :, 12:] *= 3
    later = triton_attention.prefill(q2, k2, v2, scale=0.3)
    assert torch.equal(later[:, :, :12], base[:, :, :12])
    assert not torch.allclose(later[:, :, 12:], base[:, :, 12:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernels_in_half_precision(dtype):
    dev = "cuda"
    q = torch.randn(2, 8, 300, 64, device=dev, dtype=dtype)
    k, v = torch.randn(2, 2, 300, 64, device=dev, dtype=dtype), torch.randn(2, 2, 300, 64, device=dev, dtype=dtype)
    want, _ = reference.attention(q.float(), k.float(), v.float(), scale=0.125)
    torch.testing.assert_close(triton_attention.prefill(q, k, v, scale=0.125).float(), want, atol=2e-2, rtol=2e-2)
    qd = q[:, :, -1:]
    want = reference.decode(qd.float(), k.float(), v.float(), scale=0.125)
    torch.testing.assert_close(triton_attention.decode(qd, k, v, scale=0.125).float(), want, atol=2e-2, rtol=2e-2)
    x, w = torch.randn(2, 300, 96, device=dev, dtype=dtype), torch.randn(300, 96, device=dev, dtype=dtype)
    want = reference.lag_conv(x.float(), w.float(), method="direct")
    torch.testing.assert_close(triton_lag.lag_conv(x, w).float(), want, atol=0.25, rtol=2e-2)


@pytest.mark.parametrize("keep_pass", [False, True])
def test_compact_decode_keeps_nothing_after_a_rows_length(keep_pass):
    """A fixed-shape cache read up to each row's length, keep in a fresh (poisoned) buffer: every slot from the
    length on comes back not kept, whichever launch decides keep; the rest as the reference says."""
    b, h, g, s, d = 3, 4, 2, 90, 16
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    state = prune_state(b, s, 8, beta=0.1)
    state["valid"] = None
    lens = torch.tensor([1, 47, 90])
    past = torch.arange(s) >= lens[:, None]
    state["live"] &= ~past
    state["pos"] = state["pos"].masked_fill(past, -1)
    for i, n in enumerate(lens.tolist()):  # the query in its row's last filled slot
        state["pos"][i, n - 1], state["live"][i, n - 1] = state["q_pos"][i], True
    want, want_keep = reference.decode(q, k, v, scale=0.25, prune=state, lengths=lens)
    got, keep = triton_attention.decode(q, k, v, scale=0.25, prune=state, lengths=lens, n_split=3,
                                        keep_pass=keep_pass)
    assert torch.equal(keep, want_keep) and not keep[past].any()
    close(got, want)


@pytest.mark.parametrize("merge", [False, True])
def test_decode_of_a_row_that_sees_nothing_is_zero_as_in_the_reference(merge):
    """A row whose length is 0 leaves every split empty (log-sum-exp -inf): both merges give the reference's 0 (the
    separate merge's earlier formula gave NaN there)."""
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    lengths = torch.tensor([0, 5])
    counts = torch.zeros(4, dtype=torch.int32) if merge else None
    got = triton_attention.decode(q, k, v, scale=0.3, lengths=lengths, n_split=3, merge_counts=counts)
    close(got, reference.decode(q, k, v, scale=0.3, lengths=lengths))
    assert not got[0].any()


@pytest.mark.parametrize("splits_a_load,lse_a_load", [(1, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("scale", [0.3, 40.0])  # 40: log-sum-exps past float32's exp range unless the maximum is right
def test_merge_over_several_loads_equals_the_reference(splits_a_load, lse_a_load, merge, scale, monkeypatch):
    """The merge's two passes over the splits (the largest log-sum-exp, then the weighted sum) in loads of a few
    splits each, as on a GPU where 128 splits outnumber a load (with a part-filled last
    load: the 5 splits of 300 slots in tiles of 2 or 4): the reference's output, in the decode's own merge and in
    the one launched after it."""
    tiles = triton_attention.merge_tiles
    monkeypatch.setattr(triton_attention, "merge_tiles",
                        lambda r, d, warps: (tiles(r, d, warps)[0], splits_a_load, lse_a_load))
    b, h, g, s, d = 2, 6, 2, 300, 16
    q, k, v = torch.randn(b, 1, 1, d), torch.randn(b, g, s, d), torch.randn(b, g, s, d)  # MHE: one shared q
    lengths = torch.tensor([300, 170])
    maps = head_maps("add", h, d)
    counts = torch.zeros(b * g, dtype=torch.int32) if merge else None
    got = triton_attention.decode(q, k, v, scale=scale, lengths=lengths, n_split=5, merge_counts=counts, **maps)
    close(got, reference.decode(q, k, v, scale=scale, lengths=lengths, **maps))


def test_decode_takes_its_launch_shape_from_the_caches_dtype_and_device(monkeypatch):
    """float32 on a GPU has a table of its own (at d = 128 bf16's shape ran ptxas out of registers: tests/
    test_kernels_compile.py holds its spills); the interpreter and half types keep the tuned bf16 shape, and
    decode() asks with the cache's dtype and device."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert triton_attention.decode_launch(64, torch.float32, cuda) == triton_attention.DECODE_LAUNCH_FP32[64]
    assert triton_attention.decode_launch(128, torch.float32, cuda) == (32, 8, 2) != triton_attention.DECODE_LAUNCH[128]
    for d in (16, 32, 256):  # widths the table does not name: float32's smallest-spilling shape, as before
        assert triton_attention.decode_launch(d, torch.float32, cuda) == (32, 8, 2)
    for dtype, device in ((torch.float32, cpu), (torch.bfloat16, cuda), (torch.float16, cuda)):
        assert triton_attention.decode_launch(64, dtype, device) == triton_attention.DECODE_LAUNCH[64]
    asked = []
    launch = triton_attention.decode_launch
    monkeypatch.setattr(triton_attention, "decode_launch", lambda *a: asked.append(a) or launch(*a))
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    got = triton_attention.decode(q, k, v, scale=0.25)
    assert asked == [(16, torch.float32, cpu)]
    assert torch.allclose(got, reference.decode(q, k, v, scale=0.25), atol=2e-5)
