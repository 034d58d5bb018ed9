"""Every mixer against the literal equations of its paper, on fresh random weights and inputs."""
import zlib

import pytest
import torch

from models.mixers import build_mixer
from tests import naive
from tests.helpers import ALL_MIXERS, tiny_config, randomize

SIZES = [  # (d_model, n_heads, d_head, T)
    (16, 4, None, 9),
    (24, 3, None, 13),
    (12, 6, None, 1),
    (20, 2, 7, 6),     # d_head not d_model / n_heads (not valid for el-att)
]


CASES = [(m, s) for m in ALL_MIXERS for s in SIZES if not (m == "el-att" and s[2] is not None)]  # el-att: n d_h = d_m


@pytest.mark.parametrize("mixer,size", CASES, ids=[f"{m}-d{s[0]}_n{s[1]}_dh{s[2]}_t{s[3]}" for m, s in CASES])
def test_mixer_matches_naive_equations(mixer, size):
    d_model, n_heads, d_head, t = size
    cfg = tiny_config(mixer, d_model=d_model, n_heads=n_heads, d_head=d_head, context=16)
    m = build_mixer(cfg).double()
    randomize(m, seed=zlib.crc32(f"{mixer}{size}".encode()))
    x = torch.randn(2, t, d_model, dtype=torch.float64)
    with torch.no_grad():
        got = m(x)
        want = naive.mixer_output(m, x)
    assert got.shape == want.shape == (2, t, d_model)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mixer", ALL_MIXERS)
def test_naive_check_can_fail(mixer):
    """Guard the guard: corrupting one weight entry must break agreement with the naive version."""
    cfg = tiny_config(mixer, context=16)
    m = build_mixer(cfg).double()
    randomize(m)
    x = torch.randn(1, 7, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        want = naive.mixer_output(m, x)
        name = "W_Q" if hasattr(m, "W_Q") else "w_ext"
        getattr(m, name).view(-1)[0] += 1.0
        got = m(x)
    assert not torch.allclose(got, want, atol=1e-6)
