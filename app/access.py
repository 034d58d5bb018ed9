"""What a browser user may reach on this server: `make run` (one user, this machine) or `make serve` (a shared box).

In serve mode (MIXSCOPE_SERVE=1) adding a model by path is off unless MIXSCOPE_PATH_ROOTS names directories
(separated by ':'), and then a typed path must resolve (symlinks and '..' followed) to a directory inside one of
them; a model's weights file over MIXSCOPE_MAX_WEIGHTS_MB (default 2,048 in serve mode, no cap otherwise) is
refused before it is read; messages shown in the browser name server directories by label, not by path. Serve
mode also caps what one request may ask for: text a page reads (MIXSCOPE_SERVE_MAX_CHARS, default 8,000
characters, against 20,000 on the loopback) and tokens one generation adds (MIXSCOPE_SERVE_MAX_NEW_TOKENS, default
256, against the model's context).
"""
from __future__ import annotations

from pathlib import Path

from analysis.budgets import MAX_CHARS, SERVE_MAX_CHARS, SERVE_MAX_NEW_TOKENS  # noqa: F401 - serve mode's defaults, re-exported
from analysis.zoo import REPO, models_root
from kernels import settings


def serving() -> bool:
    return settings.get("MIXSCOPE_SERVE")


def path_roots() -> list[Path]:
    """The directories a typed path may lead into (serve mode); empty: adding by path is off."""
    return [r.expanduser().resolve() for r in settings.get("MIXSCOPE_PATH_ROOTS")]


def max_weight_bytes() -> int | None:
    mb = settings.get("MIXSCOPE_MAX_WEIGHTS_MB")
    if mb is None:
        mb = 2048 if serving() else None
    return None if mb is None else int(mb * 2**20)


def max_chars() -> int:
    """The most characters a text box or upload takes here."""
    return min(MAX_CHARS, max(1, settings.get("MIXSCOPE_SERVE_MAX_CHARS"))) if serving() else MAX_CHARS


def max_new_tokens(context: int) -> int:
    """The most tokens one generation may add here (never past the model's context)."""
    return min(context, max(1, settings.get("MIXSCOPE_SERVE_MAX_NEW_TOKENS"))) if serving() else context


def adding_by_path() -> bool:
    return not serving() or bool(path_roots())


def outside_roots(path: str) -> str | None:
    """Why serve mode will not open this typed path (None: it may): it must lead into one of the roots once
    symlinks and '..' are resolved. Outside serve mode every path may be tried."""
    if not serving():
        return None
    roots = path_roots()
    if not roots:
        return "adding models by path is off on this server"
    try:
        real = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return "that path cannot be resolved"
    if not _inside(real, roots):
        return "that path is outside the directories this server opens models from"
    return None


MEMBERS = ("config.json", "model.safetensors", "tokenizer.json", "card.json", "base.json")


def _inside(real: Path, places: list[Path]) -> bool:
    return any(real == p or p in real.parents for p in places)


def model_dir_problem(path: str | Path) -> str | None:
    """Why serve mode will not open this model directory now (None: it may), checked when it is opened, not only
    when it was added: the directory and each of its files must resolve inside the models folder or a root (no
    symlink out), and a base it is stored over must be the registry cache's or lie inside them too. A card's
    init_from (a pruned model's dense twin) is opened through here as well. Outside serve mode: None."""
    if not serving():
        return None
    from models.delta import base_cache, base_dir_for, read_base_spec
    places = [models_root().resolve(), *path_roots()]
    try:
        real = Path(path).expanduser().resolve()
        if not _inside(real, places):
            return "it is outside the directories this server opens models from"
        if any((real / m).exists() and not _inside((real / m).resolve(), [real]) for m in MEMBERS):
            return "a file in it links outside the directory"
        if (real / "base.json").is_file():
            source = read_base_spec(real)["source"]
            base = base_dir_for(source, real).resolve()
            registry = source.startswith("pypi:") and _inside(base, [base_cache().resolve()])
            if not registry and not _inside(base, places):
                return "the base its base.json names is outside the directories this server opens models from"
    except Exception as e:  # noqa: BLE001 - an unreadable directory or base.json is refused, whatever the reason
        return f"it cannot be checked ({type(e).__name__})"
    return None


def public(message: str) -> str:
    """A message as a browser user of a shared server may see it: the server's directories named by label
    (serve mode; `make run`'s one local user sees the paths)."""
    if not serving():
        return message
    places = [(models_root().resolve(), "<models>"), (REPO.resolve(), "<app>"), (Path.home().resolve(), "~")]
    if settings.is_set("MIXSCOPE_CACHE"):
        places.append((settings.get("MIXSCOPE_CACHE").expanduser().resolve(), "$MIXSCOPE_CACHE"))
    places += [(r, f"<root {i + 1}>") for i, r in enumerate(path_roots())]
    for place, label in sorted(places, key=lambda p: -len(str(p[0]))):   # the most specific first
        if str(place) not in ("/", ""):
            message = message.replace(str(place), label)
    return message
