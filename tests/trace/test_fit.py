"""FitTable: at any width, every number cell is printed whole (never cut or wrapped), brackets are not markup."""

import io

import pytest
from rich.console import Console

from stagewise.trace.fit import Col, FitTable

ROWS = [
    ["prefill", "121.6 PFLOP", "862.4 GB", "1.41e+05", "2.05 min", "compute-bound", "x [num_tokens=5, hidden=576]"],
    ["decode", "1.633 TFLOP", "859.1 GB", "1.901", "1.65 ms", "memory-bound", "cache [num_slots, Hkv, d]"],
]
COLS = [Col("step"), *(Col(h, "right") for h in ("FLOPs", "bytes moved", "FLOP/B", "time")), Col("verdict")]
COLS.append(Col("what it reads", wrap=True, min_width=12))


def render(renderable, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, no_color=True)
    console.print(renderable)
    return console.file.getvalue()


@pytest.mark.parametrize("width", [40, 60, 80, 100, 200])
def test_numbers_whole_at_every_width(width):
    out = render(FitTable("One step", COLS, ROWS), width)
    assert "…" not in out and "..." not in out
    assert max(len(line) for line in out.splitlines()) <= width
    for row in ROWS:
        for cell in row[:6]:  # number and short text cells: on one line, whole
            assert cell in out, (width, cell, out)
    words = " ".join(out.split())
    for word in "[num_tokens=5, hidden=576] [num_slots, Hkv, d]".split():  # wrapped, never dropped as markup
        assert word in words


def test_wide_terminal_one_table_narrow_terminal_several():
    wide, narrow = render(FitTable("One step", COLS, ROWS), 200), render(FitTable("One step", COLS, ROWS), 80)
    assert "(continued)" not in wide
    assert "(continued)" in narrow
    assert narrow.count("prefill") >= 2  # the key column repeats in each table
