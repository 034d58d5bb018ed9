"""Every app page on a real model and a long text: seconds to ready after the model is loaded, and the
process's peak memory (the app runs in-process under streamlit's AppTest, as the server would run it).

    python -m bench.app_pages [--model assets/models/smollm2-135m] [--tokens 1000] [--threads 2] [--json FILE]
        [--generate 64]   # also click Generate on each model: --generate new tokens after the text, greedy

The model loads where the app would put it (app.loading.load_for_app: a GPU when there is one); the result
says which device and dtype.

The text is the first documents of the test split (data/smollm2 or --data) cut to --tokens tokens of the
model's tokenizer. The model (and each --extra) is loaded once first (timed apart); each page then runs in a
fresh session with st.cache_data cleared, so its own computations are timed, not a cache hit. Do not run it
beside training or tests: on 2 cores anything else running changes the times.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

APP = Path(__file__).resolve().parent.parent / "app"
PAGES = ["Models.py", "views/1_Generate.py", "views/2_Attention.py", "views/3_Heads.py", "views/4_Extractors.py",
         "views/5_Attribution.py", "views/6_Compare.py", "views/7_Pruning.py"]


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def sample_text(tokenizer, data: Path, n_tokens: int) -> str:
    from models.data import load_documents
    text = ""
    for doc in load_documents(data, "test"):
        text += doc + "\n\n"
        enc = tokenizer.encode(text)
        if len(enc.ids) >= n_tokens:
            return text[:enc.offsets[n_tokens - 1][1]]
    return text


def generate_run(AppTest, name: str, text: str, n: int, new_tokens: int) -> dict:
    """The Generate page clicked twice: `new_tokens` greedy tokens after the text (alone, no twin beside it); the
    second click's page time and the generation's own latencies (prefill, median step), as the page shows them
    live. The first click's time is kept apart (first_click_s): on a GPU it also compiles the kernels' specialisations
    and captures the decode step's CUDA graph."""
    import statistics
    at = AppTest.from_file(str(APP / "views/1_Generate.py"), default_timeout=600)
    at.session_state["model"] = name
    at.run()
    at.text_area(key="gen_prompt").input(text)
    at.number_input(key="gen_n").set_value(new_tokens)
    at.checkbox(key="gen_greedy").set_value(True)
    if any(c.key == "gen_twin" for c in at.checkbox):
        at.checkbox(key="gen_twin").set_value(False)
    t0 = time.perf_counter()
    at.button(key="gen_go").click().run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    at.button(key="gen_go").click().run()
    row = {"page": f"views/1_Generate.py (generate, {name})", "seconds": time.perf_counter() - t0,
           "first_click_s": first,
           "peak_mb": peak_mb(), "prompt_tokens": n,
           "errors": [str(e.value)[:200] for e in at.exception] + [str(e.value)[:200] for e in at.error]}
    saved = at.session_state["gen_result"] if "gen_result" in at.session_state else None
    if saved:
        res = saved["runs"][0][1]
        lat = [e.latency_s for e in res.events]
        row.update(new_tokens=len(res.new_ids), prefill_ms=lat[0] * 1e3, tokens_per_s=res.decode_tokens_per_s,
                   step_ms_median=statistics.median(lat[1:]) * 1e3 if len(lat) > 1 else None,
                   cache=res.cache_kind, graphs=res.graphs, kernel_paths=res.kernel_paths, notes=res.notes)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.app_pages", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/models/smollm2-135m")
    ap.add_argument("--extra", action="append", default=[], help="more model directories beside it (a pruned one)")
    ap.add_argument("--data", default="data/smollm2")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--generate", type=int, default=0,
                    help="also run the Generate page's generation on each model: this many new tokens after the text")
    args = ap.parse_args(argv)
    os.environ["MIXSCOPE_THREADS"] = str(args.threads)
    zoo = Path(tempfile.mkdtemp(prefix="app-bench-"))
    for d in [args.model, *args.extra]:
        (zoo / Path(d).name).symlink_to(Path(d).resolve())
    os.environ["MIXSCOPE_MODELS"] = str(zoo)

    import streamlit as st
    import torch
    from streamlit.testing.v1 import AppTest

    from app.common import load
    from bench import cpu_model
    name = Path(args.model).name
    t0 = time.perf_counter()
    loaded = load(str(zoo / name))
    load_s = time.perf_counter() - t0
    extra_load_s = {}
    for d in args.extra:  # loaded before the pages too: they time their own work, not a load
        t1 = time.perf_counter()
        load(str(zoo / Path(d).name))
        extra_load_s[Path(d).name] = time.perf_counter() - t1
    text = sample_text(loaded.tokenizer, Path(args.data), args.tokens)
    n = len(loaded.tokenizer.encode(text).ids)
    print(f"{name}: loaded in {load_s:.1f} s (peak {peak_mb():.0f} MB so far); text of {n} tokens", file=sys.stderr)
    rows = []
    # the Pruning page again with its heavier views: the learned rule beside TOVA, then every policy at once
    runs = [(p, p, {}) for p in PAGES] + [
        ("views/7_Pruning.py (beside TOVA)", "views/7_Pruning.py", {"prune_compare": "tova"}),
        ("views/7_Pruning.py (every policy)", "views/7_Pruning.py", {"prune_all": True})]
    for label, page, state in runs:
        st.cache_data.clear()
        at = AppTest.from_file(str(APP / page), default_timeout=600)
        at.session_state["shared_text"] = text
        at.session_state["model"] = name
        if page.endswith("Pruning.py") and args.extra:
            at.session_state["model"] = Path(args.extra[0]).name
        for key, value in state.items():
            at.session_state[key] = value
        t0 = time.perf_counter()
        at.run()
        secs = time.perf_counter() - t0
        problems = [str(e.value)[:200] for e in at.exception] + [str(e.value)[:200] for e in at.error]
        infos = [str(i.value)[:120] for i in at.info]
        rows.append({"page": label, "seconds": secs, "peak_mb": peak_mb(), "errors": problems, "infos": infos})
        print(f"{label:<36} {secs:6.2f} s  peak {peak_mb():6.0f} MB  {'; '.join(problems)[:160]}", file=sys.stderr)
    for d in [args.model, *args.extra] if args.generate else []:
        rows.append(generate_run(AppTest, Path(d).name, text, n, args.generate))
        print(f"{rows[-1]['page']:<36} {rows[-1]['seconds']:6.2f} s  {rows[-1].get('tokens_per_s', 0):.1f} tokens/s "
              f"({rows[-1].get('cache')} cache, graphs {rows[-1].get('graphs')})", file=sys.stderr)
    weight = loaded.model.wte.weight
    result = {"benchmark": "app_pages", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "extra": args.extra, "tokens": n, "threads": args.threads,
              "torch": torch.__version__, "cpu": cpu_model(), "load_s": load_s, "extra_load_s": extra_load_s,
              "device": str(weight.device), "dtype": str(weight.dtype),
              "gpu": torch.cuda.get_device_name(weight.device) if weight.is_cuda else None,
              "pages": rows, "peak_mb": peak_mb(),
              "note": "seconds: one fresh session per page, st.cache_data cleared, the model already loaded"}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
