"""Read character vectors out of an R lazy-load database (.rdb), without R.

The file is a sequence of [4-byte big-endian uncompressed length][zlib stream]; each stream is an
R serialization (format 'X', version 2 or 3). We only need STRSXP objects (character vectors),
as in janeaustenr's novels.
"""
from __future__ import annotations

import struct
import zlib

STRSXP, CHARSXP = 16, 9
UTF8_FLAG, LATIN1_FLAG = 1 << 3, 1 << 2


def iter_objects(data: bytes):
    """Yield the uncompressed bytes of each object in the database."""
    pos = 0
    while pos + 4 <= len(data):
        stream = zlib.decompressobj()
        raw = stream.decompress(data[pos + 4:])
        yield raw
        pos = len(data) - len(stream.unused_data)


def read_strings(raw: bytes) -> list[str] | None:
    """The strings of a serialized character vector, or None if the object is something else."""
    if raw[:2] != b"X\n":
        return None
    pos = 2
    (version,) = struct.unpack_from(">i", raw, pos)
    pos += 12  # version, writer's R version, minimal R version
    if version == 3:
        (n,) = struct.unpack_from(">i", raw, pos)
        pos += 4 + n  # native encoding name
    flags, length = struct.unpack_from(">ii", raw, pos)
    pos += 8
    if flags & 0xFF != STRSXP:
        return None
    out = []
    for _ in range(length):
        cflags, clen = struct.unpack_from(">ii", raw, pos)
        pos += 8
        if cflags & 0xFF != CHARSXP:
            raise ValueError(f"unexpected element type {cflags & 0xFF} in a character vector")
        if clen == -1:  # NA_character_
            out.append("")
            continue
        levels = cflags >> 12
        out.append(raw[pos:pos + clen].decode("latin-1" if levels & LATIN1_FLAG else "utf-8", errors="replace"))
        pos += clen
    return out
