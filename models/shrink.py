"""Store a model directory's weights in bfloat16 (or float16), with its test perplexity re-measured:

    python -m models.shrink SRC OUT [--dtype bfloat16] [--data DIR] [--force] [--device auto]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from models.checkpoint import STORAGE, load_model_dir, rule_tensors, save_model_dir
from models.data import DataError, load_documents
from models.evaluate import encode_documents, score_documents
from models.files import CheckpointError


def shrink(src: str | Path, out: str | Path, weights_dtype: str = "bfloat16", data_dir: str | Path | None = None,
           force: bool = False, device: str = "cpu") -> dict:
    """A copy of a model directory whose weights are stored in weights_dtype (computed in float32), with its
    test perplexity re-measured under the zoo's protocol (the card keeps the original as test_perplexity_float32),
    so the price of the smaller file is on the card."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"{out} is not empty: choose another directory, or pass --force")
    loaded = load_model_dir(src, device=device)
    exact = rule_tensors(loaded.model)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if name not in exact:
                p.copy_(p.to(STORAGE[weights_dtype]).float())
    card = dict(loaded.card)
    data = Path(data_dir or card.get("data", {}).get("dir", "data"))
    docs = encode_documents(loaded.tokenizer, load_documents(data, "test"))
    res = score_documents(loaded.model, docs, min(card.get("eval_stride", 256), loaded.config.context), progress=True)
    card |= {"test_perplexity_float32": card.get("test_perplexity"), "test_perplexity": res["perplexity"],
             "shrunk_from": str(Path(src)), "weights_dtype": weights_dtype}
    save_model_dir(out, loaded.model, loaded.tokenizer, card, weights_dtype)
    return card


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.shrink",
                                 description="Store a model's weights in bfloat16 (or float16); re-measures test "
                                             "perplexity.")
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--data", default=None, help="prepared data directory (default: the one on the card)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    ap.add_argument("--device", default="auto", help="where the perplexity is re-measured (float32): auto | cpu | cuda")
    args = ap.parse_args(argv)
    try:
        card = shrink(args.src, args.out, args.dtype, args.data, args.force, args.device)
    except (CheckpointError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: test perplexity {card['test_perplexity']:.3f} "
          f"(float32 weights: {card['test_perplexity_float32']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
