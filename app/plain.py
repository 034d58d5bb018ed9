"""Strings the app did not write (a model's directory name, a card's field, a token, pasted text, an error that
quotes any of them) shown inside Streamlit's Markdown as the characters they are: no link, image, HTML, icon,
colour, math or emoji made from them.

Where Streamlit renders Markdown: st.markdown, st.caption, st.info/warning/error/success, st.title/header/
subheader, widget and metric labels, `help=` texts, spinner and progress texts, expander and tab names. Its
pipeline (react-markdown, Streamlit 1.x) is CommonMark + GFM + directives (`:red[..]`, `:color[..]{..}`), with
math (`$..$`) and, when unsafe_allow_html is set, raw HTML. Two kinds of markup come from it:

- syntax (links, images, emphasis, HTML, directives, math, tables, code): each character that opens or
  closes such a construct anywhere in a line gets a backslash, which CommonMark reads as that character
  (micromark honours it in each construct, `$` included): \\ ` * ~ [ ] < & $ : # | { }, and `_` but inside a
  word (W_Q, which CommonMark never reads as emphasis). Line breaks, tabs and any whitespace at either end become
  character references, so the string stays on one line and keeps its whitespace; what opens a block only at a
  line's start (`- `, `+ `, `1. `, `>`, `=`) is escaped when the string starts with it. The rest
  (`( ) > - . / , ' " ! @ %`, as in `mha (shipped)`, `<root 1>/m` or a path) is left as it is: none of it is
  markup once those are escaped. (A bare ':' before a character, even one that cannot start a directive, makes
  the directive parser end the text node there: `a <=:b` then drew `a ≤:b`.)
- rewrites of the text itself, made after parsing, where escapes are already gone: bare URLs (`http://..`,
  `www.`) and e-mail addresses become links (GFM's autolink literals), `:name:` an emoji, `:material/..:` an
  icon, `:streamlit:` an image, and `->`, `<=`, `--` (between spaces) arrows and dashes. Each pattern is broken
  by a WORD JOINER (U+2060, drawn as nothing) where it would start; so are the spaces and tabs beside a line
  break, which Markdown would trim. The text shown reads the same: it is the input with U+2060 inserted, and
  `plain()` of what the page shows is the input.

HTML built for `unsafe_allow_html=True` (coloured, faded or struck tokens) has its own escape,
analysis.tokens.html_text.
"""
from __future__ import annotations

import re
import string

JOINER = "\u2060"   # WORD JOINER: no width, no line break, and no Markdown plug-in pattern crosses it
_PUNCT = frozenset(string.punctuation)   # ASCII punctuation: CommonMark lets a backslash escape each of them
_SYNTAX = frozenset("\\`*~[]<&$:#|{}")   # what opens or closes inline markup (HTML, math, entities, directives)
_INTRAWORD = re.compile(r"(?<=[A-Za-z0-9])_(?=[A-Za-z0-9])")   # '_' inside a word opens no emphasis (W_Q)
_LIST = re.compile(r"\d{1,9}(?=[.)])")        # an ordered list's marker, when the string starts with one
_REFS = {"\n": "&#10;", "\r": "&#13;", "\t": "&#9;"}
# whitespace, as Python's str.isspace() and JavaScript's \s read it: what a paragraph's ends may lose
_SPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b)))
          + "\u2028\u2029\u202f\u205f\u3000\ufeff")
# whitespace as JavaScript's \s reads it (the plug-ins' regexes) and as Python's does: a boundary for the arrows
_WS = "\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
# the text rewrites Streamlit's Markdown makes after parsing: a joiner goes at the end of each match
_BREAKS = [
    re.compile(r":(?=[\w+-])", re.ASCII),                  # emoji :x:, :+1:, icons :material_x:, :streamlit:
    re.compile(r"(?<=http)(?=s?://)", re.IGNORECASE),       # http:// and https:// autolinks
    re.compile(r"(?<=www)(?=\.)", re.IGNORECASE),           # www. autolinks
    re.compile(r"@(?=[-\w])"),                              # e-mail autolinks
]
_ARROWS = ("<->", "->", "<-", "--", ">=", "<=", "~=")   # drawn as arrows and a dash between whitespace
_ARROW = re.compile(rf"(?:(?<=[{_WS}])|^)({'|'.join(re.escape(a) for a in _ARROWS)})(?=[{_WS}]|$)")
# spaces and tabs beside a line break, which Markdown trims from text (mdast-util-to-hast's trimLines)
_EDGE = re.compile(r"(?<=[ \t])(?=[\r\n])|(?<=[\r\n])(?=[ \t])")


def _joined(s: str) -> str:
    s = _EDGE.sub(JOINER, s)
    s = _ARROW.sub(lambda m: m.group(1)[0] + JOINER + m.group(1)[1:], s)
    for pattern in _BREAKS:
        s = pattern.sub(lambda m: m.group(0) + JOINER, s)
    return s


def md(s) -> str:
    """`s` (any object, as str() gives it) as Markdown that Streamlit shows as exactly its characters (with
    invisible joiners where a pattern had to be broken): safe to put inside our own Markdown."""
    s = _joined(str(s))
    start = _LIST.match(s)
    first = start.end() if start else 0     # a line may start with s: its first character (after digits)
    inert = {m.start() for m in _INTRAWORD.finditer(s)}
    out = ["\\" + c if c in _SYNTAX or (c == "_" and i not in inert) or (i == first and c in _PUNCT)
           else _REFS.get(c, c) for i, c in enumerate(s)]
    lead = len(s) - len(s.lstrip(_SPACE))
    trail = len(s) - len(s.rstrip(_SPACE)) if lead < len(s) else 0
    for i in [*range(lead), *range(len(s) - trail, len(s))]:   # (a paragraph's ends are trimmed: references stay)
        out[i] = f"&#{ord(s[i])};"
    return "".join(out)


def plain(shown: str) -> str:
    """The text a page shows for md(s) with the joiners taken out: s itself."""
    return shown.replace(JOINER, "")
