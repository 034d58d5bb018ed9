"""Sliding-window perplexity on held-out documents, and the MHE paper's PRR / PEoP.

    python -m models.evaluate MODEL_DIR [--split test] [--stride 256] [--window N] [--data DIR] [--max-windows N]
        [--json]
    python -m models.evaluate --check-card MODEL_DIR [MODEL_DIR ...]   # re-measure each card's test perplexity

Each document is scored on its own (windows never cross documents), starting from <|endoftext|>;
windows hold at most `context` tokens and advance by `stride`; every token is scored exactly once,
with all the history the window has (at least context - stride tokens once the document is long).

Memory is bounded whatever the window (SmolLM2's whole 8,192-token context fits 4 GB): a forward takes about
BATCH_TOKENS tokens of windows (at least one window, fewer where the memory budget says so), and the head turns
the final hidden states into log-probabilities a chunk of positions at a time, only where a window scores: the
[windows, window, vocab] logits never exist. A window that would not fit even alone is refused before anything
runs, naming the largest that fits (models.memory plans both).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from models.checkpoint import load_model_dir, read_card
from models.decode import Decoder
from models.files import CheckpointError, file_sha256
from models.pruning import sparsity
from models import memory
from models.memory import forward_bytes, record_bytes, weights_bytes
from models.scoring import head_logprobs, target_logprobs
from models.tokenizer import EOS
from models.transformer import evaluating

log = logging.getLogger("models.evaluate")


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """For a sequence of n tokens (n - 1 targets): (begin, end, n_scored) per window.

    The window feeds tokens [begin, end) and predicts [begin+1, end+1); its last n_scored
    predictions are the ones not scored before.
    """
    if not 0 < stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    out, scored = [], 0
    for begin in range(0, max(n - 1, 0), stride):
        end = min(begin + context, n - 1)
        out.append((begin, end, end - scored))
        scored = end
        if end == n - 1:
            break
    return out


BATCH_TOKENS = 4096  # tokens one forward takes: 16 windows of the zoo's 256, one of SmolLM2's 8,192 (at least one)


def check_window(model, window: int, budget: int | None = None, extra=lambda t: 0, what: str = "--window") -> None:
    """models.memory.OverBudget (a ValueError), before anything runs, when one window of `window` tokens would not
    fit beside this loaded model's weights, naming the largest window that does (extra(t): bytes a window of t
    tokens holds besides one forward's; budget: default memory_budget())."""
    memory.check_window([model.config], window, lambda c, t: forward_bytes(c, 1, t) + extra(t),
                        weights_bytes(model), what, budget)


@torch.inference_mode()
def score_documents(model, docs: list[list[int]], stride: int, batch_tokens: int = BATCH_TOKENS,
                    progress: bool = False, window: int | None = None, max_windows: int | None = None,
                    budget: int | None = None) -> dict:
    """Summed negative log-likelihood and count over all targets of the documents (token id lists). window: the
    longest window fed (default and at most the model's context; an 8k-context model is costly on a CPU).
    max_windows: only the first windows, in document order (a quick check; not the split's perplexity). budget:
    bytes for the whole process (default memory_budget()); a window that would not fit is refused before any
    forward."""
    context = model.config.context if window is None else min(window, model.config.context)
    check_window(model, context, budget)
    # (document, begin, end, scored): slices taken per batch, not up front (8 k-token windows at stride 256 would
    # copy each token 32 times)
    jobs = [(d, b, e, k) for d, doc in enumerate(docs) for b, e, k in windows(len(doc), context, stride)]
    jobs = jobs[:max_windows] if max_windows else jobs
    jobs.sort(key=lambda j: j[2] - j[1])  # equal lengths batch together
    device = model.wte.weight.device
    nll, count = 0.0, 0
    bar = tqdm(total=len(jobs), desc="evaluating", disable=not progress, file=sys.stderr)
    i = 0
    with evaluating(model):
        while i < len(jobs):
            length = jobs[i][2] - jobs[i][1]
            rows = max(1, memory.batch_rows(model, length, batch_tokens, budget))
            group = [j for j in jobs[i:i + rows] if j[2] - j[1] == length]
            x = torch.tensor([docs[d][b:e] for d, b, e, _ in group], device=device)
            y = torch.tensor([docs[d][b + 1:e + 1] for d, b, e, _ in group], device=device)
            first = length - max(k for *_, k in group)  # positions before this are history only: no head there
            hidden = model(x, hidden_only=True).hidden[:, first:]
            logp = head_logprobs(model, hidden, y[:, first:])  # [b, length - first]
            for row, (*_, k) in zip(logp, group):
                nll -= float(row[-k:].double().sum())
                count += k
            i += len(group)
            bar.update(len(group))
    bar.close()
    return {"nll": nll, "tokens": count, "loss": nll / max(count, 1), "perplexity": math.exp(nll / max(count, 1))}


BUCKETS = ((100, 256), (256, 512), (512, 1024))  # context sizes of the pruning tables


def method_of(cfg, card: dict) -> str:
    if cfg.prune:
        return f"pruned (gamma {card.get('train', {}).get('gamma')})"
    if cfg.pattern != "dense":
        return f"{cfg.pattern} (k {cfg.pattern_k})"
    return "dense"


@torch.inference_mode()
def bucket_eval(model, stream: list[int], window: int, buckets=BUCKETS, max_windows: int | None = None,
                progress: bool = False) -> list[dict]:
    """Perplexity and sparsity by context size over consecutive windows of a token stream: a predicted token's
    bucket is its position k in the window; sparsity is the share of its k earlier tokens that its attention
    cannot see (the step mask), averaged over layers (0 for a dense model). Used by analysis.reports.pruning.
    A window whose forward and kept masks would not fit the memory budget is refused before anything runs."""
    check_window(model, window, extra=lambda t: record_bytes(model.config, t))
    dev = model.wte.weight.device
    n = (len(stream) - 1) // window
    if max_windows:
        n = min(n, max_windows)
    acc = {b: [0.0, 0, 0.0] for b in buckets}  # nll, tokens, sparsity sum
    with evaluating(model):
        for w in tqdm(range(n), desc="windows", disable=not progress, file=sys.stderr):
            seq = torch.tensor(stream[w * window: w * window + window + 1], device=dev)
            # masks only (no attention maps), and the head a chunk of positions at a time
            out = model(seq[None, :-1], diagnostics=True, attention_maps=False, hidden_only=True)
            logp = head_logprobs(model, out.hidden[0], seq[1:]).double().cpu()
            keeps = [d.keep for d in out.diagnostics]
            k = torch.arange(window)
            if keeps[0] is None:
                sp = torch.zeros(window, dtype=torch.float64)
            else:  # share of the k earlier tokens not visible, mean over layers
                sp = torch.stack([sparsity(kk[:1])[0].cpu() for kk in keeps]).double().mean(0)
            for lo, hi in buckets:
                sel = (k >= lo) & (k < hi)
                acc[(lo, hi)][0] -= float(logp[sel].sum())
                acc[(lo, hi)][1] += int(sel.sum())
                acc[(lo, hi)][2] += float(sp[sel].sum())
    return [{"bucket": f"{lo}-{hi}", "tokens": t, "perplexity": math.exp(nll / t) if t else float("nan"),
             "sparsity": s / t if t else float("nan")} for (lo, hi), (nll, t, s) in acc.items()]


@torch.inference_mode()
def score_token_by_token(model, ids: list[int], policy=None) -> dict:
    """Teacher-forced decoding over the compacted cache, one token per step, so each query sees what the
    learned rule (a pruned model) or a heuristic eviction policy (a dense one) has left it: the summed NLL of
    ids[1:], the token count, and the sparsity (per query, the share of its earlier tokens it could not see;
    averaged over queries and layers, as models.pruning.sparsity and the pruning tables do)."""
    x = torch.tensor(ids, device=model.wte.weight.device)
    nll = torch.zeros((), dtype=torch.float64, device=x.device)
    with evaluating(model):
        dec = Decoder(model, 1, "compacted", policy, count_seen=True)
        for i in range(len(ids) - 1):
            nll -= target_logprobs(dec.step(x[i:i + 1]), x[i + 1:i + 2])[0]
    queries = len(dec.state.layers) * (len(ids) - 1)
    return {"nll": float(nll), "tokens": len(ids) - 1, "sparsity": 1 - dec.seen_share() / queries if queries else 0.0}


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer has no {EOS} token")
    return [[eos, *enc.ids] for enc in tokenizer.encode_batch(texts)]


def paper_metrics(ppl: float, attn_params: int, mha: tuple[float, int] | None, sha: tuple[float, int] | None) -> dict:
    """PRR vs MHA (1 - (s - s_MHA)/s_MHA for perplexity) and PEoP vs SHA (negated for perplexity)."""
    out = {"prr": None, "peop": None}
    if mha:
        out["prr"] = 1 - (ppl - mha[0]) / mha[0]
    if sha and attn_params != sha[1]:
        out["peop"] = -((ppl / sha[0]) - 1) / ((attn_params / sha[1]) - 1)
    return out


REFERENCES = ("mha", "sha")  # PRR is relative to the zoo's `mha` directory, PEoP to its `sha` directory


def zoo_references(root: str | Path) -> dict[str, tuple[float, int]]:
    """(test perplexity, attention parameters) of the reference models PRR and PEoP need, found by directory
    (root/mha, root/sha: never by mixer name, which a pruned or adapted MHA shares), read from their cards and
    configs (built on the meta device; no weights read). A missing or unfinished reference is left out. The
    results table and the app's Models table both ask here."""
    from models.config import ConfigError, ModelConfig
    from models.params import count_parameters
    from models.transformer import DecoderLM

    refs = {}
    for name in REFERENCES:
        folder = Path(root) / name
        try:
            card = read_card(folder / "card.json")
            with torch.device("meta"):
                attn = count_parameters(DecoderLM(ModelConfig.from_dict(card["config"])))["mixer"]
        except (OSError, CheckpointError, ConfigError, KeyError, TypeError):
            continue
        ppl = card.get("test_perplexity")
        if card.get("status", "ok") == "ok" and isinstance(ppl, (int, float)) and math.isfinite(ppl):
            refs[name] = (float(ppl), attn)
    return refs


def evaluate_dir(model_dir: str | Path, split: str = "test", stride: int = 256, data_dir: str | Path | None = None,
                 progress: bool = False, window: int | None = None, device: str = "cpu",
                 dtype: str = "float32", max_windows: int | None = None) -> dict:
    from models.data import load_documents
    from models.params import count_parameters

    loaded = load_model_dir(model_dir, device=device, dtype=dtype)
    data_dir = Path(data_dir or loaded.card.get("data", {}).get("dir", "data"))
    docs = encode_documents(loaded.tokenizer, load_documents(data_dir, split))
    res = score_documents(loaded.model, docs, stride, progress=progress, window=window, max_windows=max_windows)
    counts = count_parameters(loaded.model)
    card_sha = loaded.card.get("data", {}).get(f"{split}_sha256")
    now_sha = file_sha256(data_dir / f"{split}.txt")
    return {"model_dir": str(loaded.path), "mixer": loaded.config.mixer, "split": split, "stride": stride,
            "window": min(window or loaded.config.context, loaded.config.context),
            "data_dir": str(data_dir), "data_matches_card": card_sha == now_sha if card_sha else None,
            **({"max_windows": max_windows} if max_windows else {}),
            "tokens": res["tokens"], "loss": res["loss"], "perplexity": res["perplexity"],
            "parameters": counts, "attention_parameters": counts["mixer"]}


CARD_RTOL = 1e-6  # a card's test perplexity must reproduce to this relative error on the machine that wrote it


def check_cards(model_dirs: list[str], rtol: float = CARD_RTOL, evaluate=None, **dev) -> list[dict]:
    """Re-measure every card's test perplexity the way training measured it (its data directory, its eval stride,
    the model's whole context): one row per directory with the card's value, the new one and `ok` (True: they
    agree to rtol over the same token count; False: they do not, or the directory could not be evaluated, with
    the reason under `error`; None: the card has no finished result to check)."""
    from models.data import DataError

    evaluate = evaluate or evaluate_dir
    rows = []
    for d in tqdm(model_dirs, desc="cards", file=sys.stderr):
        row = {"model_dir": str(d), "card": None, "measured": None, "rel_error": None, "ok": None}
        try:  # one directory that cannot be read or evaluated is a row, not the end of the check
            card = read_card(Path(d) / "card.json")
            row["card"] = want = card.get("test_perplexity")
            if card.get("status", "ok") == "ok" and isinstance(want, (int, float)) and math.isfinite(want) and want > 0:
                got = evaluate(d, "test", card.get("eval_stride", 256), progress=True, **dev)
                rel = abs(got["perplexity"] - want) / want
                row |= {"measured": got["perplexity"], "rel_error": rel, "data_matches_card": got["data_matches_card"],
                        "ok": rel <= rtol and got["tokens"] == card.get("test_tokens")}
        except (OSError, CheckpointError, DataError, ValueError) as e:
            row |= {"ok": False, "error": str(e)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from models.data import DataError
    from models.device import add_arguments as add_device_arguments

    ap = argparse.ArgumentParser(prog="python -m models.evaluate")
    ap.add_argument("model_dir", nargs="+")
    ap.add_argument("--check-card", action="store_true",
                    help=f"re-measure each directory's card.json test perplexity (its data, its stride; on the CPU "
                         f"unless --device says otherwise); exit 1 unless all agree to {CARD_RTOL:g}")
    ap.add_argument("--split", default="test", choices=["train", "valid", "test"])
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--window", type=int, default=None, help="longest window fed (default: the model's context)")
    ap.add_argument("--data", default=None, help="prepared data directory (default: the one on the model card)")
    ap.add_argument("--max-windows", type=int, default=None,
                    help="score only the first N windows, in document order (a quick check or a memory measurement: "
                         "not the split's perplexity)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object on stdout (--check-card: one per directory), logs to stderr")
    add_device_arguments(ap, dtype="float32")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    dev = dict(device=args.device, dtype=args.dtype)
    if args.check_card:
        fixed = [f"--{k.replace('_', '-')}" for k in ("split", "stride", "window", "data", "max_windows")
                 if getattr(args, k) != ap.get_default(k)]
        if fixed:  # a card is checked against what it was measured on
            ap.error(f"--check-card takes each card's own split, stride, window and data; drop {', '.join(fixed)}")
        if args.device == "auto":  # the cards were written on the CPU in float32: a GPU's sums differ beyond 1e-6
            dev["device"] = "cpu"
        rows = check_cards(args.model_dir, **dev)
        for r in rows:
            word = "ok" if r["ok"] else "not checked (no finished result)" if r["ok"] is None else \
                f"FAILED: {r['error']}" if "error" in r else "DIFFERS"
            print(json.dumps(r) if args.json else f"{r['model_dir']}: card {r['card']}, measured {r['measured']}, "
                                                   f"relative error {r['rel_error']} -> {word}")
        return 0 if all(r["ok"] is not False for r in rows) else 1
    if len(args.model_dir) != 1:
        ap.error("one MODEL_DIR, unless --check-card")
    args.model_dir = args.model_dir[0]
    try:
        if args.max_windows is not None and args.max_windows < 1:
            ap.error("--max-windows must be at least 1")
        result = evaluate_dir(args.model_dir, args.split, args.stride, args.data, progress=True, window=args.window,
                              max_windows=args.max_windows, **dev)
        parent = Path(args.model_dir).resolve().parent
        ref = {}
        for name in REFERENCES:  # the zoo's baselines, evaluated the same way (zoo_references reads their cards)
            if (parent / name).is_dir():
                r = result if Path(result["model_dir"]).resolve() == parent / name else \
                    evaluate_dir(parent / name, args.split, args.stride, args.data, max_windows=args.max_windows,
                                 **dev)
                ref[name] = (r["perplexity"], r["attention_parameters"])
        result |= paper_metrics(result["perplexity"], result["attention_parameters"], ref.get("mha"), ref.get("sha"))
    except (CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['mixer']}: {args.split} perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
              f"(stride {args.stride}); PRR {result['prr']}, PEoP {result['peop']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
