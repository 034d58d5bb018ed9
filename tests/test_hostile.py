"""The red team's crawl, end to end: serve mode (`mixscope serve`) in a real server and a real chromium, with models
named in Markdown, HTML and image syntax that point at a local listener and a root full of hostile model
directories. It keeps the promises of docs/deployment.md that only the whole app can keep at once: no request
reaches the listener (from the browser or from the server's figure renderer), no page breaks, no server path or
file outside the root is named, each hostile directory is answered with a message naming its file and field, each
page answers within PAGE_S.

Also here: the model listing and the pages' planning take a computation slot, and the model cache's budget bounds
the server's resident memory (docs/deployment.md, "Memory").

Fixtures and helpers come from the other red-team files (tests/test_hostile_markup.py, _models.py, _network.py)."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from app.plain import plain
from models.files import file_sha256
from tests.test_browser import wait_idle
from tests.test_hostile_markup import browser, free_port, hostile, hostile_text, start, stop  # noqa: F401
from tests.test_hostile_models import CARD_CASES, CONFIG_CASES, fine_tune, tok, write_json  # noqa: F401
from tests.test_hostile_network import listener  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
PAGES = ["Generate", "Attention", "Heads", "Extractors", "Attribution", "Compare", "Pruning", "Corpus"]
PAGE_S = 10.0      # each page answers within this (wait_idle's quiet spell not counted)
QUIET_S = 1.0      # no running indicator for this long: the page has answered
BROKE = "This app has encountered an error"   # Streamlit's generic exception box (serve mode hides the details)


def case(cases: list, name: str) -> dict:
    """The edit of one named case of tests/test_hostile_models.py's generator."""
    return next(edit for case_id, edit, _ in cases if case_id == name)


def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(REPO / "assets" / "models" / "mha" / "tokenizer.json"))   # (pages tokenize text)


def build_models(folder: Path, port: int) -> dict[str, Path]:
    """The models folder: a pruned MHA named in Markdown, HTML and image syntax pointing at the listener, and a
    dense one named plainly (Compare needs two)."""
    import torch

    from models.checkpoint import save_model_dir
    from models.config import ModelConfig
    from models.transformer import DecoderLM
    zoo_tok = tokenizer()
    cfg = dict(mixer="mha", vocab_size=8192, context=64, d_model=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    pruned = DecoderLM(ModelConfig(**cfg, prune=True, prune_r=8))
    for b in pruned.blocks:
        with torch.no_grad():
            b.mixer.pruning.beta.fill_(0.0)   # some drops
    return {"hostile": save_model_dir(folder / hostile(port, "a-pruned"), pruned, zoo_tok,
                                      {"test_perplexity": 50.0, "train": {"init_from": None}}),
            "dense": save_model_dir(folder / "dense", DecoderLM(ModelConfig(**cfg)), zoo_tok,
                                    {"test_perplexity": 60.0})}


def build_root(root: Path, outside: Path, small_tok) -> dict[str, tuple[Path, list[str]]]:
    """Hostile directories inside the root, each with what its message must name: a delta whose base's weights
    link to a file outside the root, a 20,000-layer config, a string where a number belongs, a card whose init_from
    is a number, a config that is not JSON."""
    from models.checkpoint import save_delta_dir, save_model_dir
    from models.transformer import DecoderLM
    from tests.helpers import randomize, tiny_config
    model = DecoderLM(tiny_config("mha", vocab_size=300))
    randomize(model, seed=1)
    base = save_model_dir(root / "base", model, small_tok, {"train": {"init_from": None}})
    delta = save_delta_dir(root / "delta", fine_tune(base), small_tok, "../base")
    secret = outside / "secret-weights.safetensors"   # the base's real weights, moved out of the root
    (base / "model.safetensors").rename(secret)
    os.symlink(secret, base / "model.safetensors")
    out = {"delta": (delta, ["base.json"])}
    for name, file, edit, field in (("deep", "config.json", case(CONFIG_CASES, "20000 layers"), "n_layers"),
                                    ("stringy", "config.json", case(CONFIG_CASES, "string layers"), "n_layers"),
                                    ("card", "card.json", case(CARD_CASES, "init_from a number"), "train.init_from")):
        d = save_model_dir(root / name, DecoderLM(tiny_config("mha", vocab_size=300)), small_tok,
                           {"train": {"init_from": None}})
        write_json(d / file, json.loads((d / file).read_text()) | edit)
        out[name] = (d, [file, field])
    d = save_model_dir(root / "malformed", DecoderLM(tiny_config("mha", vocab_size=300)), small_tok)
    (d / "config.json").write_text('{"mixer": "mha", "n_layers": ')
    out["malformed"] = (d, ["config.json", "not valid JSON"])
    return out


class Crawl:
    """One chromium tab (one session: the paths added on the Models page stay) on the server at `url`; each visit
    is timed and checked: no exception box, no path of the test's directories in any element's text, nothing of
    the file outside the root (its name, its hash) anywhere in the page."""

    def __init__(self, page, url: str, places: list[str], secrets: list[str], listener_port: int):
        self.page, self.url, self.places, self.secrets = page, url, places, secrets
        self.listener = f"127.0.0.1:{listener_port}"
        self.took: dict[str, float] = {}

    def settle(self, what: str, started: float) -> None:
        wait_idle(self.page, timeout_s=120, quiet_s=QUIET_S)
        self.took[what] = time.time() - started - QUIET_S
        self.check(what)

    def check(self, what: str) -> None:
        page = self.page
        body = page.inner_text("body")
        assert page.locator("[data-testid='stException']").count() == 0 and BROKE not in body, what
        assert not [p for p in self.places if p in body], (what, [p for p in self.places if p in body])
        html = page.content()
        assert not [s for s in self.secrets if s in html or s in body], what
        # nothing the page made (an image, a link, a style: Markdown's or plotly's) names the listener, and no
        # text was escaped twice (none of the hostile strings holds an '&')
        made = page.locator(f"[src*='{self.listener}'], [href*='{self.listener}'], [style*='{self.listener}']")
        assert made.count() == 0, (what, made.first.evaluate("e => e.outerHTML"))
        assert not re.search(r"&(lt|gt|amp|#\d+);", body), (what, re.findall(r".{40}&(?:lt|gt|amp|#\d+);", body))

    def open(self, title: str) -> None:
        """A page of the app, from the sidebar's navigation (the session goes on)."""
        started = time.time()
        self.page.locator(f"a[data-testid='stSidebarNavLink'][href$='/{title}']").click(timeout=30_000)
        self.page.wait_for_selector(f"h1:has-text('{title}')", timeout=60_000)
        self.settle(title, started)

    def add_path(self, path: Path) -> None:
        started = time.time()
        box = self.page.get_by_label("Add a model directory by path")
        box.fill(str(path))
        box.press("Enter")
        self.settle(f"add {path.name}", started)

    def pick(self, label: str) -> str:
        """Choose a model in the sidebar's picker: the sidebar's text after the page has answered."""
        from tests.test_browser import open_selectbox
        started = time.time()
        open_selectbox(self.page, "Model")
        self.page.get_by_role("option", name=label, exact=True).click(timeout=30_000)
        self.settle(f"pick {label}", started)
        return self.page.inner_text("[data-testid='stSidebar']")


def crawl_pages(crawl: Crawl, port: int, hostile_dirs: dict) -> None:
    """Every page, hostile text pasted where a page reads text, a generation on the hostile model, one PNG drawn by
    the server's renderer; then each hostile directory picked on the Attention page."""
    page = crawl.page
    for title in PAGES:
        crawl.open(title)
        if title == "Generate":
            started = time.time()
            page.get_by_label("Prompt", exact=True).fill(hostile_text(port)[:200])
            page.get_by_role("button", name="Generate").click(timeout=30_000)
            crawl.settle("a generation", started)
        if title == "Attention":
            started = time.time()
            area = page.locator("textarea").first
            area.fill(hostile_text(port))
            area.press("Control+Enter")
            crawl.settle("hostile text", started)
        if title == "Attribution":   # the renderer draws hostile tokens and target (PNG: kaleido's chromium)
            with page.expect_download(timeout=120_000) as dl:
                page.get_by_role("button", name="PNG", exact=True).first.click()
            assert Path(dl.value.path()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    crawl.open("Attention")
    for name, (path, needs) in hostile_dirs.items():
        sidebar = crawl.pick(path.name)
        said = [line for line in sidebar.splitlines() if line.startswith(f"<root 1>/{path.name}")]
        assert said and all(n in said[0] for n in needs), (name, needs, sidebar[-600:])


@pytest.mark.browser
@pytest.mark.full
def test_the_red_teams_crawl_in_serve_mode(browser, listener, tok, tmp_path):   # noqa: F811
    """`mixscope serve` with a root of hostile directories, each added by path on the Models page, then every page
    in one session: no request reaches the listener, no page breaks or names a path of the test's directories or
    anything of the file outside the root, each hostile directory is answered with its file and field (on the Models
    page and when picked), each page answers within PAGE_S."""
    models = build_models(tmp_path / "models", listener.port)
    (tmp_path / "outside").mkdir()
    hostile_dirs = build_root(tmp_path / "root", tmp_path / "outside", tok)
    secret = tmp_path / "outside" / "secret-weights.safetensors"
    port = free_port()
    proc = start([sys.executable, "-m", "models.cli", "serve", "--no-fetch", "--host", "127.0.0.1", "--port",
                  str(port)], port, {"MIXSCOPE_MODELS": str(tmp_path / "models"),
                                     "MIXSCOPE_PATH_ROOTS": str(tmp_path / "root"),
                                     "MIXSCOPE_CORPUS_DIRS": str(tmp_path / "no-reports")})
    try:
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")   # (streamlit took the process's place)
        assert argv[argv.index(b"--client.showErrorDetails") + 1] == b"none", argv
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        crawl = Crawl(page, f"http://127.0.0.1:{port}", sorted({str(tmp_path), os.path.realpath(tmp_path)}),
                      [secret.name, file_sha256(secret)], listener.port)
        started = time.time()
        page.goto(crawl.url)
        page.wait_for_selector("h1:has-text('mixscope')", timeout=60_000)
        crawl.settle("Models", started)
        for path, _ in hostile_dirs.values():
            crawl.add_path(path)
        shown = page.inner_text("body")
        for name, (path, needs) in hostile_dirs.items():   # the Models page lists each as a message
            said = [line for line in shown.splitlines() if line.startswith(f"{path.name}: <root 1>/{path.name}")]
            assert said and all(n in said[0] for n in needs), (name, needs, shown[-3000:])
        assert re.search(r"\b2 model\(s\) found", shown), shown[:2000]
        assert models["hostile"].name in plain(shown)   # its name, as text
        crawl_pages(crawl, listener.port, hostile_dirs)
        page.wait_for_timeout(1000)
        page.close()
    finally:
        stop(proc)
    assert listener.requests == [], listener.requests
    slow = {what: round(s, 1) for what, s in crawl.took.items() if s > PAGE_S}
    assert not slow, slow


# ---- what reads every model directory takes a computation slot -------------------------------------------------------

@pytest.mark.full
def test_listing_models_and_planning_a_page_read_the_directories_in_a_slot_once(tmp_path, monkeypatch):
    """The Models page's table and the Pruning page's choice of model read every config and card: each read happens
    while a computation slot is held (the server's queue counts it), and a second visit reads nothing (cached while
    the directories are unchanged)."""
    from streamlit.testing.v1 import AppTest

    from analysis import zoo
    from app import heavy
    from app.slots import Slots
    from models import delta
    build_models(tmp_path / "models", 9)
    monkeypatch.setenv("MIXSCOPE_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("MIXSCOPE_CORPUS_DIRS", str(tmp_path / "no-reports"))
    slots = Slots(1, queue=4)
    monkeypatch.setattr(heavy, "SLOTS", slots)
    reads = []   # (what read, computations running then)
    for module, name in ((zoo, "describe"), (delta, "unfetched_base")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            reads.append((_name, slots.state()[0]))
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    for page in ("Models.py", "views/7_Pruning.py"):
        for visit in (1, 2):
            before = len(reads)
            at = AppTest.from_file(str(REPO / "app" / page), default_timeout=300).run()
            assert not at.exception, (page, at.exception)
            what = {"Models.py": "describe", "views/7_Pruning.py": "unfetched_base"}[page]
            new = [held for name, held in reads[before:] if name == what]
            assert (len(new) >= 1) if visit == 1 else (new == []), (page, visit, reads[before:])
            assert all(held >= 1 for held in new), (page, visit, reads[before:])


# ---- the model cache's budget bounds the server's memory -------------------------------------------------------------

BUDGET_MB = 300    # MIXSCOPE_MODEL_CACHE_MB here: two of the three models below fit in it, not three
SLACK_MB = 150     # what the pages compute and cache beside the models, and the allocator's (docs/deployment.md)


def memory_mb(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak so far (VmHWM), in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def big_models(folder: Path, n: int = 3) -> list[str]:
    """n random MHA models of 113 MiB of float32 weights each, on the zoo's tokenizer."""
    import torch

    from models.checkpoint import save_model_dir
    from models.config import ModelConfig
    from models.transformer import DecoderLM
    zoo_tok = tokenizer()
    for i in range(n):
        torch.manual_seed(i)
        cfg = ModelConfig(mixer="mha", vocab_size=8192, context=256, d_model=512, n_layers=8, n_heads=8)
        save_model_dir(folder / f"big{i}", DecoderLM(cfg), zoo_tok, {"test_perplexity": 100.0})
    return [f"big{i}" for i in range(n)]


@pytest.mark.browser
@pytest.mark.full
def test_the_model_cache_budget_bounds_the_servers_memory(browser, tmp_path):   # noqa: F811
    """Three models of 113 MiB opened in turn by the Attention page, each by its address (a new session), under a
    300 MiB budget: the server's resident memory stays within what it held before any model (the runtime), the
    budget, and one more model (a load holds twice its model for a moment) with SLACK_MB beside them; once the pages
    have answered, within the runtime, the budget and SLACK_MB (a page that kept the models it has shown would
    pass both by a model or more)."""
    names = big_models(tmp_path / "models")
    model_mb = (tmp_path / "models" / names[0] / "model.safetensors").stat().st_size / 2**20
    port = free_port()
    proc = start([sys.executable, "-m", "models.cli", "run", "--no-fetch", "--host", "127.0.0.1", "--port", str(port)],
                 port, {"MIXSCOPE_MODELS": str(tmp_path / "models"), "MIXSCOPE_MODEL_CACHE_MB": str(BUDGET_MB)})
    seen = []
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        wait_idle(page, quiet_s=QUIET_S)
        runtime = memory_mb(proc.pid)["VmRSS"]
        for name in [*names, names[0]]:
            page.goto(f"http://127.0.0.1:{port}/Attention?model={name}")
            wait_idle(page, quiet_s=QUIET_S)
            page.wait_for_function("() => document.querySelector('.js-plotly-plot .main-svg')", timeout=120_000)
            seen.append((name, memory_mb(proc.pid)))
        page.close()
    finally:
        stop(proc)
    peak, last = seen[-1][1]["VmHWM"], seen[-1][1]["VmRSS"]
    assert peak - runtime <= BUDGET_MB + model_mb + SLACK_MB, (runtime, seen)
    assert last - runtime <= BUDGET_MB + SLACK_MB, (runtime, seen)


def test_the_model_cache_makes_room_before_a_load():
    """make_room lets the least recently used go until what is to come fits (all of them if it alone does not)."""
    from app.model_cache import ModelCache
    cache = ModelCache(100, 60, size=lambda v: v)
    for key, size in (("a", 40), ("b", 40)):
        cache.get(key, lambda size=size: size)
    cache.make_room(30)
    assert cache.keys() == ["b"]
    cache.make_room(0)
    assert cache.keys() == ["b"]
    cache.make_room(500)
    assert cache.keys() == []
