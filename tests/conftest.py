import os
import tempfile

# Triton kernels run on CPU through the interpreter; it must be set before triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A test that opens a shipped delta model must not download its 538 MB base: it fails with the reason instead.
os.environ.setdefault("MIXSCOPE_NO_FETCH", "1")
# ... and sees an empty base cache, so the shipped deltas look the same here as on a fresh machine (CI).
os.environ["MIXSCOPE_CACHE"] = tempfile.mkdtemp(prefix="mixscope-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    yield
