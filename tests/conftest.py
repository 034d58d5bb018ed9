import os

# Triton kernels run on CPU through the interpreter; it must be set before triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A test that opens a shipped delta model must not download its 538 MB base: it fails with the reason instead.
os.environ.setdefault("MIXSCOPE_NO_FETCH", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    yield
