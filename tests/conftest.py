import os
import tempfile

# Triton kernels run on CPU through the interpreter; it must be set before triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A test that opens a shipped delta model must not download its 538 MB base: it fails with the reason instead.
os.environ.setdefault("MIXSCOPE_NO_FETCH", "1")
# ... and sees an empty base cache, so the shipped deltas look the same here as on a fresh machine (CI); a slow test
# that needs the fetched bases (tests/test_load_sessions.py) finds the machine's own cache under USER_CACHE.
USER_CACHE = os.environ.get("MIXSCOPE_CACHE") or os.path.expanduser("~/.cache/mixscope")
os.environ["MIXSCOPE_CACHE"] = tempfile.mkdtemp(prefix="mixscope-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    yield


# `make test-quick` (a change in progress, under 2 minutes on 2 cores) leaves these files out: the browser, the
# pages under AppTest, commands run as subprocesses, the Triton interpreter and compiler, figure export and the
# whole-report tests; `make test` (what CI runs) keeps them. Measured with --durations on a clean clone: these are
# ~80 % of it.
FULL_TIER_FILES = {
    "test_browser", "test_app_pages", "test_app_generate_live", "test_app_imported", "test_app_pruning",
    "test_serve_mode", "test_export", "test_kernels_triton", "test_bad_input", "test_layout", "test_matched_report",
    "test_cli", "test_generate_cli", "test_bench_smoke", "test_kernels_compile",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in FULL_TIER_FILES:
            item.add_marker(pytest.mark.full)
