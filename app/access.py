"""What a browser user may reach on this server: `make run` (one user, this machine) or `make serve` (a shared box).

In serve mode (MIXSCOPE_SERVE=1) adding a model by path is off unless MIXSCOPE_PATH_ROOTS names directories
(separated by ':'), and then a typed path must resolve (symlinks and '..' followed) to a directory inside one of
them; a model's weights file over MIXSCOPE_MAX_WEIGHTS_MB (default 2,048 in serve mode, no cap otherwise) is
refused before it is read; messages shown in the browser name server directories by label, not by path. Serve
mode also caps what one request may ask for: text a page reads (MIXSCOPE_SERVE_MAX_CHARS, default 8,000
characters, against 20,000 on the loopback) and tokens one generation adds (MIXSCOPE_SERVE_MAX_NEW_TOKENS, default
256, against the model's context).

The checks themselves live beside the readers (models.delta, models.checkpoint): loading checks each file where it
reads it (place_problem, the base's weights, the weights cap on a delta and its base together); this module asks
them up front, for a page to say why before it loads. A typed path is never expanded ('~daemon' is not looked up:
every path starting with '~' is refused with the message a path outside the roots gets).
"""
from __future__ import annotations

from pathlib import Path

from analysis.views import MAX_CHARS
from analysis.zoo import REPO, models_root
from kernels import settings


def serving() -> bool:
    return settings.get("MIXSCOPE_SERVE")


def path_roots() -> list[Path]:
    """The directories a typed path may lead into (serve mode); empty: adding by path is off."""
    return [r.expanduser().resolve() for r in settings.get("MIXSCOPE_PATH_ROOTS")]


def max_weight_bytes() -> int | None:
    """Bytes of weights one model may read, its base's included (models.delta.weights_cap)."""
    from models.delta import weights_cap
    return weights_cap()


def max_chars() -> int:
    """The most characters a text box or upload takes here."""
    return min(MAX_CHARS, max(1, settings.get("MIXSCOPE_SERVE_MAX_CHARS"))) if serving() else MAX_CHARS


def max_new_tokens(context: int) -> int:
    """The most tokens one generation may add here (never past the model's context)."""
    return min(context, max(1, settings.get("MIXSCOPE_SERVE_MAX_NEW_TOKENS"))) if serving() else context


def adding_by_path() -> bool:
    return not serving() or bool(path_roots())


OUTSIDE = "that path is outside the directories this server opens models from"


def outside_roots(path: str) -> str | None:
    """Why serve mode will not open this typed path (None: it may): it must lead into one of the roots once
    symlinks and '..' are resolved. '~' is never expanded (no user name is looked up): such a path, like one that
    cannot be resolved, gets the one message a path outside the roots gets. Outside serve mode every path may be
    tried."""
    if not serving():
        return None
    roots = path_roots()
    if not roots:
        return "adding models by path is off on this server"
    from models.delta import inside, real_path
    real = None if path.startswith("~") else real_path(path)
    if real is None or not inside(real, roots):
        return OUTSIDE
    return None


def model_dir_problem(path: str | Path) -> str | None:
    """Why serve mode will not open this model directory now (None: it may), checked when it is opened, not only
    when it was added: the directory must resolve inside the models folder or a root, each of its files (and its
    snapshots folder) inside the directory (no symlink out), and the base its base.json names must be readable
    inside them (a registry base: in the base cache), one message whatever lies outside
    (models.checkpoint.place_problem; loading checks each file again as it reads it). A card's init_from (a pruned
    model's dense twin) is opened through here as well. Outside serve mode: None."""
    if not serving():
        return None
    from models.checkpoint import open_places, place_problem
    try:
        return place_problem(path, open_places())   # (the models folder and the roots)
    except Exception:  # noqa: BLE001 - whatever the reason, the directory is refused, and nothing of it is told
        return "it cannot be checked"


def public(message: str) -> str:
    """A message as a browser user of a shared server may see it: the server's directories named by label
    (serve mode; `make run`'s one local user sees the paths)."""
    if not serving():
        return message
    named = [(models_root(), "<models>"), (REPO, "<app>"), (Path.home(), "~")]
    if settings.is_set("MIXSCOPE_CACHE"):
        named.append((settings.get("MIXSCOPE_CACHE").expanduser(), "$MIXSCOPE_CACHE"))
    named += [(r.expanduser(), f"<root {i + 1}>") for i, r in enumerate(settings.get("MIXSCOPE_PATH_ROOTS"))]
    # each place as it is written and as it resolves (a message may carry either: a link in the path shows both)
    places = {(str(form), label) for place, label in named for form in (place, place.resolve())}
    for place, label in sorted(places, key=lambda p: -len(p[0])):   # the most specific first
        if place not in ("/", "", "."):
            message = message.replace(place, label)
    return message
