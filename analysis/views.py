"""Views: how much of a text each page analyses and what it opens on, in one place, so the app's pages and
analysis.export draw the same windows.

Views are tokens: a page analyses a window of at most this many tokens of a longer text, the first one unless its
slider picks another (app.common.window_picker), and analysis.export draws that first window. What those windows
cost in memory is planned in analysis.budgets (on models.memory).
"""
from __future__ import annotations

from analysis.text import MAX_CHARS, window
from kernels import settings

# re-exported: the text limit from analysis.text (where text is checked), which every view below is a window of
__all__ = ["MAX_CHARS"]

# ---- text --------------------------------------------------------------------------------------------------------
# MAX_CHARS (analysis.text): characters a page or analysis.export reads; every view below is a window of it
# serve mode's caps, a shared server's defaults (declared in kernels.settings, which the operator's value overrides):
SERVE_MAX_CHARS = settings.default("MIXSCOPE_SERVE_MAX_CHARS")            # 8,000 characters of the above
SERVE_MAX_NEW_TOKENS = settings.default("MIXSCOPE_SERVE_MAX_NEW_TOKENS")  # 256 tokens one generation adds

# ---- views: tokens per window ------------------------------------------------------------------------------------
ATTENTION_VIEW = 128     # Attention: [layers, heads, T, T] maps (30 x 9 x 128^2 floats = 18 MB) and a zoomed map whose
                         # 128 token labels stay readable
ATTRIBUTION_VIEW = 256   # Attribution: each gradient is a forward and backward over the window (SmolLM2: ~0.5 GB)
COMPARE_VIEW = 128       # Compare: two models' surprisal and maps side by side, the Attention page's view each
PRUNING_VIEW = 1024      # Pruning: keep masks, one byte a cell (30 layers x 1,024^2 = 31 MB), and a policy replay
SCORES_VIEW = 256        # the Pruning page's interaction scores: 256 queries x 256 keys drawn at once (analysis.scores)
MAX_SNAPSHOTS = 32       # Pruning's timeline: the training snapshots replayed on a window, one forward each
LIVE_STRIP = 1024        # Generate's live strips: the last 1,024 positions x 30 layers stay light in a browser


def view(size: int, context: int) -> int:
    """A view's tokens on a model: never past its context (what window_picker shows)."""
    return min(size, context)


def first_window(tokens, size: int, context: int):
    """The window a page shows before its slider moves: the first view(size, context) tokens."""
    return window(tokens, 0, view(size, context))


# ---- what a page opens on --------------------------------------------------------------------------------------

def large_model() -> int:
    """Parameters past which a page starts on its cheaper setting (Attribution: gradient x input; Pruning: the
    second forward and the dense base wait to be asked for): MIXSCOPE_LARGE_MODEL, default 50 M."""
    return int(settings.get("MIXSCOPE_LARGE_MODEL"))   # (a float: "5e7" is accepted too)


ATTRIBUTION_STEPS = 16   # the Attribution page's default integrated-gradients steps


def attribution_default(params: int) -> tuple[str, int]:
    """The Attribution page's opening method and steps for a model of this many parameters: gradient x input past
    large_model() (one gradient takes seconds on a CPU), integrated gradients otherwise."""
    return ("gradient x input" if params > large_model() else "integrated gradients"), ATTRIBUTION_STEPS
