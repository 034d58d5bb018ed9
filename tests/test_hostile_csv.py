"""CSV exports a spreadsheet opens: no cell built from user text, a token, a directory name or a card field is
evaluated as a formula (a leading =, +, -, @, tab or carriage return)."""
from __future__ import annotations

import csv
import io
import random

import pandas as pd

from analysis.export import csv_bytes
from models import trace
from models.files import FORMULA_STARTS, spreadsheet_safe

HOSTILE = ["=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1:A2)", "\tcmd", "\r=1", "=cmd|' /C calc'!A0"]


def _cells(data: bytes) -> list[list[str]]:
    return list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))


def _evaluable(cell: str) -> bool:
    return cell.startswith(FORMULA_STARTS)


def test_every_text_cell_and_header_is_neutralised_and_numbers_stay_numbers():
    rng = random.Random(0)
    words = HOSTILE + ["plain", "", " =spaced", "a=b", "'quoted"]
    table = pd.DataFrame({"token": [rng.choice(words) for _ in range(200)],
                          "=model": [rng.choice(words) for _ in range(200)],
                          "logprob": [-rng.random() for _ in range(200)],
                          "layer": [rng.randrange(-3, 30) for _ in range(200)],
                          "dropped": [rng.random() < 0.5 for _ in range(200)]})
    rows = _cells(csv_bytes(table))
    assert not any(_evaluable(c) for c in rows[0] + [r[0] for r in rows[1:]] + [r[1] for r in rows[1:]])
    back = pd.read_csv(io.BytesIO(csv_bytes(table)), keep_default_na=False)
    assert (back["logprob"] == table["logprob"]).all() and (back["layer"] == table["layer"]).all()
    for got, want in zip(back["token"], table["token"]):   # the text itself is kept, after the apostrophe
        assert got == ("'" + want if _evaluable(want) else want)


def test_a_generation_trace_csv_neutralises_its_tokens():
    steps = [{c: 0 for c in trace.STEP_COLUMNS} | {"token": tok, "live_per_layer": [1]} for tok in HOSTILE]
    text = trace.steps_csv({"n_layers": 1, "steps": steps})
    tokens = [r[trace.STEP_COLUMNS.index("token")] for r in _cells(text.encode())[1:]]
    assert len(tokens) == len(HOSTILE) and not any(_evaluable(t) for t in tokens)


def test_spreadsheet_safe_leaves_other_values_alone():
    assert spreadsheet_safe(-1.5) == -1.5 and spreadsheet_safe(3) == 3 and spreadsheet_safe("x=1") == "x=1"
    assert all(spreadsheet_safe(s) == "'" + s for s in HOSTILE)
