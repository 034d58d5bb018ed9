"""The same measurements in two checkouts of mixscope, interleaved: batch-1 greedy decode (tokens/s) of models
over the cache generation picks for them, and a pruned training step (steps/s), each case run in a fresh process
in one tree, then the other (alternating which goes first), `--runs` times; medians and the after/before ratio of each.

    python -m bench.before_after --before DIR [--after .] [--model NAME=DIR:CACHE ...] [--train DIR] \
        [--runs 6] [--tokens 64] [--threads 1] [--json FILE]

DIR is another checkout (a `git worktree` of the earlier commit); each process imports the code of its own tree.
The case code uses only what both trees have: models.checkpoint.load_model_dir and models.generate.generate.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench import cpu_model, report

PROMPT = "The committee met again on Tuesday. After a long debate about the harbour, the members agreed that"

# one case in one process: prints {"rate": ...} on its last line
DECODE = """
import json, sys, torch
torch.set_num_threads({threads})
from models.checkpoint import load_model_dir
from models.generate import generate
loaded = load_model_dir({model!r})
ids = loaded.tokenizer.encode({prompt!r}).ids
generate(loaded.model, ids, 8, greedy=True, cache={cache!r})
res = generate(loaded.model, ids, {tokens}, greedy=True, cache={cache!r})
print(json.dumps({{"rate": res.decode_tokens_per_s, "ids": res.new_ids}}))
"""

TRAIN = """
import json, time, torch
torch.set_num_threads({threads})
from models.checkpoint import load_model_dir
model = load_model_dir({model!r}).model
model.train()
model.set_alpha(4.0)
g = torch.Generator().manual_seed(0)
x = torch.randint(0, model.config.vocab_size, ({batch}, {length} + 1), generator=g)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
def step():
    out = model(x[:, :-1], targets=x[:, 1:])
    loss = out.loss + 0.3 * out.prune_mass / (len(model.blocks) * {length} * ({length} - 1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
step()
t = time.perf_counter()
for _ in range({steps}):
    step()
print(json.dumps({{"rate": {steps} / (time.perf_counter() - t)}}))
"""


def run_case(tree: Path, code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                              "OMP_NUM_THREADS": "1", "MIXSCOPE_NO_FETCH": "1"})
    if out.returncode:
        raise RuntimeError(f"a case failed in {tree}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, code: str, before: Path, after: Path, runs: int, decode: bool = False) -> dict:
    """Both trees in turn, `runs` times, the one that goes first alternating (on this machine the first process of a
    pair often ran faster); medians, the ratio of the medians and the median of the pairwise ratios."""
    rates = {"before": [], "after": []}
    same = True
    for i in range(runs):
        order = (("before", before), ("after", after))
        got = {side: run_case(tree, code) for side, tree in (order if i % 2 == 0 else order[::-1])}
        for side in rates:
            rates[side].append(got[side]["rate"])
        same = same and got["before"].get("ids") == got["after"].get("ids")
    med = {side: statistics.median(r) for side, r in rates.items()}
    pairs = [a / b for a, b in zip(rates["after"], rates["before"])]
    row = {"case": name, "before": rates["before"], "after": rates["after"], "median_before": med["before"],
           "median_after": med["after"], "after_over_before": med["after"] / med["before"],
           "median_pair_ratio": statistics.median(pairs)}
    if decode:  # the refactor must not change a single greedy token
        row["same_tokens"] = same
    print(f"{name}: before {med['before']:.2f}, after {med['after']:.2f}, after/before "
          f"{row['after_over_before']:.3f}", file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.before_after", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="the earlier checkout")
    p.add_argument("--after", default=".", help="the later checkout (default: this one)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=DIR:CACHE",
                   help="a decode case: a model directory and the cache (static or compacted)")
    p.add_argument("--train", default=None, help="a pruned model directory for the training-step case")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    before, after = Path(args.before).resolve(), Path(args.after).resolve()
    rows = []
    for spec in args.model:
        name, _, rest = spec.partition("=")
        model, _, cache = rest.rpartition(":")
        code = DECODE.format(threads=args.threads, model=str(Path(model).resolve()), prompt=PROMPT, cache=cache,
                             tokens=args.tokens)
        rows.append(compare(f"decode {name} ({cache})", code, before, after, args.runs, decode=True))
    if args.train:
        code = TRAIN.format(threads=args.threads, model=str(Path(args.train).resolve()), batch=4, length=128,
                            steps=5)
        rows.append(compare(f"pruned training step {Path(args.train).name} (batch 4 x 128)", code, before, after,
                            args.runs))
    result = {"benchmark": "bench.before_after", "host": cpu_model(), "platform": platform.platform(),
              "torch": torch.__version__, "threads": args.threads, "runs": args.runs,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    return report(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
