"""File utilities that model directories, deltas, registry wheels and training runs share: the one error a model
directory raises, regular files opened without blocking and read within a size bound, JSON parsed with every failure
as one error, hashing, atomic writes, and the code version cards record.

A leaf module (standard library only): everything under models/ may import it, and it imports nothing of ours.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CheckpointError", "NotRegularFile", "code_version", "file_sha256", "parse_json", "read_bounded",
           "read_json", "regular_file", "spreadsheet_safe", "write_atomic"]


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file."""


def code_version() -> str:
    """The git commit of this code, with "-dirty" when tracked files differ from it (a card then names code
    that no commit holds), or 'unknown' outside this checkout (installed elsewhere, an enclosing repository's
    commit would not be ours). Git takes no optional locks: a server asking must not block a user's git."""
    here = Path(__file__).resolve().parent
    if not (here.parent / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "--no-optional-locks", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=here)
        head = out.stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, cwd=here).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def regular_file(path: str | Path) -> Iterator[tuple[int, os.stat_result]]:
    """An open descriptor of a regular file, with its stat; NotRegularFile for a FIFO, a device or a directory,
    found without blocking on it (opened non-blocking, checked before any read). Other failures: OSError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        yield fd, info
    finally:
        os.close(fd)


class NotRegularFile(OSError):
    pass


def read_bounded(path: str | Path, limit: int, error=ValueError) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else error(message): a FIFO, a device or a directory is
    refused without blocking on it, a larger file before it is read."""
    try:
        with regular_file(path) as (fd, info):
            if info.st_size > limit:
                raise error(f"{path} is {info.st_size:,} bytes; at most {limit:,} are read")
            chunks, size = [], 0
            while size <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
    except NotRegularFile as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"{path} could not be read: {e.strerror or type(e).__name__}") from None
    if size > limit:
        raise error(f"{path} is over {limit:,} bytes; at most {limit:,} are read")
    return b"".join(chunks)


def parse_json(data: bytes | str, error=ValueError):
    """JSON text, with every way it can fail (bad UTF-8, bad syntax, nesting too deep, a number past the digit
    limit) as error("not valid JSON: ...")."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"not valid JSON: {e}") from None
    except RecursionError:
        raise error("not valid JSON: nested too deeply") from None
    except ValueError as e:   # an integer past Python's digit limit
        raise error(f"not valid JSON: {str(e)[:80]}") from None


def write_atomic(path: Path, write) -> None:
    """Write via a temporary file and rename, so an interrupted save never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(cell):
    """A CSV cell a spreadsheet will show rather than evaluate: text that starts like a formula (=, +, -, @, a tab
    or a carriage return) gets a leading apostrophe, which spreadsheets read as "this is text" (OWASP's advice
    for CSV injection). Tokens, texts, directory names and card fields reach our CSVs; numbers pass unchanged."""
    if isinstance(cell, str) and cell.startswith(FORMULA_STARTS):
        return "'" + cell
    return cell


def read_json(path: Path) -> dict:
    """A JSON object from a model directory file; CheckpointError when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path} could not be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data
