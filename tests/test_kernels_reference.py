"""The reference kernels against loops, and the dispatch."""
import pytest
import torch

import kernels
from kernels import reference


def loop_attention(q, k, v, scale):
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // g)
            for ti in range(t):
                last = s - t + ti
                sc = torch.stack([q[bi, hi, ti] @ k[bi, kv, j] * scale for j in range(last + 1)])
                a = sc.softmax(0)
                out[bi, hi, ti] = (a[:, None] * v[bi, kv, :last + 1]).sum(0)
    return out


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("h,g,t,s", [(4, 4, 5, 5), (6, 1, 3, 8), (6, 2, 1, 7), (3, 3, 7, 7), (5, 1, 1, 1),
                                     (6, 2, 5, 5)])  # (t == s: SDPA's own causal flag, grouped too)
def test_attention_matches_loops(h, g, t, s, need_weights):
    q = torch.randn(2, h, t, 8, dtype=torch.float64)
    k, v = torch.randn(2, g, s, 8, dtype=torch.float64), torch.randn(2, g, s, 8, dtype=torch.float64)
    out, probs = reference.attention(q, k, v, scale=0.3, need_weights=need_weights)
    torch.testing.assert_close(out, loop_attention(q, k, v, 0.3))
    assert (probs is not None) == need_weights


LAG_CASES = [(s, start, method) for s, start in [(1, 0), (9, 0), (9, 4), (9, 8), (23, 0), (23, 20)]
             for method in ("direct", "fft", "auto") if not (method == "fft" and start)]  # fft: whole sequences


@pytest.mark.parametrize("wshape", ["scalar", "channel", "matrix"])
@pytest.mark.parametrize("s,start,method", LAG_CASES)
def test_lag_conv_matches_loops(wshape, s, start, method):
    c, lags = 5, 24
    x = torch.randn(2, s, c, dtype=torch.float64)
    w = {"scalar": torch.randn(lags), "channel": torch.randn(lags, c),
         "matrix": torch.randn(lags, c, 3)}[wshape].double()
    want = torch.zeros(2, s - start, 3 if wshape == "matrix" else c, dtype=torch.float64)
    for i in range(start, s):
        for j in range(i + 1):
            want[:, i - start] += x[:, j] @ w[i - j] if wshape == "matrix" else x[:, j] * w[i - j]
    torch.testing.assert_close(reference.lag_conv(x, w, start, method), want)


def test_lag_conv_fft_refuses_partial_sequences():
    with pytest.raises(ValueError, match="whole sequences"):
        reference.lag_conv(torch.randn(1, 5, 2), torch.randn(8), start=2, method="fft")


def test_lag_conv_refuses_more_positions_than_lags():
    with pytest.raises(ValueError, match="exceeds the 4 lag weights"):
        reference.lag_conv(torch.randn(1, 5, 2), torch.randn(4))


def test_dispatch(monkeypatch):
    q = torch.randn(1, 2, 3, 4)
    monkeypatch.delenv("MIXSCOPE_KERNELS", raising=False)
    with kernels.record_paths() as paths:
        with kernels.record_paths() as inner:
            kernels.attention(q, q, q, scale=0.5)
        with kernels.record_paths() as other:
            pass
    assert paths["attention"] == "reference" == inner["attention"]   # CPU tensors take the reference
    assert other == {}   # a recorder sees its own calls; the enclosing one sees its inner ones' too
    monkeypatch.setenv("MIXSCOPE_KERNELS", "reference")
    assert kernels.backend_for("attention", q) == "reference"
    monkeypatch.setenv("MIXSCOPE_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="MIXSCOPE_KERNELS"):
        kernels.attention(q, q, q, scale=0.5)
    monkeypatch.setenv("MIXSCOPE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.backend_for("attention", q) == ("triton" if "attention" in kernels.TRITON else "reference")
    monkeypatch.delenv("TRITON_INTERPRET")
    if "attention" in kernels.TRITON:  # CPU tensors reach Triton only through its interpreter
        with pytest.raises(RuntimeError, match="needs CUDA tensors"):
            kernels.attention(q, q, q, scale=0.5)
    monkeypatch.setattr(kernels, "TRITON", {})  # a machine without triton: the reference, and it says so
    with kernels.record_paths() as paths:
        kernels.attention(q, q, q, scale=0.5)
    assert paths["attention"] == "reference"


def test_a_switch_is_trimmed_defaulted_and_refuses_what_it_does_not_know(monkeypatch):
    """kernels.settings, which every kernel switch reads through: case and spaces do not matter, unset or empty is
    the default, and an unknown value names the variable and what it takes."""
    from kernels import settings
    monkeypatch.delenv("MIXSCOPE_CAUSAL_BIAS", raising=False)
    assert settings.get("MIXSCOPE_CAUSAL_BIAS") == "1"
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "  ")
    assert settings.get("MIXSCOPE_CAUSAL_BIAS") == "1"
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", " Triton ")
    assert settings.get("MIXSCOPE_CAUSAL_BIAS") == "triton"
    monkeypatch.setenv("MIXSCOPE_CAUSAL_BIAS", "yes")
    with pytest.raises(ValueError, match=r"MIXSCOPE_CAUSAL_BIAS must be 0, 1 or triton, got 'yes'"):
        settings.get("MIXSCOPE_CAUSAL_BIAS")
