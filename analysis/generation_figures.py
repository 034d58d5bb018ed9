"""The Generate page's figures, so that the page (app/views/1_Generate.py) and the command line (analysis.export) draw
the same ones: each an analysis.bundle.Bundle named as the page's export buttons name their files
(generation_strip, generation_cache, generation_latency_steps; generation_latency for a model that keeps every
token).

A generation's timings differ from one run to the next, so the figures are pure functions of a generation's
result: `figures` draws them from what `generate` (or the page's own streaming loop, through `collect`) returns,
and two callers given the same generation draw equal figures. `generate` runs a generation as the page does: the
model and its twin (the dense base, or the same model without the policy) taking turns, one token each, on the same
prompt with the same sampling settings.
"""
from __future__ import annotations

from itertools import zip_longest
from pathlib import Path

from analysis import live
from analysis.bundle import Bundle
from analysis.text import MAX_CHARS
from analysis.tokens import generation_table, latency_figure
from models import trace as traces
from models.generate import GenerationResult, stream

PROMPT = "The president said that"   # the page's prompt until one is typed
NEW_TOKENS = 16                      # the command's default (the page opens on 64: a figure needs few)


def sampling(temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, greedy: bool = False,
             seed: int = 0) -> dict:
    """The sampling settings as stream() takes them and the traces record them; the defaults are the page's."""
    return dict(temperature=float(temperature), top_k=int(top_k) or None, top_p=float(top_p), greedy=greedy,
                seed=int(seed))


def compactable(model) -> bool:
    """The model decodes through the compacted cache (a per-token cache it can drop from): attention, not an
    Extractor."""
    return model.blocks[0].mixer.decodes_compacted


def run_labels(cfg, policy, pruned: bool) -> tuple[str, str]:
    """How the page names the model's run and its twin's: under a policy, the policy's method id beside the same
    model with its own rule (a pruned one) or nothing evicted; a pruned model beside its dense twin."""
    first = policy.method if policy is not None else "pruned" if pruned else cfg.mixer
    twin = "dense twin" if policy is None else ("learned rule" if cfg.prune else "nothing evicted")
    return first, twin


def dense_base_dir(loaded) -> str | None:
    """The dense model a pruned (or adapted) one was tuned from: a delta's base, else the card's init_from."""
    from models.delta import base_dir_for
    from models.files import read_json
    if (loaded.path / "base.json").is_file():  # a delta: its dense base is the base it is stored over
        return str(base_dir_for(read_json(loaded.path / "base.json")["source"], loaded.path))
    return loaded.card.get("train", {}).get("init_from")


def load_twin(loaded, device: str = "cpu", dtype: str = "float32"):
    """(the dense base of a pruned model, loaded; None) or (None, why there is none here)."""
    from models.checkpoint import CheckpointError, load_model_dir
    from models.delta import unfetched_base
    path = dense_base_dir(loaded)
    if not path:
        return None, "no dense base is recorded on this model's card"
    if not Path(path).is_dir() or unfetched_base(loaded.path):
        return None, f"its dense base {path} is not on this machine (`mixscope fetch` fetches registry bases)"
    try:
        return load_model_dir(path, device=device, dtype=dtype), None
    except CheckpointError as e:
        return None, f"its dense base {path} does not load: {e}"


def collect(path, tokenizer, n_layers: int, ids, events, info: dict, prompt: str, settings: dict,
            stop_reason: str | None = None) -> tuple:
    """(model directory, models.generate.GenerationResult, trace) of one stream()'s events, as the page keeps them."""
    res = GenerationResult.collect(ids, events, info, n_layers, stop_reason)
    return path, res, traces.build(res, tokenizer, model_dir=str(path), prompt=prompt, settings=settings)


def generate(models: list[tuple[str, object]], prompt: str, max_new_tokens: int, policy=None,
             settings: dict | None = None) -> dict:
    """A generation as the page runs it: each (label, loaded model) in turn, one token each, on the same prompt;
    the policy (models.pruning.policies) applies to the first only. The result as the page keeps it: {"runs":
    [(path, result, trace)], "prompt", "labels", "model", "policy"}."""
    settings = sampling() if settings is None else settings
    first = models[0][1]
    if len(prompt) > MAX_CHARS:
        raise ValueError(f"the prompt has {len(prompt):,} characters; the limit is {MAX_CHARS:,}")
    ids = first.tokenizer.encode(prompt).ids
    if not prompt.strip() or not ids:
        raise ValueError("the prompt is empty: give a few words")
    if len(ids) >= first.config.context:
        raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {first.config.context}: "
                         "shorten it")
    if not 1 <= max_new_tokens <= first.config.context:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: 1-{first.config.context} (this model's context)")
    infos = [{} for _ in models]
    events = [[] for _ in models]
    gens = [stream(m.model, ids, int(max_new_tokens), info=info, policy=policy if i == 0 else None, **settings)
            for i, ((_, m), info) in enumerate(zip(models, infos))]
    try:
        for step in zip_longest(*gens):   # the models take turns: each event's latency is its model's own
            for got, e in zip(events, step):
                if e is not None:
                    got.append(e)
    finally:   # each generator ends now (its cache freed), not at garbage collection
        for g in gens:
            g.close()
    runs = [collect(m.path, m.tokenizer, m.config.n_layers, ids, ev, info, prompt, settings)
            for (_, m), ev, info in zip(models, events, infos)]
    return {"runs": runs, "prompt": prompt, "labels": [label for label, _ in models], "model": str(first.path),
            "policy": None if policy is None else (policy.method, policy.budget)}


def figures(saved: dict, tokenizer, mixer: str, step: int | None = None) -> list[Bundle]:
    """The page's figures of one generation (generate's result, or the page's own): through the compacted cache,
    what each layer holds after `step` (default the last) and every run's cache and latency per step; through the
    static cache, the latency per token."""
    (path, res, tr), *_ = saved["runs"]
    if res.cache_kind != "compacted":
        table = generation_table(res.events, tokenizer)
        return [Bundle("generation_latency", latency_figure(table, f"{mixer}: per-token latency"), table,
                       {"max_new_tokens": len(res.new_ids)})]
    last = len(res.events) - 1
    step = last if step is None else step
    if not 0 <= step <= last:
        raise ValueError(f"step {step}: the generation has steps 0-{last}")
    labels = live.labels_of(tr, tokenizer)
    strip = live.strip_figure(tr, step, labels, f"{path.name}: what each layer holds after step {step}")
    # each run by its label and model (under a policy both runs are the same model)
    named = {f"{label} · {p.name}": (p, t) for (p, _, t), label in zip(saved["runs"], saved["labels"])}
    all_traces = {name: t for name, (_, t) in named.items()}
    all_dirs = {name: p for name, (p, _) in named.items()}
    runs_settings = tr["settings"] | {"policy": saved.get("policy"),
                                      "runs": {name: t["settings"] for name, t in all_traces.items()}}
    return [Bundle("generation_strip", strip, lambda: live.steps_frame(tr), {"step": step, **tr["settings"]}),
            Bundle("generation_cache", live.cache_curve_figure(all_traces, "cache held per step"),
                   lambda: live.runs_frame(all_traces), runs_settings, all_dirs),
            Bundle("generation_latency_steps", live.latency_curve_figure(all_traces, "model latency per token"),
                   lambda: live.runs_frame(all_traces), runs_settings, all_dirs)]


def page_figures(loaded, *, prompt: str = PROMPT, max_new_tokens: int = NEW_TOKENS, evict: str | None = None,
                 evict_budget: int | None = None, twin: bool = True, step: int | None = None, device: str = "cpu",
                 dtype: str = "float32", **sampled) -> list[Bundle]:
    """The Generate page's figures after one generation of `max_new_tokens` after `prompt` with the page's settings
    (sampled: sampling()'s, the page's by default): evict, a policy's method id at evict_budget tokens (default the
    page's: 32, or the policy's least) for a softmax model; twin: beside the dense base (a pruned model) or the same
    model without the policy, as the page's checkbox; step: the replay's step (default the last). A twin that is not
    on this machine is left out, with the reason logged, as the page says it."""
    import logging

    from models.pruning import policies
    cfg = loaded.config
    settings = sampling(**sampled)
    policy = None
    if evict not in (None, "learned" if cfg.prune else "none"):
        if not (compactable(loaded.model) and cfg.pattern == "dense"):
            raise ValueError(f"--evict {evict}: eviction policies need a dense softmax model's per-token cache; "
                             f"{loaded.path.name} ({cfg.mixer}) keeps none to evict from")
        allowed = policies.methods(decoding=True, groups=loaded.model.blocks[0].mixer.n_groups)
        if evict not in allowed:
            raise ValueError(f"--evict {evict}: one of {', '.join(['learned' if cfg.prune else 'none', *allowed])}")
        low = policies.min_budget(evict)
        budget = max(low, 32) if evict_budget is None else evict_budget
        if not low <= budget <= cfg.context:
            raise ValueError(f"--evict-budget {budget}: {evict} holds {low}-{cfg.context} tokens")
        policy = policies.make(evict, budget)
    elif evict_budget is not None:
        raise ValueError("--evict-budget is a policy's: name one with --evict")
    pruned = compactable(loaded.model) and (bool(cfg.prune) or policy is not None)
    if step is not None and not pruned:
        raise ValueError("--step is the replay of a generation through the compacted cache (a pruned model, or a "
                         "policy): this one keeps every token")
    first, second = run_labels(cfg, policy, pruned)
    models = [(first, loaded)]
    if pruned and twin:
        other, why = (loaded, None) if policy is not None else load_twin(loaded, device, dtype)
        if other is None:
            logging.getLogger(__name__).warning("No dense twin: %s.", why)
        else:
            models.append((second, other))
    return figures(generate(models, prompt, max_new_tokens, policy, settings), loaded.tokenizer, cfg.mixer, step)
