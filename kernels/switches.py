"""The kernels' environment switches, read at every call (a benchmark's A/B sets one per row): one parser, and one
message for a value it does not know. A leaf module, so that kernels/__init__.py and kernels/efficient.py (which
__init__ imports) can both read them."""
from __future__ import annotations

import os


def switch(name: str, allowed: tuple[str, ...], default: str) -> str:
    """The value of environment variable `name`, trimmed and lower-cased, one of `allowed`; `default` when unset or
    empty. Anything else raises ValueError naming the variable and what it takes."""
    v = os.environ.get(name, "").strip().lower()
    if not v:
        return default
    if v not in allowed:
        said = ", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0]
        raise ValueError(f"{name} must be {said}, got {v!r}")
    return v


def kernels() -> str | None:
    """MIXSCOPE_KERNELS: "reference" or "triton" forces every op's path; None lets the device choose."""
    v = switch("MIXSCOPE_KERNELS", ("reference", "triton"), "")
    return v or None
