"""User text in: uploads and pasted text become clean strings, or a clear refusal; then tokens with labels."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import PurePath

# characters a page or analysis.export reads (about 4,500 SmolLM2 tokens): every view (analysis.budgets, which
# names this limit with the others) is a window of it, so no view grows with it
MAX_CHARS = 20_000

ALLOWED_SUFFIXES = (".txt", ".md")


class TextError(ValueError):
    """Text the app cannot use; the message is shown to the user as it is."""


def decode_upload(name: str, data: bytes, max_chars: int = MAX_CHARS) -> str:
    suffix = PurePath(name).suffix.lower()
    if suffix not in ALLOWED_SUFFIXES:
        raise TextError(f"{name}: only {' and '.join(ALLOWED_SUFFIXES)} files are accepted")
    if len(data) > 4 * max_chars + 3:  # refused before decoding: UTF-8 takes at most 4 bytes a character (+ a BOM)
        raise TextError(f"{name} is {len(data):,} bytes, more than {max_chars:,} characters of text can take; "
                        "use a shorter excerpt")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) and _utf16_text(data):
        raise TextError(f"{name} is UTF-16 text; save it as UTF-8 and upload it again")
    if b"\x00" in data[:8192]:
        raise TextError(f"{name} looks like a binary file (it contains NUL bytes), not text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TextError(f"{name} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at position {e.start}); "
                        "save it as UTF-8 and upload it again") from None
    return check_text(text, max_chars, what=name)


def _utf16_text(data: bytes) -> bool:
    """A byte-order mark followed by valid UTF-16 holding no NUL characters (else it is binary)."""
    try:
        return "\x00" not in data.decode("utf-16")
    except UnicodeDecodeError:
        return False


def check_text(text: str, max_chars: int = MAX_CHARS, what: str = "The text") -> str:
    if not text or not text.strip():
        raise TextError(f"{what} is empty: paste or upload some text")
    if len(text) > max_chars:
        raise TextError(f"{what} has {len(text):,} characters; the limit is {max_chars:,}. Use a shorter excerpt")
    return text


@dataclass
class Tokens:
    ids: list[int]
    labels: list[str]    # readable token text: spaces as '·', newlines as '⏎'
    offsets: list[tuple[int, int]]


def tokenize(tokenizer, text: str) -> Tokens:
    enc = tokenizer.encode(text)
    labels = [text[a:b].replace(" ", "·").replace("\n", "⏎") or tokenizer.id_to_token(i)
              for i, (a, b) in zip(enc.ids, enc.offsets)]
    return Tokens(list(enc.ids), labels, [tuple(o) for o in enc.offsets])


def from_ids(tokenizer, ids: list[int]) -> tuple[str, Tokens]:
    """Token ids with no text behind them (a window of a prepared token stream) -> the text they decode to and
    their Tokens, each token's offsets being where its own decoded piece sits in that text."""
    pieces = [tokenizer.decode([i]) for i in ids]
    ends = list(itertools.accumulate(len(p) for p in pieces))
    offsets = [(e - len(p), e) for p, e in zip(pieces, ends)]
    labels = [p.replace(" ", "·").replace("\n", "⏎") or tokenizer.id_to_token(i) for p, i in zip(pieces, ids)]
    return "".join(pieces), Tokens(list(ids), labels, offsets)


def window(tokens: Tokens, start: int, size: int) -> Tokens:
    """A slice of at most `size` tokens from `start` (the model sees no more than its context)."""
    end = min(len(tokens.ids), start + size)
    return Tokens(tokens.ids[start:end], tokens.labels[start:end], tokens.offsets[start:end])
