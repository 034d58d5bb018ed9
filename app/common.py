"""What every page shares: cached model loading, the model picker, text input, export buttons.
UI only: the numbers and figures come from analysis/ and models/."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePath

import pandas as pd
import streamlit as st
import torch

from analysis import export
from app import access, heavy, model_cache, slots
from analysis.text import TextError, check_text, decode_upload, tokenize, window
from analysis.zoo import find_model_dirs, model_labels, models_root, zoo_table
import kernels.settings  # (by its full name: `settings` here is a figure's)
from app.loading import app_precision, load_for_app
from app.plain import md
from models.checkpoint import MEMBERS
from models.files import CheckpointError
from models.pruning import policies

# Threads for the models, set once for the server: the cores (MIXSCOPE_THREADS to share the machine) split between
# the computations that may run at once (app/slots.py), so all of them busy together use each core once.
torch.set_num_threads(slots.threads_per_slot(heavy.SLOTS))

SAMPLE_TEXT = ("The committee met again on Tuesday. After a long debate about the harbour, the roads and the "
               "price of bread, the members agreed that the new bridge would be built in the spring, and that "
               "every town along the river would share its cost.")


# what the Pruning and Generate pages call each method: a pruned model's own rule, nothing evicted, or a policy
METHOD_TITLES = {"learned": "learned (this model's own rule)", "none": "none (every token kept)"}


def method_title(method: str) -> str:
    """The learned rule, nothing, or an eviction policy's method id (models.pruning.policies.title)."""
    return METHOD_TITLES.get(method) or policies.title(method)


def setup(title: str) -> None:
    st.set_page_config(page_title="mixscope" if title == "mixscope" else f"mixscope · {title}", layout="wide")
    # the operator's own eviction policies (docs/policies.md)
    policies.load_plugins(kernels.settings.get("MIXSCOPE_POLICIES"))
    st.title(title)
    heavy.room()   # where this page says its place in the server's queue, if it has to wait


export.code_version()   # (read now: the code this server runs is the checkout as it started, not as it is later)
MODELS = model_cache.from_env()  # shared by every session of this server; bounded by bytes and idle time


# an absolute path left in a message once access.public has named the server's directories by label: "/a/b/c", not
# a label's rest ("<root 1>/m", "~/x"), a URL's ("http://h/p"), a ratio ("3/4") or a JSON escape
_PATH = re.compile(r"(?<![\w.~>:\\/…])/(?:[^/\s:'\"\\]+/)*[^/\s:'\"\\]*")


def public(message: str) -> str:
    """A message (an error, a table cell, a sidecar) as a browser user of this server may see it (plain text:
    md() it inside Markdown): access.public's labels for the server's directories, and in serve mode any other
    absolute path (a card's init_from, a report's, another machine's) by its last name alone."""
    message = access.public(message)
    if not access.serving():
        return message
    return _PATH.sub(lambda m: "…/" + m.group(0).rstrip("/").rsplit("/", 1)[-1] if m.group(0) != "/" else "/",
                     message)


def shown_path(path) -> str:
    """A server path as this server shows it (plain text: md() it inside Markdown): as given (`make run`'s one local
    user), or in serve mode by its label (<root 1>/m, <models>/mha), a path under no labelled directory by its last
    name alone (a card's init_from may point anywhere)."""
    if not access.serving():
        return str(path)
    try:
        real = str(Path(path).resolve())   # (never expanded: '~user' is not looked up)
    except (OSError, RuntimeError, ValueError):
        real = str(path)
    return public(real)


def _cached(path: str):
    """The loaded model (models.checkpoint.LoadedModel) from the server's model cache, loaded in a slot if it is not
    there."""
    def fresh():
        problem = access.model_dir_problem(path)  # serve mode: the roots, checked again when the model is opened
        if problem:
            raise CheckpointError(f"{shown_path(path)}: {problem}")
        # a load holds twice its model for a moment: the cache first lets go of what this model would push past its
        # budget, and what earlier loads let go is handed back to the system (the idle trim, app/slots.py, may not
        # have come between two pages opened one after the other)
        MODELS.make_room(_expected_bytes(path))
        slots.give_back_memory()
        return load_for_app(path, access.max_weight_bytes())  # on the GPU when there is one, in float32 by default
    ready = MODELS.peek(path)
    if ready is not None:
        return ready
    with heavy.slot():   # the slot before the cache's per-model gate, always in this order: no two waits cross
        return MODELS.get(path, fresh)


def _expected_bytes(path: str) -> int:
    """The bytes a model's parameters will take where the app runs them, from its config alone (0 when the config
    cannot be read: the load then says why)."""
    from models.config import ConfigError, ModelConfig
    try:
        params = ModelConfig.load(Path(path) / "config.json").param_count()
    except (ConfigError, OSError, ValueError):
        return 0
    return params * torch.empty(0, dtype=getattr(torch, app_precision()["dtype"])).element_size()


class PageModel:
    """A loaded model as a page holds it: its path, config, tokenizer and card; the weights stay the model cache's
    alone (app/model_cache.py), and `.model` takes them from it each time it is read (loading them again, in a
    slot, if the cache has let them go).

    A page's globals outlive its run: Streamlit keeps them, through the page's fragments and the callables of its
    lazy download buttons, while the session is open and for server.disconnectedSessionTTL (120 s) after its tab
    closes. A page holding the model itself would keep every model it has shown, however far past the cache's
    budget (docs/deployment.md, "Memory")."""
    __slots__ = ("path", "tokenizer", "card", "config")

    def __init__(self, loaded):
        self.path, self.tokenizer, self.card, self.config = loaded.path, loaded.tokenizer, loaded.card, loaded.config

    @property
    def model(self):
        """The model itself: for the computation at hand, never to keep in a page's globals or session state."""
        return _cached(str(self.path)).model


def load(path: str) -> PageModel:
    """The model at `path`, opened through the server's model cache (checked, in a slot, when it is not there)."""
    return PageModel(_cached(path))


MAX_PATH = 1024  # characters of a path typed on the Models page


def path_problem(path: str) -> str | None:
    """Why a typed path cannot be a model directory's, before the filesystem sees it (None: it may be)."""
    if len(path) > MAX_PATH:
        return f"a path has at most {MAX_PATH:,} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "a path holds no control characters (NUL, newlines, tabs)"
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in PurePath(path).parts):
        return "each name in a path has at most 255 bytes"
    return None


def add_path() -> None:
    """Models page callback: remember a directory added by path (plain session state, not the widget's,
    which Streamlit forgets when another page runs); a path that cannot be one is refused with the reason."""
    path = st.session_state.get("extra_path", "").strip()
    problem = path_problem(path) or (access.outside_roots(path) if path else None)
    st.session_state["extra_path_problem"] = problem
    added = st.session_state.setdefault("added_paths", [])
    if path and problem is None and path not in added:
        added.append(path)


def model_paths() -> list[Path]:
    paths = find_model_dirs(models_root())
    known = {p.resolve() for p in paths}
    for extra in st.session_state.get("added_paths", []):
        try:
            p = Path(extra).expanduser()
            if p.resolve() not in known:
                paths.append(p)
        except (OSError, ValueError, RuntimeError):  # an unusable path lists nothing, on any page
            continue
    return paths


# how long a listing of model directories is reused: what it reads outside them (a delta's registry base arriving
# in the base cache) shows within this; a change inside them (a file written, added or removed) shows at once
LISTING_TTL_S = 60


def directory_stamp(paths) -> tuple:
    """What a listing of these model directories reads, cheaply: each directory's and each member file's
    (models.checkpoint.MEMBERS) size and modification time, None where there is none. A few stat calls a model,
    however large its config says it is."""
    def stat(p):
        try:
            s = os.stat(p)
            return s.st_size, s.st_mtime_ns
        except (OSError, ValueError):
            return None
    return tuple((str(d), stat(d), *(stat(Path(d) / m) for m in MEMBERS)) for d in paths)


@st.cache_data(max_entries=16, ttl=LISTING_TTL_S, show_spinner="Reading the models' configs and cards…")
def _listing(paths: tuple[str, ...], stamp: tuple, root: str) -> pd.DataFrame:
    """zoo_table of these directories, computed in a slot (it reads every config, card and weights header);
    reused while their files are unchanged (stamp) and the models folder is the same (root)."""
    with heavy.slot():
        return zoo_table([Path(p) for p in paths], root=Path(root))


def listing(paths: list[Path]) -> pd.DataFrame:
    """The Models page's table of these directories (analysis.zoo.zoo_table): configs, cards and weight headers
    only, no model loaded; read once while their files are unchanged, each reading counted by the server's queue."""
    return _listing(tuple(str(p) for p in paths), directory_stamp(paths), str(models_root()))


def pick_model(label: str = "Model", key: str = "model", where=st.sidebar, accept=None, default: str | None = None):
    """A model selector; returns the loaded model, or None (with the reason shown) if none can be used.
    accept(loaded) -> None or a reason string filters models a page cannot show."""
    paths = model_paths()
    if not paths:
        where.info(f"No models in {md(shown_path(models_root()))}: add a model directory by path on the Models page.")
        return None
    # id -> name (+ where, if names collide), plain text: a selectbox's options are not Markdown, the rest md() it
    labels = {i: access.public(n) for i, n in model_labels(paths).items()}
    ids = list(labels)
    wanted = st.query_params.get(key, default)  # ?model=ID (and ?model2=ID) open a page on that model
    index = ids.index(wanted) if wanted in ids else ids.index(default) if default in ids else 0
    chosen = where.selectbox(label, ids, index=index, key=key, format_func=labels.get)
    path, name = paths[ids.index(chosen)], labels[chosen]
    try:
        with st.spinner(f"Loading {md(name)}…"):
            loaded = load(str(path))
    except CheckpointError as e:
        where.error(md(public(str(e))))
        return None
    reason = accept(loaded) if accept else None
    if reason:
        st.info(f"{md(name)} ({loaded.config.mixer}): {reason}")
        return None
    return loaded


def text_input(key: str = "text") -> str | None:
    """Paste or upload; returns usable text, or None after showing why not. Shared by all pages."""
    mode = st.radio("Text", ["paste", "upload a .txt or .md file"], horizontal=True, key=f"{key}_mode")
    limit = access.max_chars()   # smaller in serve mode
    if mode == "paste":
        # max_chars: the browser stops typing and pasting there, before anything reaches the server
        text = st.text_area(f"Paste text (at most {limit:,} characters)",
                            value=st.session_state.get("shared_text", SAMPLE_TEXT)[:limit],
                            height=140, key=f"{key}_area", max_chars=limit)
        try:
            text = check_text(text, limit)
        except TextError as e:
            st.warning(md(str(e)))
            return None
        if len(text) == limit:  # the widget keeps the first `limit` characters of a longer paste
            st.warning(f"The text is at the {limit:,}-character limit: anything pasted beyond it was cut off.")
    else:
        upload = st.file_uploader("Upload", type=["txt", "md"], key=f"{key}_upload")
        if upload is None:
            st.info("Choose a UTF-8 .txt or .md file.")
            return None
        try:
            text = decode_upload(upload.name, upload.getvalue(), limit)
        except TextError as e:   # (it names the file as the browser sent it)
            st.error(md(str(e)))
            return None
    st.session_state["shared_text"] = text
    return text


def tokens_for(loaded, text: str):
    toks = tokenize(loaded.tokenizer, text)
    if not toks.ids:
        st.warning("The text produced no tokens.")
        return None
    return toks


def model_text_tokens(default: str | None = None, accept=None):
    """The usual page preamble: a model, a text, its tokens; stops the page (reason shown) if any is missing."""
    loaded = pick_model(default=default, accept=accept)
    text = text_input() if loaded is not None else None
    toks = tokens_for(loaded, text) if text is not None else None
    if toks is None:
        st.stop()
    return loaded, text, toks


def window_picker(toks, context: int, key: str, size: int | None = None):
    """For texts longer than what one view shows, a start-position slider instead of a frozen page."""
    size = min(size or context, context)
    if len(toks.ids) <= size:
        return toks, 0
    start = st.slider(f"Window start (text has {len(toks.ids)} tokens; showing {size})", 0, len(toks.ids) - size, 0,
                      key=key)
    return window(toks, start, size), start


def export_buttons(fig, table, name: str, model_dir=None, text: str | None = None, settings: dict | None = None,
                   key: str | None = None, precision: dict | None = None) -> None:
    """PNG / SVG / PDF rendered only when clicked, plus CSV of the data and the JSON sidecar. table may be a
    callable: a large one (every layer x head x cell of the maps) is then built only when CSV is clicked."""
    key = key or name
    cols = st.columns(5)
    for col, fmt in zip(cols, export.FORMATS):
        col.download_button(fmt.upper(), data=lambda fmt=fmt: export.figure_bytes(fig, fmt), file_name=f"{name}.{fmt}",
                            mime=export.FORMATS[fmt], on_click="ignore", key=f"dl_{key}_{fmt}")
    cols[3].download_button("CSV", data=lambda: export.csv_bytes(table() if callable(table) else table),
                            file_name=f"{name}.csv", mime="text/csv",
                            on_click="ignore", key=f"dl_{key}_csv")
    settings = dict(settings or {})   # (built when clicked: it hashes the weights, 0.4 s for SmolLM2's 538 MB)
    cols[4].download_button("JSON", data=lambda: sidecar_json(fig, name, model_dir, text, settings, precision),
                            file_name=f"{name}.json", mime="application/json", on_click="ignore", key=f"dl_{key}_json")


def sidecar_json(fig, name: str, model_dir=None, text: str | None = None, settings: dict | None = None,
                 precision: dict | None = None) -> str:
    """The JSON button's file. Server paths are hidden in what describes the figure, never inside its spec, whose
    arrays are base64 text a replace could corrupt (and which names no server path). precision: where and in what
    dtype the numbers were computed, when not by this server's models (a report's, as it recorded it)."""
    meta = export.sidecar(model_dir, text, settings or {}, name)
    meta = json.loads(public(json.dumps(meta, ensure_ascii=False)))
    meta["precision"] = precision or app_precision()   # where and in what dtype the models ran
    meta["plotly"] = json.loads(fig.to_json())   # (what `mixscope render` redraws)
    return json.dumps(meta, indent=2)


def dense_base_path(loaded) -> str | None:
    """The dense model a pruned (or adapted) one was tuned from (analysis.generation_figures.dense_base_dir, which
    the command line's generations read too)."""
    from analysis.generation_figures import dense_base_dir
    return dense_base_dir(loaded)
