"""Autoregressive generation with the static decode cache: prefill once, then one position per step.

Sampling: greedy, temperature, top-k, top-p, seed, stop tokens. A per-token callback receives a
TokenEvent (id, probability, latency) so a UI can stream tokens and timings.
"""
from __future__ import annotations

import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from models import graphs as graphs_module
from models.decode import Decoder, pick_state
from models.scoring import target_logprobs
from models.transformer import evaluating

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    index: int          # position among the new tokens, from 0
    token_id: int
    logprob: float      # log p(token) under the model itself (temperature 1, no filtering)
    latency_s: float    # model time for this token: its forward (the prefill, for the first) and sampling,
                        # synchronised on a GPU; the caller's own work (drawing a page) is not in it
    held_bytes: int = 0     # decode state of the tokens the cache still holds after that forward
    alloc_bytes: int = 0    # decode state allocated then (the compacted cache's buffers at their capacity)
    dense_bytes: int = 0    # what a dense cache of the same model would hold: every token seen, K and V
    live: tuple[float, ...] = ()  # per layer: tokens held after that forward (per-group policy: mean over groups)
    drops: tuple[tuple[int, int, int], ...] = ()  # (layer, position, position of the token that dropped it)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    new_ids: list[int]
    events: list[TokenEvent]
    stop_reason: str    # "max_new_tokens" | "stop_token" | "callback" (| "stopped": the app, a user's Stop)
    notes: list[str] = field(default_factory=list)
    prefill_s: float = 0.0
    cache_bytes: int = 0
    kernel_paths: dict[str, str] = field(default_factory=dict)  # op -> "triton" | "reference", this call only
    cache_kind: str = "static"   # "static" (preallocated, gpt-fast style) | "compacted" (context pruning)
    n_layers: int = 0
    graphs: bool = False         # decode steps replayed from a CUDA graph (models.graphs)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids

    @property
    def decode_tokens_per_s(self) -> float:
        """Steady-state rate: tokens after the first over the time they took."""
        rest = sum(e.latency_s for e in self.events[1:])
        return (len(self.events) - 1) / rest if rest > 0 else float("nan")

    @property
    def perplexity(self) -> float:
        """Perplexity of the generated tokens under the model."""
        if not self.events:
            return float("nan")
        return math.exp(-sum(e.logprob for e in self.events) / len(self.events))

    @classmethod
    def collect(cls, prompt_ids: Sequence[int], events: list[TokenEvent], info: dict, n_layers: int,
                stop_reason: str | None = None) -> "GenerationResult":
        """The result of a stream() run from its events and the `info` it filled."""
        return cls([int(t) for t in prompt_ids], [e.token_id for e in events], events,
                   stop_reason or info["stop_reason"], info["notes"], info["prefill_s"],
                   events[-1].alloc_bytes if events else 0, info["kernel_paths"], info["cache_kind"], n_layers,
                   info.get("graphs", False))

    @property
    def drops(self) -> list[tuple[int, int, int]]:
        """Every drop while generating, in order: (layer, position, position of the token that dropped it)."""
        return [d for e in self.events for d in e.drops]


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask (to -inf) all but the top-k tokens and the smallest set whose probability reaches top_p."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p   # mass before this token already reaches p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def make_sampler(device, *, greedy: bool, temperature: float, top_k: int | None, top_p: float | None,
                 seed: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Checks the sampling settings and returns logits [..., V] -> token ids [...]."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else secrets.randbits(63))  # never reseeds torch's global generator

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if greedy or temperature == 0:
            return logits.argmax(-1)
        probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=gen).reshape(logits.shape[:-1])
    return sample


def _sync(device: torch.device) -> None:
    """Wait for this thread's stream only: a device-wide sync could end another session's graph capture."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def layer_bytes_per_token(model) -> tuple[list[int], list[int]]:
    """Per layer: decode-state bytes one token costs in this model, and in its dense twin (no K_int)."""
    pairs = [b.mixer.cache_bytes_per_token(model.wte.weight.dtype) for b in model.blocks]
    return [own for own, _ in pairs], [dense for _, dense in pairs]


@torch.inference_mode()
def stream(model, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None, greedy: bool = False, seed: int | None = None,
           stop_ids: Sequence[int] = (), cache: str = "auto", info: dict | None = None,
           policy=None, graphs: bool | None = None) -> Iterator[TokenEvent]:
    """Yield one TokenEvent per new token (one sequence), as soon as it is sampled.

    cache: "static" (preallocated, every token kept), "compacted" (context pruning's cache: dropped tokens
    are freed; events carry the drops), or "auto" (compacted for a pruned attention model). Each event's
    latency is the model's own time, so a caller may draw between events without changing it; two streams
    may be interleaved. `info`, when given, is filled with notes, the prefill time, kernel paths, the cache
    kind and the stop reason as they become known. policy: a heuristic eviction policy
    (models.pruning.policies) over the compacted cache, for any softmax model without a fixed pattern (a pruned
    one with its learned rule off). graphs: replay each decode step from a CUDA graph (models.graphs); None
    (default): wherever it can (a CUDA device, dense attention, no eviction policy; either cache, the compacted
    one then never shrinking its buffers); info["graphs"] says.
    """
    prompt = _checked_prompt(model, prompt_ids, max_new_tokens)
    kind = "compacted" if policy is not None else pick_state(model, cache)  # a policy evicts from compacted slots
    device = model.wte.weight.device
    sample = make_sampler(device, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    info = {} if info is None else info
    info.update(notes=[], kernel_paths={}, cache_kind=kind, stop_reason="max_new_tokens", prefill_s=0.0)
    max_new_tokens = _clamped(max_new_tokens, prompt, model.config.context, info["notes"])
    stops = set(int(s) for s in stop_ids)
    own, dense = layer_bytes_per_token(model)
    if policy is not None:  # a learned rule is off under a policy: no K_int is kept
        own = dense

    if graphs is None:
        graphs = device.type == "cuda" and graphs_module.refusal(model, kind, policy) is None
    info["graphs"] = bool(graphs)

    with evaluating(model):
        # the compacted cache grows by doubling and shrinks as it drops; the static one holds everything
        dec = Decoder(model, 1, kind, policy, capacity=len(prompt) + (16 if kind == "compacted" else max_new_tokens),
                      graphs=graphs)
        try:
            t0 = time.perf_counter()
            logits = dec.prefill([prompt])[0]
            _sync(device)
            info["prefill_s"] = time.perf_counter() - t0
            for i in range(max_new_tokens):
                token = sample(logits)
                tok = int(token)
                latency = time.perf_counter() - t0
                yield _event(dec, info, own, dense, i, tok, float(target_logprobs(logits[None], token[None])[0]),
                             latency)
                if tok in stops:
                    info["stop_reason"] = "stop_token"
                    return
                if i + 1 == max_new_tokens:
                    return
                t0 = time.perf_counter()
                logits = dec.step(token.view(1))[0]
                _sync(device)
        finally:
            if dec.graph_failed:
                info["graphs"] = False
                info["notes"].append(f"the CUDA graph could not be captured; decoded eagerly ({dec.graph_failed})")
            dec.close()


def _checked_prompt(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The prompt's ids as ints; refused when it is empty or fills the context window, or when no token is asked."""
    context = model.config.context
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("empty prompt: generation needs at least one prompt token")
    if len(prompt) >= context:
        raise ValueError(f"prompt has {len(prompt)} tokens but the context window is {context}: "
                         f"shorten it to at most {context - 1} tokens")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    return prompt


def _clamped(max_new_tokens: int, prompt: list[int], context: int, notes: list[str]) -> int:
    """max_new_tokens, or the room the prompt leaves in the context window when that is less (said in notes)."""
    room = context - len(prompt)
    if max_new_tokens > room:
        notes.append(f"max_new_tokens {max_new_tokens} clamped to {room}: prompt ({len(prompt)} tokens) "
                     f"+ new tokens must fit the context window of {context}")
        log.warning(notes[-1])
        max_new_tokens = room
    return max_new_tokens


def _event(dec: Decoder, info: dict, own: list[int], dense: list[int], i: int, token: int, logprob: float,
           latency: float) -> TokenEvent:
    """After the latency was taken: reading the drops and counts is reporting, not the model's time."""
    info["kernel_paths"].update(dec.kernel_paths)
    live = dec.live()
    drops = tuple((layer, p, t) for layer, _, p, t in dec.new_drops())
    return TokenEvent(i, token, logprob, latency, held_bytes=int(round(sum(n * b for n, b in zip(live, own)))),
                      alloc_bytes=dec.allocated_bytes(), dense_bytes=dec.lengths[0] * sum(dense), live=live,
                      drops=drops)


def generate(model, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
             seed: int | None = None, stop_ids: Sequence[int] = (), cache: str = "auto", policy=None,
             graphs: bool | None = None,
             callback: Callable[[TokenEvent], bool | None] | None = None) -> GenerationResult:
    """Generate up to max_new_tokens after prompt_ids (one sequence); see stream() for the cache choice.

    max_new_tokens is clamped so that prompt + new tokens fit the context window; the result's
    notes say so. A callback returning False stops generation after that token.
    """
    info: dict = {}
    events, stop_reason = [], None
    for event in stream(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        greedy=greedy, seed=seed, stop_ids=stop_ids, cache=cache, info=info, policy=policy,
                        graphs=graphs):
        events.append(event)
        if callback is not None and callback(event) is False:
            stop_reason = "callback"
            break
    return GenerationResult.collect(prompt_ids, events, info, len(model.blocks), stop_reason)


@dataclass
class BatchGenerationResult:
    new_ids: list[list[int]]
    step_latency_s: list[float]       # one entry per model call (the prefill first)
    cache_bytes: list[int]            # allocated decode state after each call
    live_tokens: list[float]          # tokens held over all layers after each call
    drops: list[torch.Tensor]         # per layer: rows (batch row, position dropped, trigger position)
    stop_reasons: list[str]

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.step_latency_s[1:]
        rows = len(self.new_ids)
        return rows * len(steps) / sum(steps) if steps and sum(steps) > 0 else float("nan")


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, *, greedy: bool = True,
                   temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                   seed: int | None = None, stop_ids: Sequence[int] = ()) -> BatchGenerationResult:
    """Generate for several prompts of any lengths at once over the compacted cache (context pruning's
    data structure; for a dense model it is a ragged dense cache). Rows stop on their own."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    context, device = model.config.context, model.wte.weight.device
    lens = [len(p) for p in prompts]
    if max(lens) >= context:
        raise ValueError(f"the longest prompt has {max(lens)} tokens but the context window is {context}")
    max_new_tokens = min(max_new_tokens, context - max(lens))
    b = len(prompts)
    sample = make_sampler(device, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    stops = set(int(s) for s in stop_ids)
    with evaluating(model):
        dec = Decoder(model, b, "compacted", ragged=True)
        lat, mem, live = [], [], []
        t0 = time.perf_counter()
        logits = dec.prefill(prompts)
        _sync(device)
        lat.append(time.perf_counter() - t0)
        mem.append(dec.state.nbytes())
        live.append(dec.state.live_tokens())
        new_ids: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        reasons = ["max_new_tokens"] * b
        for step in range(max_new_tokens):
            tokens = sample(logits)
            for r in range(b):
                if not done[r]:
                    new_ids[r].append(int(tokens[r]))
                    if int(tokens[r]) in stops:
                        done[r], reasons[r] = True, "stop_token"
            if all(done) or step + 1 == max_new_tokens:
                break
            t0 = time.perf_counter()
            logits = dec.step(tokens, active=[not d for d in done])
            _sync(device)
            lat.append(time.perf_counter() - t0)
            mem.append(dec.state.nbytes())
            live.append(dec.state.live_tokens())
        return BatchGenerationResult(new_ids, lat, mem, live, [layer.drop_table() for layer in dec.state.layers],
                                     reasons)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    from models import trace
    from models.checkpoint import CheckpointError, load_model_dir
    from models.device import add_arguments as add_device_arguments, describe

    ap = argparse.ArgumentParser(prog="python -m models.generate", description="Generate text from a model directory.")
    ap.add_argument("model_dir")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout, logs to stderr")
    ap.add_argument("--cache", choices=("auto", "static", "compacted"), default="auto",
                    help="auto: the compacted cache for a context-pruned model (dropped tokens are freed), else static")
    ap.add_argument("--trace", metavar="FILE", help="write the trace: FILE.csv (steps), FILE.drops.csv, FILE.json")
    ap.add_argument("--force", action="store_true", help="overwrite an existing trace")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    try:
        loaded = load_model_dir(args.model_dir, device=args.device, dtype=args.dtype)
        if not args.prompt.strip():
            raise ValueError("empty prompt: generation needs at least one prompt token (the prompt is blank)")
        prompt = loaded.tokenizer.encode(args.prompt).ids
        if args.trace and not args.force:
            clash = [p for p in trace.paths_for(args.trace) if p.exists()]
            if clash:  # refuse before generating, not after
                raise FileExistsError(f"{', '.join(map(str, clash))} already exist(s): choose another --trace name, "
                                      "or pass --force")
        res = generate(loaded.model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, greedy=args.greedy, seed=args.seed, cache=args.cache)
        if args.trace:
            settings = {k: getattr(args, k)
                        for k in ("max_new_tokens", "temperature", "top_k", "top_p", "greedy", "seed", "cache")}
            written = trace.write(trace.build(res, loaded.tokenizer, model_dir=str(loaded.path), prompt=args.prompt,
                                              settings=settings), args.trace, force=args.force)
            log.info("wrote %s", ", ".join(map(str, written)))
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = loaded.tokenizer.decode(res.new_ids)
    ms = [e.latency_s * 1000 for e in res.events]
    summary = {
        "model_dir": str(loaded.path), "prompt": args.prompt, "text": text, "new_tokens": len(res.new_ids),
        "stop_reason": res.stop_reason, "notes": res.notes, "prefill_ms": res.prefill_s * 1000,
        "ms_per_token": ms, "mean_ms_per_token": sum(ms) / len(ms), "tokens_per_s": res.decode_tokens_per_s,
        "perplexity": res.perplexity, "cache_bytes": res.cache_bytes, "cache": res.cache_kind,
        "held_bytes": res.events[-1].held_bytes, "dense_bytes": res.events[-1].dense_bytes, "drops": len(res.drops),
        "device": describe(loaded.model.wte.weight.device), "dtype": str(loaded.model.wte.weight.dtype),
        "kernel_paths": res.kernel_paths,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(args.prompt + text)
        print(f"[{len(res.new_ids)} tokens, {summary['mean_ms_per_token']:.1f} ms/token, "
              f"{summary['tokens_per_s']:.1f} tokens/s, {res.cache_kind} cache {res.cache_bytes} bytes allocated, "
              f"{summary['held_bytes']} held (dense {summary['dense_bytes']}), {len(res.drops)} drops]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
