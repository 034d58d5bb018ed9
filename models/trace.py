"""A generation trace: every step's token, model latency and cache size, and every drop (which layer let go
of which token, and which token made it). The Generate page and `python -m models.generate --trace FILE`
write the same three files: FILE.csv (one row per step), FILE.drops.csv (one row per drop) and FILE.json
(all of it, with the model, prompt and settings).

Replay: after step s the cache holds prompt + s tokens; layer l no longer holds the tokens whose drop was
triggered at or before the last position fed in (prompt + s - 1).
"""
from __future__ import annotations

import csv
import io
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from models.files import spreadsheet_safe

STEP_COLUMNS = ("step", "token_id", "token", "logprob", "running_perplexity", "model_ms", "tokens_seen",
                "held_bytes", "alloc_bytes", "dense_bytes", "held_tokens", "dropped_this_step")


def build(result, tokenizer, *, model_dir: str | None = None, prompt: str | None = None,
          settings: dict | None = None) -> dict:
    """The trace of a models.generate.GenerationResult as plain JSON-able data."""
    steps, total = [], 0.0
    for e in result.events:
        total += e.logprob
        steps.append({
            "step": e.index, "token_id": e.token_id, "token": tokenizer.decode([e.token_id]), "logprob": e.logprob,
            "running_perplexity": math.exp(-total / (e.index + 1)), "model_ms": e.latency_s * 1000,
            "tokens_seen": len(result.prompt_ids) + e.index, "held_bytes": e.held_bytes, "alloc_bytes": e.alloc_bytes,
            "dense_bytes": e.dense_bytes, "held_tokens": sum(e.live), "dropped_this_step": len(e.drops),
            "live_per_layer": list(e.live),
        })
    return {
        "kind": "mixscope generation trace", "model_dir": model_dir, "prompt": prompt,
        "prompt_ids": list(result.prompt_ids), "new_ids": list(result.new_ids),
        "text": tokenizer.decode(list(result.new_ids)), "n_layers": result.n_layers, "cache": result.cache_kind,
        "stop_reason": result.stop_reason, "notes": list(result.notes), "prefill_ms": result.prefill_s * 1000,
        "tokens_per_s": result.decode_tokens_per_s, "perplexity": result.perplexity,
        "kernel_paths": dict(result.kernel_paths), "settings": settings or {},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "steps": steps,
        "drops": [{"layer": l, "position": p, "trigger": t, "step": max(0, t - len(result.prompt_ids) + 1)}
                  for l, p, t in result.drops],
    }


def held_at(trace: dict, step: int) -> list[list[bool]]:
    """Replay: per layer, for every token seen by `step`, whether the cache still held it then."""
    n_prompt = len(trace["prompt_ids"])
    seen = n_prompt + step
    held = [[True] * seen for _ in range(trace["n_layers"])]
    for d in trace["drops"]:
        if d["trigger"] <= seen - 1:
            held[d["layer"]][d["position"]] = False
    return held


def steps_csv(trace: dict) -> str:
    out = io.StringIO()
    layers = [f"live_L{i}" for i in range(trace["n_layers"])]
    w = csv.writer(out)
    w.writerow([*STEP_COLUMNS, *layers])
    for s in trace["steps"]:
        w.writerow([spreadsheet_safe(s[c]) for c in STEP_COLUMNS] + s["live_per_layer"])
    return out.getvalue()


def drops_csv(trace: dict) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["layer", "position", "trigger", "step"])
    for d in trace["drops"]:
        w.writerow([d["layer"], d["position"], d["trigger"], d["step"]])
    return out.getvalue()


def files(trace: dict) -> dict[str, str]:
    """suffix -> contents: ".csv", ".drops.csv", ".json"."""
    return {".csv": steps_csv(trace), ".drops.csv": drops_csv(trace), ".json": json.dumps(trace, indent=1) + "\n"}


def paths_for(stem: str | Path) -> list[Path]:
    stem = Path(stem)
    if stem.suffix in (".json", ".csv"):  # FILE.json or FILE.csv name the same trace as FILE
        stem = stem.with_suffix("")
    return [Path(f"{stem}{suffix}") for suffix in (".csv", ".drops.csv", ".json")]


def write(trace: dict, stem: str | Path, force: bool = False) -> list[Path]:
    """Write the three files; refuses (writing nothing) when any exists, unless force."""
    paths = paths_for(stem)
    clash = [p for p in paths if p.exists()]
    if clash and not force:
        raise FileExistsError(f"{', '.join(map(str, clash))} already exist(s): choose another --trace name, "
                              "or pass --force")
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for p, (suffix, text) in zip(paths, files(trace).items()):
        p.write_text(text, encoding="utf-8")
    return paths
