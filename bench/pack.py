"""Move large files to and from a GPU machine that has no network and takes a limited amount per call: cut
each file into parts of at most --part-mb MB beside a manifest (name, size, sha256, parts), carry the parts over
several calls, and join them there (or back here) once every part has arrived, checking the sha256.

    python -m bench.pack split FILE... --out DIR [--part-mb 45]
    python -m bench.pack join DIR... --to DEST        # parts may sit in several DIRs (one per call)

What travels this way: the SmolLM2 base wheel (93 MB) to the GPU, fine-tuned deltas and results back.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

CHUNK = 1 << 20


def split(path: Path, out: Path, part_bytes: int) -> dict:
    """Cut `path` into out/<name>.partNNN and write out/<name>.manifest.json; returns the manifest."""
    if part_bytes < 1:
        raise ValueError("parts must hold at least one byte")
    out.mkdir(parents=True, exist_ok=True)
    digest, parts, size = hashlib.sha256(), [], 0
    with open(path, "rb") as src:
        while True:
            block = src.read(part_bytes)
            if not block:
                break
            name = f"{path.name}.part{len(parts):03d}"
            (out / name).write_bytes(block)
            digest.update(block)
            parts.append({"file": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
            size += len(block)
    manifest = {"name": path.name, "bytes": size, "sha256": digest.hexdigest(), "parts": parts}
    (out / f"{path.name}.manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def join(dirs: list[Path], dest: Path, force: bool = False) -> list[Path]:
    """Every file whose manifest is in one of `dirs`, rebuilt in dest from parts found in any of them. A
    missing or damaged part stops with its name; an existing file in dest is kept unless force."""
    manifests = {}
    for d in dirs:
        for m in sorted(d.glob("*.manifest.json")):
            manifests.setdefault(m.name, json.loads(m.read_text()))
    if not manifests:
        raise FileNotFoundError(f"no *.manifest.json in {', '.join(map(str, dirs))}")
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    for man in manifests.values():
        name = Path(man["name"]).name  # a manifest names a file, never a path
        target = dest / name
        if target.exists() and not force:
            raise FileExistsError(f"{target} exists: remove it or pass --force")
        found = {}
        for part in man["parts"]:
            if Path(part["file"]).name != part["file"] or part["file"] in ("", ".", ".."):  # a file, never a path
                raise ValueError(f"{name}: part name {part['file']!r} is not a plain file name")
            where = [d / part["file"] for d in dirs if (d / part["file"]).is_file()]
            if not where:
                raise FileNotFoundError(f"{name}: part {part['file']} has not arrived (looked in {len(dirs)} folders)")
            found[part["file"]] = where[0]
        tmp = target.with_name(target.name + ".joining")
        digest = hashlib.sha256()
        try:
            with open(tmp, "wb") as out:
                for part in man["parts"]:
                    block = found[part["file"]].read_bytes()
                    if len(block) != part["bytes"] or hashlib.sha256(block).hexdigest() != part["sha256"]:
                        raise ValueError(f"{name}: part {part['file']} is damaged (size or sha256 differ)")
                    digest.update(block)
                    out.write(block)
            if digest.hexdigest() != man["sha256"]:
                raise ValueError(f"{name}: the joined file's sha256 differs from the manifest's")
            tmp.replace(target)  # whole or not at all
        finally:
            tmp.unlink(missing_ok=True)
        made.append(target)
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pack", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("files", nargs="+")
    s.add_argument("--out", required=True)
    s.add_argument("--part-mb", type=float, default=45.0)
    j = sub.add_parser("join")
    j.add_argument("dirs", nargs="+")
    j.add_argument("--to", required=True)
    j.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            for f in args.files:
                m = split(Path(f), Path(args.out), int(args.part_mb * 1e6))
                print(f"{m['name']}: {m['bytes']} bytes in {len(m['parts'])} parts under {args.out}")
        else:
            for p in join([Path(d) for d in args.dirs], Path(args.to), args.force):
                print(f"joined {p}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
