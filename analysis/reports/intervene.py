"""Force the learned rule's decision about one token, or patch the dense twin's states into the pruned model (or the
pruned model's into its twin, --into dense), and write what changed downstream.

    python -m analysis.reports.intervene MODEL_DIR --text FILE --layer L (--keep J | --drop J [--at N]) [--onward]
    python -m analysis.reports.intervene MODEL_DIR --text FILE --layer L --patch P [P ...] [--donor twin|DIR]
        [--into pruned|dense] [--site residual|mixer]
        [--from S] [--window W] --out DIR [--force]

Positions count tokens of the window (from --from, at most the Pruning page's 1,024 tokens or the model's context).
--donor twin (the default) is the same weights with the rule off; a directory is another dense model of the same
width reading the same tokens (the dense base a delta was trained from). Written to --out: the per-position effects
as a figure bundle (PNG, SVG, PDF, CSV and a JSON spec that `python -m analysis.render` redraws), changed_drops.csv
(every layer's decision that changed, forced or as a consequence) and summary.json. Files already there are refused
unless --force.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from analysis import budgets, views
from models import memory
from analysis import intervene as report
from models.pruning import intervene

FILES = ("changed_drops.csv", "summary.json")


def intervention_bytes(cfg, t: int) -> int:
    """One pruned forward over t tokens (its gates and keep structure a layer at a time) and both runs' final states."""
    return memory.forward_bytes(cfg, 1, t) + 4 * 4 * t * cfg.d_model


def run(args) -> dict:
    from analysis import export
    from analysis.export import ExportError, bundle_paths, sidecar, write_bundle
    from analysis.text import tokenize, window
    from models.checkpoint import load_model_dir

    text, out = export.command_inputs(args.text, args.out)
    cfg = budgets.config_of(args.model_dir)
    if not cfg.prune:
        raise ExportError(f"{args.model_dir} does not prune: an intervention forces the learned rule's decisions")
    size = views.view(args.window or views.PRUNING_VIEW, cfg.context)
    memory.check_window([cfg], size, intervention_bytes)
    name = "intervention_effects"
    export.refuse_overwrite([*bundle_paths(out, name), *(out / f for f in FILES)], out, args.force)
    loaded = load_model_dir(args.model_dir, device=args.device, dtype=args.dtype)
    toks = window(tokenize(loaded.tokenizer, text), args.start, size)
    if len(toks.ids) < 2:
        raise ExportError(f"the window from token {args.start} holds {len(toks.ids)} token(s): it needs 2")
    model, ids = loaded.model, toks.ids
    if args.patch:
        donor = model
        if args.donor != "twin":
            other = load_model_dir(args.donor, device=args.device, dtype=args.dtype)
            if tokenize(other.tokenizer, text).ids[args.start:args.start + size] != ids:
                raise ExportError(f"{args.donor} tokenizes the text differently: patching needs the same tokens")
            donor = other.model
        if args.into == "dense" and args.donor != "twin":
            raise ExportError("--into dense patches the pruned model's states into its own twin: leave out --donor")
        res = report.patch_outcome(model, ids, toks.labels, args.layer, args.patch, donor, args.into, args.site)
        what = report.describe_patch(args.layer, args.patch, args.into,
                                     "the dense twin" if args.donor == "twin" else args.donor, args.site)
        settings = {"patch": args.patch, "donor": args.donor, "into": args.into, "site": args.site}
    else:
        j, keep = (args.keep, True) if args.keep is not None else (args.drop, False)
        force = intervene.Force(args.layer, j, keep, None if keep else args.at, args.onward)
        res = report.force_outcome(model, ids, toks.labels, [force])
        what = report.describe(force, toks.labels)
        settings = {"token": j, "keep": keep, "at": force.first_query(), "onward": args.onward}
    settings = {"layer": args.layer, "window_start": args.start, "tokens": len(ids), **settings}
    fig = report.effect_figure(res["effects"], res["summary"]["from"], f"{Path(args.model_dir).name}: {what}")
    out.mkdir(parents=True, exist_ok=True)
    written = write_bundle(fig, res["effects"], out, name, sidecar(args.model_dir, text, settings, name, fig,
                                                                      export.precision_of(model)))
    res["changed"].to_csv(out / FILES[0], index=False)
    summary = {"change": what, "settings": settings, **res["summary"],
               "changed_decisions": int((~res["changed"]["forced"]).sum()),
               "by_layer": res["by_layer"].to_dict("records")}
    (out / FILES[1]).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return {"summary": summary, "written": [*written, out / FILES[0], out / FILES[1]]}


def main(argv=None) -> int:
    from analysis.export import ExportError
    from analysis.text import TextError
    from models.checkpoint import CheckpointError
    from models.device import add_arguments as add_device_arguments

    ap = argparse.ArgumentParser(prog="python -m analysis.reports.intervene", description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--text", required=True, help="a UTF-8 .txt or .md file")
    ap.add_argument("--layer", type=int, required=True)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--keep", type=int, metavar="J", help="keep token J at every later query")
    what.add_argument("--drop", type=int, metavar="J", help="drop token J (from query --at, default J+1)")
    what.add_argument("--patch", type=int, nargs="+", metavar="P", help="patch the donor's states at these positions")
    ap.add_argument("--at", type=int, default=None, help="with --drop: the first query that no longer sees J")
    ap.add_argument("--onward", action="store_true", help="force every later layer too")
    ap.add_argument("--donor", default="twin", help="with --patch: 'twin' (rule off) or a dense model directory")
    ap.add_argument("--into", choices=("pruned", "dense"), default="pruned",
                    help="with --patch: the donor's states into the pruned model (default), or the pruned model's "
                         "own states into its dense twin")
    ap.add_argument("--site", choices=intervene.SITES, default="residual",
                    help="with --patch: the residual stream entering the layer (default), or its token mixer's "
                         "output (the attention alone)")
    ap.add_argument("--from", dest="start", type=int, default=0, help="the window's first token in the text")
    ap.add_argument("--window", type=int, default=None, help=f"tokens (default {views.PRUNING_VIEW}, at most the "
                                                             "model's context)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true", help="overwrite files already in --out")
    add_device_arguments(ap, dtype="float32")
    args = ap.parse_args(argv)
    if args.at is not None and args.drop is None:
        ap.error("--at goes with --drop")
    try:
        res = run(args)
    except (CheckpointError, TextError, ExportError, memory.OverBudget, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = res["summary"]
    print(f"{s['change']}: perplexity from position {s['from']} {s['ppl_from_before']:.3f} -> "
          f"{s['ppl_from_after']:.3f}, {s['changed_decisions']} later decisions changed; wrote {len(res['written'])} "
          f"files to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
