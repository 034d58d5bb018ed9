"""Redraw an exported figure from its JSON sidecar, without the model or the app: the sidecar holds the figure's
whole plotly spec (analysis.export.sidecar), so a figure can be written again at a paper's size, in another
format, or with a title of one's own.

    python -m analysis.render SIDECAR.json [--format pdf ...] [--out DIR] [--width PX] [--height PX]
        [--scale S] [--title TEXT] [--paper one|two] [--force]

--paper draws it in the publication style (analysis.style): a one- or two-column width, colour-blind-safe
colours, an embedded font, TeX-style sub- and superscripts in titles. Without it the figure is redrawn exactly as
exported: the same data arrays and, with the same plotly, kaleido and chromium, the same PNG and SVG bytes.

Writes NAME.{format} beside the sidecar (or in --out), NAME being the sidecar's file name; existing files are
refused unless --force. A sidecar exported before the spec was kept in it cannot be redrawn this way: export the
figure again. A spec that names anything a renderer would fetch or act on (images, maps, a <span style>, a CSS
url(), a URL, MathJax), anywhere in it, is refused with the place named (`refused`); each file is written through
a temporary file created exclusively beside it and renamed into place (analysis.export.write_file).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import plotly.io as pio

from analysis import plain, style
from analysis.export import FORMATS, ExportError, figure_bytes, write_file

MAX_SIDECAR_BYTES = 64 * 2**20   # the largest spec the app writes (the maps overview) is about 1 MB
MAX_SIDE_PX = 8000                # --width / --height, and a spec's own
MAX_PIXELS = 100e6                # width x height x scale^2 of a PNG (kaleido's chromium draws it whole)
TRACES = plain.TRACES             # what this project's figures are made of


def refused(spec: dict) -> str | None:
    """Where and what in a spec names something a renderer would fetch or act on, as "PATH: what" (layout images,
    maps or geography, a trace type outside TRACES, a <span style>, a CSS url(), a URL, MathJax: anywhere in its
    data, layout, frames or templates; analysis.plain.spec_refusal), or None. plotly's own template styles geo
    and map subplots, which no allowed trace opens: those parts of a template are dropped, not refused
    (analysis.plain.without_inert_template_parts)."""
    return plain.spec_refusal(plain.without_inert_template_parts(spec))


def load_figure(sidecar: str | Path):
    """The plotly figure a sidecar holds; ExportError with the reason when it holds none or cannot be read."""
    path = Path(sidecar)
    if not path.is_file():
        raise ExportError(f"{path} is not a file")
    if path.stat().st_size > MAX_SIDECAR_BYTES:
        raise ExportError(f"{path} is over {MAX_SIDECAR_BYTES // 2**20} MB: not a sidecar this project writes")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ExportError(f"{path} is not a JSON sidecar: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("plotly"), dict):
        raise ExportError(f"{path} holds no figure spec (\"plotly\"): it was exported before sidecars kept one, or "
                          "is not a figure's sidecar; export the figure again")
    refusal = refused(meta["plotly"])
    if refusal:
        raise ExportError(f"{path}: its figure spec is refused, {refusal}")
    try:
        fig = pio.from_json(json.dumps(meta["plotly"]))   # (as written: figure_bytes drops the template's inert parts)
    except (ValueError, TypeError, RecursionError) as e:
        raise ExportError(f"{path}: its figure spec is not a plotly figure: {e}") from None
    for side in ("width", "height"):
        value = fig.layout[side]
        if value is not None and not 10 <= value <= MAX_SIDE_PX:
            raise ExportError(f"{path}: its figure is {value} px in {side}; 10 to {MAX_SIDE_PX} are drawn")
    return fig


def render(sidecar: str | Path, formats: list[str], out_dir: str | Path | None = None, width: int | None = None,
           height: int | None = None, scale: float = 2.0, title: str | None = None,
           force: bool = False, paper: str | None = None) -> list[Path]:
    """Writes the sidecar's figure in each format (paper: in the publication style at that column width);
    returns the files written (nothing when one would clash)."""
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ExportError(f"unknown format(s) {', '.join(bad)}; choose from {', '.join(FORMATS)}")
    for value, what in ((width, "--width"), (height, "--height")):
        if value is not None and not 10 <= value <= MAX_SIDE_PX:
            raise ExportError(f"{what} {value}: give 10 to {MAX_SIDE_PX} pixels")
    if not 0.1 <= scale <= 10:
        raise ExportError(f"--scale {scale}: give 0.1 to 10")
    fig = load_figure(sidecar)
    if paper is not None:
        try:
            fig = style.paper(fig, paper)
        except style.StyleError as e:
            raise ExportError(str(e)) from None
    if width or height:
        fig.update_layout(**({"width": width} if width else {}), **({"height": height} if height else {}))
    drawn = (fig.layout.width or 700) * (fig.layout.height or 500) * (scale ** 2 if "png" in formats else 1)
    if drawn > MAX_PIXELS:
        raise ExportError(f"{drawn / 1e6:.0f} million pixels to draw: at most {MAX_PIXELS / 1e6:.0f} (a smaller "
                          "--width, --height or --scale)")
    if title is not None:
        fig.update_layout(title_text=title)
    out = Path(out_dir) if out_dir else Path(sidecar).parent
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    targets = [out / f"{Path(sidecar).stem}.{fmt}" for fmt in formats]
    clash = [p for p in targets if p.exists()]
    if clash and not force:
        raise ExportError(f"{', '.join(p.name for p in clash)} would be overwritten in {out}: choose another --out, "
                          "or pass --force")
    images = [figure_bytes(fig, fmt, scale) for fmt in formats]   # (all drawn before any is written)
    if paper is not None and "svg" in formats:
        try:
            images[formats.index("svg")] = style.embed_font(images[formats.index("svg")])
        except style.StyleError as e:
            raise ExportError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    for path, data in zip(targets, images):   # (write_file: a temporary file of its own, created exclusively, renamed
        write_file(path, data)                # into place: no half file, no planted link followed)
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.render", description=__doc__.split("\n")[0])
    ap.add_argument("sidecar", help="a figure's .json, as the app's JSON button or analysis.export writes it")
    ap.add_argument("--format", nargs="+", default=["pdf"], choices=list(FORMATS))
    ap.add_argument("--out", default=None, help="directory to write to (default: beside the sidecar)")
    ap.add_argument("--width", type=int, default=None, help="pixels")
    ap.add_argument("--height", type=int, default=None, help="pixels")
    ap.add_argument("--scale", type=float, default=2.0, help="PNG pixels per figure pixel")
    ap.add_argument("--title", default=None, help="replace the figure's title ('' for none)")
    ap.add_argument("--paper", choices=list(style.COLUMNS), default=None,
                    help="publication style at a one- or two-column width (3.5 or 7 in)")
    ap.add_argument("--force", action="store_true", help="overwrite files already there")
    args = ap.parse_args(argv)
    try:
        written = render(args.sidecar, args.format, args.out, args.width, args.height, args.scale, args.title,
                         args.force, args.paper)
    except (ExportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
