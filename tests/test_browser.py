"""The app in a real browser: headless Debian chromium driven by Playwright, the server started by `make run`'s command.
Screenshots go to test-output/screenshots/."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from models.files import file_sha256

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "test-output" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
PAGES = ["", "Generate", "Attention", "Heads", "Extractors", "Attribution", "Compare", "Pruning"]

pytestmark = pytest.mark.browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    port = free_port()
    # `make run`'s own command (models.cli run: streamlit takes its process's place), without fetching bases
    cmd = [sys.executable, "-m", "models.cli", "run", "--no-fetch", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("streamlit did not start: " + proc.stdout.read().decode()[-2000:])
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


BUSY = "[data-testid='stStatusWidgetRunningIcon'], [data-testid='stSpinner']"
# pages that draw at least one figure with their defaults on the shipped zoo
CHARTS = {"": 1, "Attention": 2, "Heads": 3, "Extractors": 2, "Attribution": 1, "Compare": 3}


def wait_idle(page, timeout_s=180, quiet_s=1.5):
    """Streamlit's running indicator shows up only after a moment, so 'not running' means: no running
    icon or spinner for quiet_s seconds in a row."""
    page.wait_for_selector("[data-testid='stApp']", timeout=timeout_s * 1000)
    deadline, quiet_since = time.time() + timeout_s, None
    while time.time() < deadline:
        if page.locator(BUSY).count():
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.time()
        elif time.time() - quiet_since >= quiet_s:
            return
        page.wait_for_timeout(100)
    raise AssertionError(f"the app was still running after {timeout_s} s")


def open_selectbox(page, label):
    """Streamlit's selectbox is a combobox whose list opens from its "Open" button (a click on the input does not)."""
    box = page.get_by_role("combobox", name=label)
    box.scroll_into_view_if_needed(timeout=60_000)
    page.locator("[data-testid='stSelectbox']").filter(has=box).get_by_role("button", name="Open").click(timeout=60_000)


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders(server, browser, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{server}/{name}")
    wait_idle(page)
    page.wait_for_selector("h1", timeout=60_000)
    assert page.locator("[data-testid='stException']").count() == 0
    if CHARTS.get(name):  # the figures really drew (plotly's SVG is there)
        page.wait_for_function("n => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                               ".filter(e => e.querySelector('.main-svg')).length >= n", arg=CHARTS[name],
                               timeout=60_000)
    page.screenshot(path=str(SHOTS / f"{name or 'Models'}.png"), full_page=True)
    assert not errors, errors
    page.close()


def test_upload_text_and_export_a_figure(server, browser, tmp_path):
    SHOTS.mkdir(parents=True, exist_ok=True)
    upload = tmp_path / "upload.txt"
    upload.write_text("In the spring the council met by the river. They spoke of bread, of roads, and of the bridge.")
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page.goto(f"{server}/Attention")
    wait_idle(page)
    page.get_by_text("upload a .txt or .md file").click()
    wait_idle(page)
    page.locator("input[type='file']").set_input_files(str(upload))
    wait_idle(page)
    page.wait_for_selector("text=Overview", timeout=120_000)
    page.screenshot(path=str(SHOTS / "Attention_upload.png"), full_page=True)
    with page.expect_download(timeout=120_000) as dl:
        page.get_by_role("button", name="PNG", exact=True).first.click()
    path = tmp_path / dl.value.suggested_filename
    dl.value.save_as(path)
    assert dl.value.suggested_filename == "maps_overview.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
    with page.expect_download(timeout=120_000) as dl:   # the sidecar, built on the click
        page.get_by_role("button", name="JSON", exact=True).first.click()
    meta = json.loads(Path(dl.value.path()).read_text())
    assert meta["figure"] == "maps_overview" and meta["settings"]["window_start"] == 0
    assert meta["checkpoint_sha256"] == file_sha256(REPO / "assets" / "models" / "mha" / "model.safetensors")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9")
    page.locator("input[type='file']").set_input_files(str(bad))
    wait_idle(page)
    page.wait_for_selector("text=is not UTF-8 text", timeout=60_000)
    page.screenshot(path=str(SHOTS / "Attention_bad_upload.png"), full_page=True)
    page.close()


def test_four_sessions_at_once_each_see_their_own_numbers(server, browser):
    """Attribution and Compare on mha, Generate and Attention on mhe-mul (Compare's model B too), all started
    together on a fresh server (nothing cached yet): each finishes without an error and shows what its page
    computes alone."""
    from analysis import attribution, tokens
    from analysis.text import tokenize, window
    from app.common import SAMPLE_TEXT
    from analysis.zoo import models_root
    from models.checkpoint import load_model_dir
    from models.generate import generate

    mha, mhe = (load_model_dir(models_root() / n) for n in ("mha", "mhe-mul"))
    ids = window(tokenize(mha.tokenizer, SAMPLE_TEXT), 0, mha.config.context).ids
    _, _, logp = attribution.attribute(mha.model, ids, len(ids) - 1, None, "integrated gradients", 16)
    size = min(mha.config.context, mhe.config.context, 128)
    ppl_a = tokens.perplexity(tokens.token_logprobs(mha.model,
                                                    window(tokenize(mha.tokenizer, SAMPLE_TEXT), 0, size).ids))
    gen = generate(mhe.model, mhe.tokenizer.encode("The president said that").ids, 64, temperature=0.8, top_k=40,
                   top_p=0.95, seed=0)

    pages = {}
    for name, query in (("Attribution", ""), ("Compare", ""), ("Generate", "?model=mhe-mul"),
                        ("Attention", "?model=mhe-mul")):
        pages[name] = browser.new_page(viewport={"width": 1400, "height": 1000})
        pages[name].goto(f"{server}/{name}{query}")
    pages["Generate"].get_by_role("button", name="Generate").click(timeout=60_000)
    for page in pages.values():
        wait_idle(page)
    for name, page in pages.items():
        page.screenshot(path=str(SHOTS / f"concurrent_{name}.png"), full_page=True)
        assert page.locator("[data-testid='stException']").count() == 0, name
    assert f"after position {len(ids) - 1} (log p = {logp:.3f})" in pages["Attribution"].inner_text("body")
    assert f"{ppl_a:.2f}" in pages["Compare"].locator("[data-testid='stMetric']").first.inner_text()
    pages["Generate"].wait_for_selector("text=perplexity of own output", timeout=120_000)
    assert f"{gen.perplexity:.2f}" in pages["Generate"].locator("[data-testid='stMetric']").nth(3).inner_text()
    pages["Attention"].wait_for_selector("text=mhe-mul: layer 3, head 0", timeout=60_000)
    for page in pages.values():
        page.close()


def generating(browser, server, tokens: int):
    """A page on which the shipped pruned model is generating `tokens` new tokens, caught once its live strip shows."""
    page = browser.new_page(viewport={"width": 1400, "height": 1200}, accept_downloads=True)
    page.goto(f"{server}/Generate?model=mha-1024-pruned")
    wait_idle(page)
    box = page.get_by_label("New tokens")
    box.fill(str(tokens))
    box.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Generate").click(timeout=60_000)
    page.wait_for_selector("text=held (blue) and dropped (red), per layer", timeout=120_000)
    return page


def test_generate_shows_pruning_live_beside_the_dense_twin(server, browser, tmp_path):
    """The shipped pruned model generates long enough to be caught mid-way: the live strip and both columns are
    on screen then; afterwards the replay, the twin summary and the trace download."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = generating(browser, server, 700)
    page.wait_for_selector("text=dense twin", timeout=60_000)
    page.screenshot(path=str(SHOTS / "Generate_live_mid.png"), full_page=True)
    assert page.locator("[data-testid='stException']").count() == 0
    page.wait_for_selector("text=Replay: the cache at step s", timeout=300_000)
    wait_idle(page)
    page.wait_for_selector("text=cache held: saved", timeout=60_000)
    page.screenshot(path=str(SHOTS / "Generate_live_after.png"), full_page=True)
    with page.expect_download(timeout=120_000) as dl:
        page.get_by_role("button", name="trace.json", exact=True).click()
    path = tmp_path / dl.value.suggested_filename
    dl.value.save_as(path)
    import json
    got = json.loads(path.read_text())
    assert got["cache"] == "compacted" and len(got["steps"]) == 700 and got["drops"]
    page.close()


def test_stop_keeps_what_was_generated(server, browser):
    """Stop mid-way: the page shows the tokens generated so far (both models, equal lengths), marked stopped."""
    page = generating(browser, server, 900)
    page.get_by_role("button", name="Stop generating").click(timeout=60_000)
    page.wait_for_selector("text=Replay: the cache at step s", timeout=120_000)
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    assert page.get_by_text("stop: stopped").count() == 1
    same = page.locator("[data-testid='stMetric']", has_text="tokens before the texts part").inner_text()
    kept = int(same.split("/")[-1])
    assert 0 < kept < 900
    assert page.get_by_role("button", name="Stop generating").count() == 0
    page.close()


def test_pruning_page_puts_the_learned_rule_beside_a_policy(server, browser):
    """The learned rule of the shipped pruned model beside H2O at matched sparsity, picked in the browser."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    page.goto(f"{server}/Pruning?model=mha-1024-pruned")
    wait_idle(page)
    open_selectbox(page, "Compare with")
    page.get_by_role("option", name="H2O per KV group (heavy hitters + recent), step by step").click(timeout=60_000)
    page.wait_for_selector("text=Tokens they disagree on", timeout=180_000)
    wait_idle(page)
    assert page.locator("[data-testid='stException']").count() == 0
    body = page.inner_text("body")
    assert "learned pruning" in body and "H2O per KV group (heavy hitters + recent), step by step at " in body
    page.screenshot(path=str(SHOTS / "Pruning_compare.png"), full_page=True)
    page.close()
