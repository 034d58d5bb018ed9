"""target_logprobs: log p of each target, straight from the softmax's definition, whatever the chunking."""
import math

import pytest
import torch

from models.scoring import target_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [1, 3, 512])
def test_target_logprobs_from_the_definition(dtype, chunk):
    g = torch.Generator().manual_seed(int(chunk) + 7)
    logits = (torch.randn(2, 10, 13, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 13, (2, 10), generator=g)
    got = target_logprobs(logits, targets, chunk=chunk)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and got.shape == (2, 10)
    for b in range(2):
        for i in range(10):
            row = [float(v) for v in logits[b, i].double()]
            want = row[int(targets[b, i])] - math.log(sum(math.exp(v) for v in row))
            assert float(got[b, i]) == pytest.approx(want, abs=1e-5)
