"""A bounded load test on the loopback: browser sessions across pages started together on one server, each checked
against what the same session computes alone.

    python -m bench.load_sessions [--model assets/models/smollm2-135m] [--pruned assets/models/smollm2-pruned-window]
        [--data data/smollm2] [--tokens 1000] [--json FILE]

Eight sessions, two SmolLM2 models in use: Generate (greedy, 32 new tokens) on each model, Pruning (the learned
rule; StreamingLLM on the dense model), Compare (dense against pruned) and Attribution (integrated gradients),
each on one of two different texts. First each session runs alone, one after another, on a fresh server; then a
second fresh server (nothing cached) takes all eight at once. A session's numbers are its page's metrics and
its attribution line, leaving out timings (tokens/s, latencies), which differ by design. Reported: errors, each
session's time to idle, the wall time, the server's peak resident memory, and whether every number matched.
Do not run it beside anything else: on 2 cores the times are the machine's.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench import cpu_model, report
from bench.browser_pages import (CHROMIUM, idle_times, peak_rss_mb, ready_after, spells, start_server,
                                  watched_page)

TIMED = re.compile(r"tokens/s|ms|latency|time", re.I)


def sessions(dense: str, pruned: str) -> list[dict]:
    """(page, query, text a or b, what to do after it opens)."""
    return [
        {"page": "Generate", "query": f"model={dense}", "generate": True},
        {"page": "Generate", "query": f"model={pruned}", "generate": True},
        {"page": "Pruning", "query": f"model={pruned}", "text": "a"},
        {"page": "Pruning", "query": f"model={dense}", "text": "b"},
        {"page": "Compare", "query": f"model={dense}&model2={pruned}", "text": "a"},
        {"page": "Compare", "query": f"model={dense}&model2={pruned}", "text": "b"},
        {"page": "Attribution", "query": f"model={dense}", "text": "a"},
        {"page": "Attribution", "query": f"model={pruned}", "text": "b"},
    ]


def open_session(browser, url: str, s: dict, texts: dict) -> dict:
    """Opens the page and submits its input; returns the live page and when its work was asked for."""
    page = watched_page(browser, viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)[:200]))
    page.goto(f"{url}/{s['page']}?{s['query']}")
    page.wait_for_selector("h1", timeout=600_000)
    ready_after(page, time.time())
    if s.get("generate"):
        box = page.get_by_label("New tokens")
        box.fill("32")
        box.press("Enter")
        page.get_by_text("Greedy").click()
        ready_after(page, time.time())
    elif s.get("text"):
        page.get_by_role("textbox", name="Paste text").fill(texts[s["text"]])
    return {"page": page, "errors": errors}


def go(live: dict, s: dict) -> tuple[float, int]:
    """Asks the page for its work; returns when (taken before asking) and its busy spells until then."""
    page = live["page"]
    before, t0 = spells(page), time.time()
    if s.get("generate"):
        page.get_by_role("button", name="Generate").click(timeout=60_000)
    else:
        page.get_by_role("textbox", name="Paste text").press("Control+Enter")
    return t0, before


def numbers(page) -> dict:
    """The page's metrics (label -> value) without timings, and an attribution's log p line."""
    out = {}
    for m in page.locator("[data-testid='stMetric']").all():
        label = m.locator("[data-testid='stMetricLabel']").inner_text().strip()
        if not TIMED.search(label):
            out[label] = m.locator("[data-testid='stMetricValue']").inner_text().strip()
    found = re.search(r"after position \d+ \(log p = -?[0-9.]+\)", page.inner_text("body"))
    if found:
        out["attribution"] = found.group(0)
    return out


def finish(live: dict, s: dict, seconds: float) -> dict:
    page = live["page"]
    if s.get("generate"):
        page.wait_for_selector("text=perplexity of output", timeout=600_000)
    problems = [t[:200] for t in page.locator("[data-testid='stException']").all_inner_texts()]
    return {"page": s["page"], "query": s["query"], "text": s.get("text"), "seconds": seconds,
            "numbers": numbers(page), "errors": live["errors"] + problems}


def run(zoo: Path, plan: list[dict], texts: dict, together: bool) -> tuple[list[dict], float, float]:
    from playwright.sync_api import sync_playwright
    proc, url = start_server(zoo, threads=None)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            rows, t_all = [], time.perf_counter()
            if together:
                lives = [open_session(browser, url, s, texts) for s in plan]   # every page open and filled in
                t_all = time.perf_counter()
                asked = [go(live, s) for live, s in zip(lives, plan)]       # then all asked at once
                seconds = idle_times([live["page"] for live in lives], [t for t, _ in asked], [n for _, n in asked])
                rows = [finish(live, s, t) for live, s, t in zip(lives, plan, seconds)]
            else:
                for s in plan:
                    live = open_session(browser, url, s, texts)
                    t0, before = go(live, s)
                    rows.append(finish(live, s, idle_times([live["page"]], [t0], [before])[0]))
                    live["page"].close()
            wall = time.perf_counter() - t_all
            browser.close()
        return rows, wall, peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.load_sessions", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--pruned", default="assets/models/smollm2-pruned-window")
    ap.add_argument("--data", default="data/smollm2")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from app import slots
    from bench.app_pages import sample_text
    from models.checkpoint import load_model_dir
    zoo = Path(tempfile.mkdtemp(prefix="load-bench-"))
    for d in (args.model, args.pruned):
        (zoo / Path(d).name).symlink_to(Path(d).resolve())
    tokenizer = load_model_dir(args.model).tokenizer
    a = sample_text(tokenizer, Path(args.data), args.tokens)
    b = sample_text(tokenizer, Path(args.data), 3 * args.tokens)[len(a):]   # the next stretch: another text
    plan = sessions(Path(args.model).name, Path(args.pruned).name)
    alone, wall_alone, peak_alone = run(zoo, plan, {"a": a, "b": b}, together=False)
    both, wall, peak = run(zoo, plan, {"a": a, "b": b}, together=True)
    for r, lone in zip(both, alone):
        r["alone_seconds"], r["same_numbers"] = lone["seconds"], r["numbers"] == lone["numbers"]
        print(f"{r['page']:<12} {r['query']:<60} alone {lone['seconds']:6.1f} s, together {r['seconds']:6.1f} s, "
              f"same numbers: {r['same_numbers']} {r['errors'] or ''}", file=sys.stderr)
    server = slots.from_env()
    result = {"benchmark": "load_sessions", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "torch": torch.__version__, "browser": f"chromium ({CHROMIUM})",
              "models": [args.model, args.pruned], "tokens": args.tokens, "sessions": len(plan),
              "slots": server.size, "queue": server.queue, "threads_per_slot": slots.threads_per_slot(server),
              "wall_s_together": wall, "wall_s_alone_in_turn": wall_alone, "server_peak_mb": peak,
              "server_peak_mb_alone": peak_alone, "errors": sum(len(r["errors"]) for r in both + alone),
              "all_numbers_equal": all(r["same_numbers"] for r in both), "sessions_detail": both,
              "note": "seconds: from asking (Generate clicked, or the text submitted) to the page idle; together: all "
                      "eight asked within a moment on a fresh server; alone: the same sessions one after another"}
    return report(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
