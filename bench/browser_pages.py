"""Every app page as a user meets it: the real server (`make run`'s command) and headless Debian chromium, timed
until the page is idle and its figures are drawn (server work, transfer and the browser's drawing), on a real model
at a 1,000-token text and at the longest text a page accepts.

    python -m bench.browser_pages [--model assets/models/smollm2-135m] [--extra assets/models/smollm2-pruned-window]
        [--data data/smollm2] [--tokens 1000] [--threads 2] [--json FILE]

For a page that reads a text, the time runs from submitting the text (pasted into its box, Ctrl+Enter) to ready;
for the others (Models, Generate before generating, Heads, Extractors) from opening the page to ready. Ready: no
running indicator or spinner for a moment, and every plotly figure on the page drawn; the time is taken at the
last moment the page was still busy or drawing, as the page itself records it (the harness reads that record four
times a second rather than polling the page). Each page is opened fresh (a new browser session) after the models
were loaded once (timed apart), so shared caches hold the models, not the page's results; the two texts differ, so
the second reading computes anew. The Pruning page opens on the first --extra (a pruned model), and Compare puts
the dense model beside it. Do not run it beside training or tests: on 2 cores anything else running changes the times.
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from bench import cpu_model, proc_status_kb, report

CHROMIUM = "/usr/bin/chromium"
# running (Streamlit shows its icon and spinners only after 0.5 s), or elements marked stale, which happens as soon as
# a rerun is asked for: a rerun shorter than 0.5 s is still seen
BUSY = ("[data-testid='stStatusWidgetRunningIcon'], [data-testid='stSpinner'], [data-testid='stProgress'], "
        "[data-testid='stElementContainer'][data-stale='true']")
# page url -> does it read a text
PAGES = {"": False, "Generate": False, "Attention": True, "Heads": False, "Extractors": False, "Attribution": True,
         "Compare": True, "Pruning": True, "Corpus": False}   # (Corpus reads a report: docs/corpus_smollm2)
# Installed in every page before it loads: on each change to the page, notes whether it is busy (no title drawn
# yet, running, a spinner or a progress bar) or has a plotly figure not yet drawn, and the last moment it was
# (Date.now(): the host's clock, which the harness shares). The harness reads that four times a second: polling
# the page itself every 50 ms took a fifth of a core of the two, which slowed the server it was timing.
WATCH = """(() => {
  const busySel = %s;
  const state = {busy: false, last: 0, spells: 0};
  window.__mixscopeIdle = state;
  const check = () => {
    const undrawn = Array.from(document.querySelectorAll('.js-plotly-plot')).some(e => !e.querySelector('.main-svg'));
    // (before the app has drawn its title the page is still loading)
    const busy = undrawn || document.querySelector(busySel) !== null || document.querySelector('h1') === null;
    if (busy || state.busy) state.last = Date.now();   // (busy to idle: the moment it ended)
    if (busy && !state.busy) state.spells += 1;        // (so a harness can tell its request was taken up)
    state.busy = busy;
  };
  const start = () => {
    new MutationObserver(check).observe(document.documentElement,
                                        {subtree: true, childList: true, attributes: true, characterData: true});
    check();
  };
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start); else start();
})();""" % repr(BUSY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    """The server process's peak resident memory so far (Linux VmHWM)."""
    return proc_status_kb("VmHWM", pid) / 1024


def watched_page(browser, **kw):
    """A new page that keeps its own busy record (WATCH)."""
    page = browser.new_page(**kw)
    page.add_init_script(WATCH)
    return page


NEVER_TAKEN_S = 60


def spells(page) -> int:
    """How many times a watched page has turned busy so far (read before asking it for something)."""
    return page.evaluate("() => window.__mixscopeIdle.spells")


def idle_times(pages: list, starts: list[float], before: list[int] | None = None, timeout_s: float = 900,
               quiet_s: float = 2.0, poll_s: float = 0.25) -> list[float]:
    """For watched pages asked at `starts` (time.time()): seconds to the last moment each was busy or drawing, once
    none has been for quiet_s and each has been busy since (more spells than `before`, read before asking: a
    request the page never took up is not timed as instant). Every page is watched at once, each by its record."""
    before = before or [0] * len(pages)
    deadline = time.time() + timeout_s
    while True:
        states = [page.evaluate("() => window.__mixscopeIdle") for page in pages]
        now = time.time()
        last = [max(st["last"] / 1000, s) for st, s in zip(states, starts)]
        taken = all(st["spells"] > b for st, b in zip(states, before))
        if taken and not any(st["busy"] for st in states) and now - max(last) >= quiet_s:
            return [t - s for t, s in zip(last, starts)]
        if not taken and now - max(starts) > NEVER_TAKEN_S:
            raise TimeoutError(f"a page never turned busy within {NEVER_TAKEN_S} s of being asked: was the request "
                               "lost?")
        if now > deadline:
            raise TimeoutError(f"pages still busy after {timeout_s} s")
        time.sleep(poll_s)


def ready_after(page, start: float, before: int = 0, timeout_s: float = 600) -> float:
    """Seconds from `start` (time.time()) to a watched page's last busy or drawing moment, once it is idle (and has
    been busy more than `before` times)."""
    return idle_times([page], [start], [before], timeout_s)[0]


def start_server(zoo: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    from models import cli
    port = free_port()
    cmd, env = cli.app_command("127.0.0.1", port, serve=False)
    env.update(MIXSCOPE_MODELS=str(zoo), MIXSCOPE_NO_FETCH="1")
    if threads is not None:   # (None: the server's own default, split between its computation slots)
        env["MIXSCOPE_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, cwd=cli.ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if urllib.request.urlopen(url + "/_stcore/health", timeout=2).read() == b"ok":
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("streamlit did not start")


def time_page(browser, url: str, name: str, model: str, text: str | None, model2: str | None = None) -> dict:
    page = watched_page(browser, viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)[:200]))
    t0 = time.time()
    page.goto(f"{url}/{name}?model={model}" + (f"&model2={model2}" if model2 else ""))
    page.wait_for_selector("h1", timeout=600_000)
    seconds = ready_after(page, t0)
    if text is not None:
        box = page.get_by_role("textbox", name="Paste text")
        box.fill(text)
        before = spells(page)
        t0 = time.time()
        box.press("Control+Enter")
        seconds = ready_after(page, t0, before)
    figures = page.locator(".js-plotly-plot").count()
    problems = [t[:200] for t in page.locator("[data-testid='stException']").all_inner_texts()]
    page.close()
    return {"page": name or "Models", "seconds": seconds, "figures": figures, "errors": errors + problems}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.browser_pages", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--extra", action="append", default=[], help="more model directories (the first: Pruning's)")
    ap.add_argument("--data", default="data/smollm2")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from analysis.text import MAX_CHARS
    from bench.app_pages import sample_text
    from models.checkpoint import load_model_dir
    zoo = Path(tempfile.mkdtemp(prefix="browser-bench-"))
    for d in [args.model, *args.extra]:
        (zoo / Path(d).name).symlink_to(Path(d).resolve())
    name = Path(args.model).name
    tokenizer = load_model_dir(args.model).tokenizer
    short = sample_text(tokenizer, Path(args.data), args.tokens)
    texts = {f"{args.tokens} tokens": short}
    # taken after the short one: a page that reads a window from the start must not find it cached
    longest = sample_text(tokenizer, Path(args.data), 100_000)[len(short):][:MAX_CHARS]
    texts[f"{MAX_CHARS:,} characters (the longest accepted)"] = longest
    proc, url = start_server(zoo, args.threads)
    rows, load = [], {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            for m in [name, *[Path(d).name for d in args.extra]]:   # each model loaded once, timed apart
                page = watched_page(browser)
                t0 = time.time()
                page.goto(f"{url}/Generate?model={m}")
                page.wait_for_selector("h1", timeout=600_000)
                load[m] = ready_after(page, t0)
                page.close()
            for label, text in texts.items():
                n = len(tokenizer.encode(text).ids)
                for page_name, reads_text in PAGES.items():
                    pruned = Path(args.extra[0]).name if args.extra else None
                    model = pruned if page_name == "Pruning" and pruned else name
                    model2 = pruned if page_name == "Compare" else None   # (the dense model against the pruned one)
                    row = time_page(browser, url, page_name, model, text if reads_text else None, model2)
                    row.update(text=label, tokens=n if reads_text else None, model=model,
                               **({"model2": model2} if model2 else {}))
                    rows.append(row)
                    print(f"{label:<40} {row['page']:<12} {row['seconds']:6.2f} s  {row['figures']} figures  "
                          f"{'; '.join(row['errors'])[:120]}", file=sys.stderr)
            browser.close()
        peak = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    import torch
    result = {"benchmark": "browser_pages", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
              "browser": f"chromium ({CHROMIUM})", "model": args.model, "extra": args.extra, "load_s": load,
              "server_peak_mb": peak, "pages": rows,
              "note": "seconds: submitting the text (or opening the page) to idle with every figure drawn, "
                      "in headless chromium against the real server; models loaded first"}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
