"""Figure export: PNG, SVG and PDF (kaleido, driving Debian chromium), the data as CSV, and a JSON sidecar
saying exactly what was drawn. The app's buttons and the command line write the same files, and the command line
draws the windows the pages open on (analysis.views), so a text of up to 20,000 characters costs what the
app's first views cost. The Pruning, Generate and Corpus pages' figures come from the functions those pages call
(analysis.pruning_figures, generation_figures, corpus_figures), with the pages' settings as options.

    python -m analysis.export MODEL_DIR --text FILE --out DIR [--figures model,pruning,generate] [--report DIR]
    python -m analysis.export --report DIR --out DIR          (a corpus report's figures alone)
"""
from __future__ import annotations

import argparse
import atexit
import functools
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import sys
import threading
import warnings
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from analysis.bundle import Bundle
from models.files import spreadsheet_safe

FORMATS = {"png": "image/png", "svg": "image/svg+xml", "pdf": "application/pdf"}
PACKAGES = ("torch", "plotly", "kaleido", "pandas", "numpy", "captum", "streamlit", "tokenizers", "safetensors")
# The renderer's chromium reaches nothing: every request goes to a proxy on the loopback's discard port (refused),
# the loopback itself included (<-loopback> removes chromium's implicit bypass of localhost), and no host name or
# address resolves (the proxy's own neither), so not even a DNS query leaves. Chromium makes requests of its own
# (search engine, update and account services), as well as any a figure could name: all of them fail at once.
RENDERER_FLAGS = ("--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                  "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking")
log = logging.getLogger("analysis.export")
_server_lock = threading.Lock()
_server_started = False
_draw_lock = threading.Lock()   # (kaleido's sync server answers calls in order: one at a time gets its own image)


class ExportError(RuntimeError):
    pass


def _page():
    """kaleido's page for the renderer: plotly.js from the installed plotly package, no MathJax (kaleido's default
    loads it from a CDN on every drawing); refused if any script would come from elsewhere than a local file."""
    import plotly
    from kaleido import PageGenerator
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not plotly_js.is_file():
        raise ExportError(f"plotly.js is not where the plotly package keeps it ({plotly_js}): reinstall plotly")
    page = PageGenerator(plotly=plotly_js.as_uri(), mathjax=False)
    sources = re.findall(r'<script src="([^"]*)"', page.generate_index())
    if not sources or any(not src.startswith("file://") for src in sources):
        raise ExportError(f"the renderer's page would load {sources}: only local files are allowed")
    return page


def _offline_browser():
    """choreographer's Chromium with RENDERER_FLAGS at the end of its command line (a proxy named by
    CHOREO_PROXY_SERVER is not used: ours is the only one)."""
    from choreographer.browsers.chromium import Chromium

    class OfflineChromium(Chromium):
        def __init__(self, channel, path=None, **kwargs):
            kwargs.pop("proxy_server", None)
            super().__init__(channel, path, **kwargs)
            self.proxy_server = None

        def get_cli(self):
            return [*super().get_cli(), *RENDERER_FLAGS]

    return OfflineChromium


def _ensure_server() -> None:
    """One long-lived headless browser for all images (about 10x faster than one per image): the page without
    MathJax (_page), the browser without network (RENDERER_FLAGS). A kaleido server something else started (with
    kaleido's defaults) is stopped and ours started in its place."""
    global _server_started
    import kaleido
    server = getattr(kaleido, "_global_server", None)
    with _server_lock:
        running = server.is_running() if server is not None else _server_started
        if _server_started and running:
            return
        if running:
            kaleido.stop_sync_server(silence_warnings=True)
        kaleido.start_sync_server(page_generator=_page(), browser_cls=_offline_browser(), silence_warnings=True)
        if not _server_started:
            atexit.register(kaleido.stop_sync_server, silence_warnings=True)
        _server_started = True


def drawable_spec(fig: go.Figure | dict) -> dict:
    """The figure's spec as it goes to the renderer (plotly's to_dict, templates without their inert geo and map
    parts: analysis.plain.without_inert_template_parts); ExportError naming the place when it names a remote
    resource, markup or MathJax (analysis.plain.spec_refusal)."""
    from analysis.plain import spec_refusal, without_inert_template_parts
    spec = without_inert_template_parts(fig.to_dict() if isinstance(fig, go.Figure) else fig)
    why = spec_refusal(spec)
    if why:
        raise ExportError(f"the figure is not drawn: {why}")
    return spec


def _draw(spec: dict, fmt: str, scale: float) -> bytes:
    """The spec drawn by kaleido in the offline renderer (_ensure_server), unchecked: figure_bytes checks first."""
    import plotly.io as pio
    _ensure_server()
    with _draw_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pio.to_image(spec, format=fmt, scale=scale if fmt == "png" else 1.0, validate=False)


def figure_bytes(fig: go.Figure, fmt: str, scale: float = 2.0) -> bytes:
    """The figure drawn by kaleido; the same bytes every time for one figure (stable_svg, and traces given uids,
    which plotly.js would otherwise draw at random). A figure naming a remote resource (drawable_spec) is refused
    with ExportError; the renderer has no MathJax and no network either way."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    if any(t.uid is None for t in fig.data):
        fig = go.Figure(fig)   # (a copy: the caller's figure, perhaps cached and shown, is left as it was)
        for i, trace in enumerate(fig.data):
            if trace.uid is None:
                trace.uid = f"trace{i}"
    spec = drawable_spec(fig)
    try:
        data = _draw(spec, fmt, scale)
    except ExportError:
        raise
    except Exception as e:  # kaleido reports a missing browser in several exception types
        raise ExportError(f"could not render {fmt.upper()} with kaleido: {e}. Figure export needs a Chromium "
                          "browser: on Debian `apt-get install chromium` (make run / make test do this as root)") from e
    return stable_svg(data) if fmt == "svg" else data


def write_file(path: str | Path, data: bytes) -> Path:
    """data written to path through a temporary file created exclusively beside it (a random name, O_EXCL: never
    a file or link already there) and renamed into place, so a link planted at the temporary name or at path is
    never followed (one at path is replaced), and a failed write leaves no half file. Whether path may be
    replaced is the caller's to decide."""
    path = Path(path)
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.part")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        break
    else:
        raise ExportError(f"could not create a temporary file beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def stable_svg(svg: bytes) -> bytes:
    """plotly.js names an SVG's clip paths and defs after a random 6-hex id per drawing; naming them after the
    document's own hash instead makes one figure's SVG the same bytes every time it is drawn. Only the id where it
    names something (id="clip<id>...", url(#g<id>-...)) is replaced, never the same six characters in the data."""
    found = re.search(rb'<defs id="defs-([0-9a-f]{6})"', svg)
    if not found:
        return svg
    at = re.compile(rb"""((?:id="|url\(['"]?#)[A-Za-z-]*)""" + found.group(1))
    stable = hashlib.sha256(at.sub(rb"\g<1>", svg)).hexdigest()[:6].encode()
    return at.sub(rb"\g<1>" + stable, svg)   # (\g<1>: a hash starting with a digit is not a group number)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """The package's version, and the git commit this process's code came from with whether the checkout had
    changes then (None outside this checkout; models.files.code_version, which cards record, read once: the
    code a running server uses is what it started with)."""
    from models.files import code_version as commit_of_checkout
    try:
        version = metadata.version("mixscope")
    except metadata.PackageNotFoundError:
        version = None
    found = commit_of_checkout()   # "<sha>", "<sha>-dirty" or "unknown"
    commit = None if found == "unknown" else found.removesuffix("-dirty")
    return {"mixscope": version, "commit": commit,
            "uncommitted_changes": None if commit is None else found.endswith("-dirty")}


def base_of(model_dir: Path) -> dict | None:
    """A delta's base as its base.json pins it (models.delta.read_base_spec, which opening the model checks too;
    the weights' sha256 is checked whenever the base is opened); None for a model that is not a delta."""
    from models.checkpoint import CheckpointError
    from models.delta import BASE, read_base_spec
    if not (Path(model_dir) / BASE).is_file():
        return None
    try:
        spec = read_base_spec(Path(model_dir))
    except (CheckpointError, OSError):
        return None
    return {"source": spec["source"], "weights_sha256": spec["weights_sha256"]}


_HASHES: dict[tuple, str] = {}   # (path, size, mtime, ctime, inode) -> sha256
_hashes_lock = threading.Lock()    # (download buttons build sidecars in Streamlit's worker threads)


def weights_sha256(path: Path) -> str:
    """The file's sha256, remembered while its size, modification time and inode stay the same: a page's export
    buttons ask on every rerun (SmolLM2's 538 MB took 0.5 s a time, three times on the Heads page)."""
    from models.files import file_sha256
    st = path.stat()
    # ctime too: a copy that keeps size and mtime (cp -p, rsync --inplace) still changes it
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    with _hashes_lock:
        known = _HASHES.get(key)
    if known is None:
        known = file_sha256(path)
        after = path.stat()   # (changed while it was read: the hash is of neither version, so not remembered)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_ino) == key[1:]:
            with _hashes_lock:
                while len(_HASHES) >= 64:
                    _HASHES.pop(next(iter(_HASHES)))
                _HASHES[key] = known
    return known


def precision_of(model) -> dict:
    """Where and in what dtype a loaded model runs (its weights'), as the app's sidecar records it."""
    w = model.wte.weight
    return {"device": w.device.type, "dtype": str(w.dtype).removeprefix("torch.")}


def model_entry(model_dir: str | Path) -> dict:
    """One model as a sidecar names it: its directory, its weights' sha256 and, for a delta, its base as pinned."""
    weights = Path(model_dir) / "model.safetensors"
    return {"model_dir": str(model_dir),
            "checkpoint_sha256": weights_sha256(weights) if weights.is_file() else None,
            "base": base_of(Path(model_dir))}


def sidecar(model_dir: str | Path | dict | None, text: str | None, settings: dict, figure: str,
            fig: go.Figure | None = None, precision: dict | None = None) -> dict:
    """What was drawn: the model, its weights' hash (and a delta's base, as pinned), the text's hash, the settings,
    the code's version and commit, the packages' versions and, given the figure, its whole plotly spec under "plotly"
    (so `python -m analysis.render` redraws it without the model).

    model_dir may map each model a figure draws to its directory ({"A": dir_a, "B": dir_b}) or to its entry as a
    report recorded it (model_entry's fields): "models" then names every one, in that order, and the top-level model
    fields are the first's."""
    named = model_dir if isinstance(model_dir, dict) else ({"model": model_dir} if model_dir else {})
    # (a value that is already an entry, as a report recorded it when it ran, is kept as recorded)
    models = [{"name": str(name), **(d if isinstance(d, dict) else model_entry(d))} for name, d in named.items() if d]
    first = models[0] if models else {"model_dir": None, "checkpoint_sha256": None, "base": None}
    return {
        "figure": figure,
        "model_dir": first["model_dir"],
        "checkpoint_sha256": first["checkpoint_sha256"],
        "base": first["base"],   # a delta's: its base's pinned weights
        "models": models,
        "code": dict(code_version()),
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest() if text is not None else None,
        "settings": settings,
        **({"precision": precision} if precision is not None else {}),
        "versions": versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **({"plotly": json.loads(fig.to_json())} if fig is not None else {}),
    }


def csv_bytes(table: pd.DataFrame) -> bytes:
    """The table as CSV, every text cell (and column name) one a spreadsheet shows rather than evaluates. Lines
    end in CRLF (RFC 4180), which also makes the writer quote a cell holding a carriage return: with a bare LF
    such a cell is left unquoted and a spreadsheet splits it into a new row."""
    safe = table.rename(columns=lambda c: spreadsheet_safe(str(c)))
    for i, dtype in enumerate(safe.dtypes):
        if not (pd.api.types.is_numeric_dtype(dtype) or pd.api.types.is_bool_dtype(dtype)):
            safe.isetitem(i, safe.iloc[:, i].map(spreadsheet_safe))
    return safe.to_csv(index=False, lineterminator="\r\n").encode("utf-8")


def write_bundle(fig: go.Figure, table: pd.DataFrame, out_dir: str | Path, name: str, meta: dict,
                 formats=tuple(FORMATS)) -> list[Path]:
    """name.{png,svg,pdf,csv,json} in out_dir (the images in `formats` only; the CSV and the spec always), each
    written by write_file; files already there are replaced (export_model refuses them first unless --force)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:   # (each through write_file: no link planted at its name or a temporary one is followed)
        paths.append(write_file(out / f"{name}.{fmt}", figure_bytes(fig, fmt)))
    paths.append(write_file(out / f"{name}.csv", csv_bytes(table)))
    paths.append(write_file(out / f"{name}.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8")))
    return paths


def app_windows(tokens, context: int) -> dict:
    """The window of each page that analysis.export draws: the first one, as the page shows it before its slider moves
    (app.common.window_picker at 0), of the page's size in analysis.views."""
    from analysis import views
    return {"attention": views.first_window(tokens, views.ATTENTION_VIEW, context),
            "compare": views.first_window(tokens, views.COMPARE_VIEW, context),
            "attribution": views.first_window(tokens, views.ATTRIBUTION_VIEW, context)}


def check_memory(cfg, weights: int, groups=("model",), twin: bool = False, tokens: int | None = None,
                 twin_model: bool | None = None) -> None:
    """Refuse (ExportError), before the model runs, a model whose figures in `groups` (GROUPS) would not fit the
    memory budget: at the app's windows, the Pruning page's costliest method over its window, a generation of
    `tokens` in all (prompt and new; default the model's context) beside a second generation when `twin`, run on a
    second model of the same size (the dense base) when `twin_model` (default: when `twin`). The windows
    do not grow with the text (at most analysis.views.MAX_CHARS characters), so only the model's size can pass
    them."""
    from analysis import budgets, views
    from models.memory import RUNTIME_BYTES, forward_bytes, gb, memory_budget
    budget = memory_budget()
    advice = f"over the {gb(budget)} memory budget: raise MIXSCOPE_MEMORY_MB if this machine has the memory"
    if "model" in groups:
        need = budgets.export_bytes(cfg, weights)
        if need > budget:
            raise ExportError(f"this model's figures at the app's windows ({views.ATTENTION_VIEW}-token maps, "
                              f"{views.ATTRIBUTION_VIEW}-token attribution) need about {gb(need)} with its "
                              f"{gb(weights)} of weights, {advice}")
    # the maps' long table stays until every figure is written, beside the later groups' work
    kept = budgets.maps_table_bytes(cfg, views.view(views.ATTENTION_VIEW, cfg.context)) if "model" in groups else 0
    if "pruning" in groups:
        t = views.view(views.PRUNING_VIEW, cfg.context)
        need = weights + RUNTIME_BYTES + kept + budgets.method_run_bytes(cfg, t)
        if need > budget:
            raise ExportError(f"the Pruning page's figures over its {t}-token window need about {gb(need)} with the "
                              f"model's {gb(weights)} of weights, {advice} (or leave pruning out of --figures)")
    if "generate" in groups:
        t = min(cfg.context, tokens or cfg.context)
        runs = 2 if twin else 1
        cache = runs * 2 * cfg.n_layers * cfg.n_heads * cfg.d_head * 4 * t   # K and V of every token, every head
        held = weights * (2 if (twin if twin_model is None else twin_model) else 1)
        need = held + RUNTIME_BYTES + kept + forward_bytes(cfg, 1, t) + cache
        if need > budget:
            raise ExportError(f"a generation of {t} tokens (prompt and new) needs about {gb(need)} with "
                              f"{gb(held)} of weights{' (its dense twin beside it)' if twin else ''}, {advice} (or "
                              "pass --no-twin, or leave generate out of --figures)")


def model_figures(loaded, text: str) -> list[tuple[str, go.Figure, pd.DataFrame, dict]]:
    """Every figure the app draws for one model and one text, with the app's default settings: each page's first
    window (app_windows: the Attention and Compare pages' 128 tokens, the Attribution page's 256), so a text of any
    accepted length costs what the app's first view costs."""
    from analysis import attribution, heads, lags, maps, tokens
    from analysis.views import attribution_default
    from models.memory import weights_bytes
    from analysis.text import tokenize

    model, cfg = loaded.model, loaded.config
    toks = tokenize(loaded.tokenizer, text)
    views = app_windows(toks, cfg.context)
    if len(views["attention"].ids) < 2:
        raise ExportError("the text must have at least 2 tokens")
    check_memory(cfg, weights_bytes(model))
    out = []
    view = views["attention"]
    m, kind, title = maps.mixing_view(model, view.ids)   # (SHE: its lags' norms, as the Attention page)
    summary = {"summary": lags.default_summary(cfg.mixer)} if maps.is_extractor(model) else {}
    out.append(("maps_overview", maps.overview_figure(m, kind, f"{cfg.mixer}: {title}" if title else ""),
                maps.maps_table(m, view.labels), {"window_start": 0, "tokens": len(view.ids), **summary}))
    last = cfg.n_layers - 1
    out.append((f"map_layer{last}_head0",
                maps.map_figure(m[last, 0], view.labels, f"{cfg.mixer}: layer {last}, head 0"),
                maps.maps_table(m[last:last + 1, :1], view.labels, last, 0),
                {"layer": last, "head": 0, "window_start": 0}))
    del m   # (the tables hold what is written; the maps themselves are not needed again)
    view = views["compare"]
    lp = tokens.token_logprobs(model, view.ids)
    df = tokens.surprisal_table(view.labels, lp, cfg.mixer)
    out.append(("surprisal", tokens.surprisal_figure(df, f"{cfg.mixer}: per-token surprisal"), df,
                {"window_start": 0, "tokens": len(view.ids)}))
    view = views["attribution"]
    method, steps = attribution_default(sum(p.numel() for p in model.parameters()))
    position = len(view.ids) - 1
    scores, target, _ = attribution.attribute(model, view.ids, position, method=method, steps=steps)
    df = attribution.attribution_table(scores, view.labels)
    title = f"{method} for the next token {loaded.tokenizer.decode([target])!r}"
    out.append(("attribution_last", attribution.attribution_figure(df, title), df,
                {"method": method, "steps": steps, "position": position, "target": target, "window_start": 0}))
    for k, vec in heads.head_vectors(model).items():
        geo, var = heads.geometry_table(vec)
        out.append((f"heads_pca_{k}", heads.pca_figure(geo, var, f"{cfg.mixer}: {k} per head, PCA"), geo, {"kind": k}))
    for k, gram in heads.circuit_grams(model).items():   # the Heads page's default: unit-norm circuits, 2-D
        geo, var = heads.circuit_table(gram, cfg.n_heads, unit=True)
        out.append((f"heads_pca_{cfg.mixer}_{k}",
                    heads.pca_figure(geo, var, f"{cfg.mixer}: {k} circuits, unit norm, all layers"), geo,
                    {"kind": k, "dims": 2, "unit_norm": True}))
    if lags.extractor_layers(model):
        t = lags.lag_table(model)
        fig, value = lags.profile_view(t, cfg.mixer)   # (the Extractors page's first view)
        out.append((f"lags_profile_{cfg.mixer}", fig, t, {"value": value}))
    return out


def bundle_paths(out_dir: str | Path, name: str, formats=tuple(FORMATS)) -> list[Path]:
    return [Path(out_dir) / f"{name}.{ext}" for ext in (*formats, "csv", "json")]


def command_inputs(text_file: str | Path | None, out_dir: str | Path) -> tuple[str | None, Path]:
    """A command's --text (decoded as an upload is: at most analysis.views.MAX_CHARS characters; None when not
    given) and its --out directory, or ExportError saying which is wrong."""
    from analysis.text import decode_upload
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if text_file is None:
        return None, out
    path = Path(text_file)
    if not path.is_file():
        raise ExportError(f"--text {path} is not a file")
    return decode_upload(path.name, path.read_bytes()), out


def refuse_overwrite(paths: list[Path], out: Path, force: bool) -> None:
    """ExportError, before anything is written, when any of `paths` exists, unless force."""
    clash = [p for p in paths if p.exists()]
    if clash and not force:
        raise ExportError(f"{len(clash)} file(s) in {out} would be overwritten ({', '.join(p.name for p in clash[:4])}"
                          f"{' ...' if len(clash) > 4 else ''}): choose another --out, or pass --force")


# what the command draws, by page: --figures names some of them (default: all that apply)
GROUPS = {
    "model": "the Attention, Compare, Attribution, Heads and Extractors pages' first views (model_figures)",
    "pruning": "the Pruning page (analysis.pruning_figures), for a pruned or a dense softmax model",
    "generate": "the Generate page after one generation (analysis.generation_figures)",
    "corpus": "the Corpus page of a report of analysis.reports.corpus (--report; analysis.corpus_figures)",
}


def chosen_groups(figures, model_dir, report) -> tuple[list[str], bool]:
    """(the groups to draw, whether they were named) from --figures (a list, or None: every group that applies)."""
    if model_dir is None and report is None:
        raise ExportError("nothing to draw: give a model directory, a corpus report (--report), or both")
    if figures is None:
        model = [] if model_dir is None else ["model", "pruning", "generate"]
        return model + ([] if report is None else ["corpus"]), False
    unknown = [g for g in figures if g not in GROUPS]
    if unknown or not figures:
        raise ExportError(f"--figures {','.join(figures)}: choose from {', '.join(GROUPS)}")
    if "corpus" in figures and report is None:
        raise ExportError("--figures corpus draws a corpus report: name it with --report DIR")
    if model_dir is None and set(figures) - {"corpus"}:
        raise ExportError(f"--figures {','.join(figures)} draws a model's figures: give its directory")
    return [g for g in GROUPS if g in figures], True


def export_model(model_dir: str | Path | None, text_file: str | Path | None, out_dir: str | Path,
                 force: bool = False, device: str = "cpu", dtype: str = "float32", *, figures=None,
                 pruning: dict | None = None, generate: dict | None = None, report: str | Path | None = None,
                 corpus: dict | None = None, formats=tuple(FORMATS)) -> list[Path]:
    """The figures of every page in `figures` (GROUPS; default every one that applies: the model's pages, the
    Pruning page for a model it can show, the Generate page, and the Corpus page when `report` is given) as
    bundles in out_dir, the images in `formats`. pruning, generate and corpus: the keyword settings of
    pruning_figures.page_figures, generation_figures.page_figures and corpus_figures.page_figures (each the page's
    default when not given). Existing files are refused (nothing is written) unless force."""
    from analysis import corpus_figures, generation_figures, pruning_figures
    from analysis.budgets import config_of
    from analysis.corpus import read_report
    from models.memory import planned_weights
    from models.checkpoint import CheckpointError, load_model_dir

    groups, named = chosen_groups(figures, model_dir, report)
    text, out = command_inputs(text_file, out_dir)
    if text is None and {"model", "pruning"} & set(groups):
        raise ExportError("--text names the text the model's and the Pruning page's figures read (or --figures "
                          "generate,corpus, which need none)")
    pruning, generate, corpus = pruning or {}, generate or {}, corpus or {}
    drawn = []   # (bundle, its model unless it names its own, the text it hashes, precision)
    if model_dir is not None:
        try:
            cfg = config_of(model_dir)
        except CheckpointError:
            cfg = None   # (load_model_dir says what is wrong with the directory)
        if cfg is not None:   # before the weights are read (a twin: a pruned model's dense base, the same size)
            # two generations (the model's and its twin's, or the policy's and the model's unevicted), and a second
            # model only when the twin is the dense base
            evict = generate.get("evict")
            twin = generate.get("twin", True) and (bool(cfg.prune) or evict not in (None, "learned", "none"))
            second_model = twin and bool(cfg.prune) and evict in (None, "learned")
            # a byte-level BPE token is at least one byte: the prompt's UTF-8 bytes bound its tokens
            tokens = len(generate.get("prompt", generation_figures.PROMPT).encode("utf-8")) + 1 + generate.get(
                "max_new_tokens", generation_figures.NEW_TOKENS)
            check_memory(cfg, planned_weights(cfg), groups, twin, tokens, second_model)
    if model_dir is not None and set(groups) - {"corpus"}:   # (corpus figures read the report alone)
        loaded = load_model_dir(model_dir, device=device, dtype=dtype)
        precision = precision_of(loaded.model)
        if {"pruning", "generate"} & set(groups):
            from kernels import settings
            from models.pruning import policies
            policies.load_plugins(settings.get("MIXSCOPE_POLICIES"))   # the operator's own policies, as in the app
        why = pruning_figures.prunable(loaded) if "pruning" in groups else None
        if why and named:
            raise ExportError(f"no Pruning figures for {Path(model_dir).name}: {why}")
        if why:
            log.info("no Pruning figures: %s", why)
            groups.remove("pruning")
        if "model" in groups:
            drawn += [(Bundle(*figure), model_dir, text, precision) for figure in model_figures(loaded, text)]
        if "pruning" in groups:
            drawn += [(b, model_dir, text, precision) for b in pruning_figures.page_figures(loaded, text, **pruning)]
        if "generate" in groups:   # (its sidecars hash the prompt, as the page's do)
            prompt = generate.get("prompt", generation_figures.PROMPT)
            bundles = generation_figures.page_figures(loaded, device=device, dtype=dtype, **generate)
            drawn += [(b, model_dir, prompt, precision) for b in bundles]
    if "corpus" in groups:
        rep = read_report(Path(report))
        bundles = corpus_figures.page_figures(rep, str(report), **corpus)
        drawn += [(b, b.models, None, rep["manifest"].get("precision")) for b in bundles]
    refuse_overwrite([p for b, *_ in drawn for p in bundle_paths(out, b.name, formats)], out, force)
    return [p for b, models, hashed, precision in drawn
            for p in write_figures([b], out, models, hashed, precision, formats)]


def write_figures(bundles: list[Bundle], out_dir: str | Path, model_dir, text: str | None,
                  precision: dict | None = None, formats=tuple(FORMATS)) -> list[Path]:
    """A page's figures (Bundles: analysis.pruning_figures, generation_figures, corpus_figures) as its export buttons
    write them: NAME.{png,svg,pdf,csv,json} in out_dir, the images in `formats` only, each sidecar naming the
    bundle's own models or else model_dir, the text's hash (the prompt's, for a generation's figures) and where the
    model ran (precision_of). Files already there are replaced."""
    written = []
    for b in bundles:
        table = b.table() if callable(b.table) else b.table
        meta = sidecar(b.models or model_dir, text, b.settings, b.name, b.fig, precision)
        written += write_bundle(b.fig, table, out_dir, b.name, meta, formats)
    return written


def comma_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parser() -> argparse.ArgumentParser:
    from analysis.corpus import TOP_TOKENS
    from analysis.generation_figures import NEW_TOKENS, PROMPT
    from analysis.pruning_figures import SHARE
    from models.device import add_arguments as add_device_arguments
    from models.pruning.intervene import SITES

    ap = argparse.ArgumentParser(
        prog="python -m analysis.export",
        description="Write the app's figures for a model and a text, and a corpus report's, as the pages' export "
                    "buttons write them. Each page's settings default to what the page opens on.")
    ap.add_argument("model_dir", nargs="?", help="a model directory (leave it out to draw a --report alone)")
    ap.add_argument("--text", help="a UTF-8 .txt or .md file (the model's pages and the Pruning page read it)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true", help="overwrite files already in --out")
    ap.add_argument("--figures", type=comma_list, metavar="GROUP,...",
                    help="; ".join(f"{g}: {what}" for g, what in GROUPS.items())
                         + " (default: every one that applies)")
    ap.add_argument("--format", nargs="+", choices=tuple(FORMATS), default=list(FORMATS),
                    help="the images written beside each figure's CSV and JSON sidecar (default: all three)")
    add_device_arguments(ap, dtype="float32")
    pr = ap.add_argument_group("the Pruning page")
    pr.add_argument("--window-start", type=int, default=0, help="the window's first token, for a text longer than "
                    "the page's window (1,024 tokens, or the model's context)")
    pr.add_argument("--method", help="'learned' (a pruned model's rule, its default) or a policy's method id "
                                     "(streamingllm, tova, h2o:prompt, ...; a dense model's default: streamingllm)")
    budget = pr.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=int, help="a policy's tokens held per layer")
    budget.add_argument("--share", type=float, default=SHARE, help=f"... or share of the window (default {SHARE})")
    pr.add_argument("--prompt-end", type=int, help="a policy in prompt mode: the prompt ends after this token "
                                                   "(default three quarters of the window)")
    pr.add_argument("--layer", type=int, default=0, help="the layer of the why and what-if views (default 0)")
    pr.add_argument("--scores", action="store_true", help="the why view: the layer's interaction scores, a closest "
                                                          "call's terms, the soft rule")
    pr.add_argument("--scores-from", type=int, default=0, help="the scores drawn from this token (256 at a time)")
    pr.add_argument("--closest", type=int, default=0, help="the closest call split into its terms (0: the closest)")
    pr.add_argument("--alpha", type=float, default=1.0, help="the soft rule's alpha, 1-8 (default 1)")
    change = pr.add_mutually_exclusive_group()
    change.add_argument("--keep", type=int, metavar="J", help="what if: keep token J at every later query")
    change.add_argument("--drop", type=int, metavar="J", help="what if: drop token J (from query --at, default J+1)")
    change.add_argument("--patch", type=int, nargs="+", metavar="P", help="what if: patch the dense twin's states "
                                                                           "at these positions")
    pr.add_argument("--at", type=int, help="with --drop: the first query that no longer sees J")
    pr.add_argument("--onward", action="store_true", help="with --keep or --drop: every later layer too")
    pr.add_argument("--into", choices=("pruned", "dense"), default="pruned",
                    help="with --patch: the twin's states into the pruned model, or the pruned model's into the twin")
    pr.add_argument("--site", choices=tuple(SITES), default="residual",
                    help="with --patch: the layer's input, or its attention output (mixer)")
    pr.add_argument("--timeline", action="store_true", help="the training run's snapshots replayed on the window")
    pr.add_argument("--snapshot-step", type=int, help="with --timeline: the snapshot drawn (default the last)")
    pr.add_argument("--compare", metavar="POLICY", help="a policy beside the method at matched sparsity")
    pr.add_argument("--compare-prompt-end", type=int, help="with --compare, a policy in prompt mode beside a method "
                                                           "without a prompt: where its prompt ends")
    pr.add_argument("--every-policy", action="store_true", help="every policy at the method's sparsity")
    ge = ap.add_argument_group("the Generate page")
    ge.add_argument("--prompt", default=PROMPT, help=f"the prompt (default {PROMPT!r})")
    ge.add_argument("--max-new-tokens", type=int, default=NEW_TOKENS, help=f"default {NEW_TOKENS}")
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--top-k", type=int, default=40, help="0: off")
    ge.add_argument("--top-p", type=float, default=0.95)
    ge.add_argument("--greedy", action="store_true")
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--evict", metavar="POLICY", help="generate under an eviction policy (its method id)")
    ge.add_argument("--evict-budget", type=int, help="with --evict: tokens held (default 32, or the policy's least)")
    ge.add_argument("--no-twin", action="store_true", help="without the dense twin (a pruned model's dense base), or "
                                                           "without the same model with nothing evicted (--evict)")
    ge.add_argument("--step", type=int, help="the replay's step (default the last)")
    co = ap.add_argument_group("the Corpus page")
    co.add_argument("--report", help="a report directory of python -m analysis.reports.corpus")
    co.add_argument("--source", help="the source drawn (default the report's first)")
    co.add_argument("--run", help="the run drawn (default the sparsest learned rule)")
    co.add_argument("--beside", nargs="*", metavar="RUN", help="the runs beside it by layer and by position "
                                                               "(default the policies nearest its sparsity)")
    co.add_argument("--min-tokens", type=int, default=50, help="tokens a part of speech x layer cell needs")
    co.add_argument("--top", type=int, default=TOP_TOKENS, help="tokens in the token figure")
    return ap


def main(argv: list[str] | None = None) -> int:
    from analysis.text import TextError
    from models.checkpoint import CheckpointError

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    force = None if args.keep is None and args.drop is None else (
        (args.keep, True, None, args.onward) if args.keep is not None else (args.drop, False, args.at, args.onward))
    pruning = dict(start=args.window_start, method=args.method, budget=args.budget, share=args.share,
                   prompt=args.prompt_end, layer=args.layer, scores_view=args.scores, scores_from=args.scores_from,
                   closest=args.closest, alpha=args.alpha, force=force, patch=args.patch, into=args.into,
                   site=args.site, timeline_view=args.timeline, snapshot_step=args.snapshot_step,
                   compare=args.compare, compare_prompt_end=args.compare_prompt_end, every=args.every_policy)
    generate = dict(prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, greedy=args.greedy, seed=args.seed, evict=args.evict,
                    evict_budget=args.evict_budget, twin=not args.no_twin, step=args.step)
    corpus = dict(source=args.source, run=args.run, others=args.beside, min_tokens=args.min_tokens, top=args.top)
    try:
        if args.at is not None and args.drop is None:
            raise ExportError("--at is the first query that no longer sees --drop's token: give --drop J")
        written = export_model(args.model_dir, args.text, args.out, force=args.force, device=args.device,
                               dtype=args.dtype, figures=args.figures, pruning=pruning, generate=generate,
                               report=args.report, corpus=corpus, formats=tuple(args.format))
    except (CheckpointError, TextError, ExportError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
