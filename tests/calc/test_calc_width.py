"""calc at projector width (80 and 100 columns): no cut number, every number of every table printed whole;
--tp and --hardware a100 say what is true of them."""

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from stagewise.calc.roofline import analyze, load_hardware, load_model_config
from stagewise.cli.calc import _print_analysis, _print_seeds
from stagewise.trace.fit import FitTable


def printed_tables(width: int, tp: int = 1):
    """Everything calc prints for the seeds' 405B (with --seeds, --explain), and the FitTables it printed."""
    tables = []
    console = Console(file=io.StringIO(), width=width, no_color=True)
    print_ = console.print
    console.print = lambda obj, *a, **k: (tables.append(obj) if isinstance(obj, FitTable) else None, print_(obj))
    a = analyze(load_model_config("llama-3-405b"), load_hardware("h100"), context=100_000, batch=1, dtype="bf16")
    _print_analysis(console, a, explain=True, tp=tp)
    _print_seeds(console, explain=True)
    return console.file.getvalue(), tables


@pytest.mark.parametrize("width", [80, 100])
def test_every_number_whole_at_projector_width(width):
    out, tables = printed_tables(width)
    assert len(tables) == 4  # the model, one step, speed of light, the seeds
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= width
    for table in tables:
        for row in table.rows:
            for col, cell in zip(table.cols, row):
                if not col.wrap:
                    assert cell.plain in out, (width, cell.plain)


ENV = {**os.environ, "NO_COLOR": "1", "COLUMNS": "80"}


def run_calc(*args: str) -> str:
    cmd = [sys.executable, "-m", "stagewise.cli.calc", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_tp_and_a100_say_what_is_true():
    out = run_calc("--tp", "8", "--hardware", "a100")
    assert "try --tp" not in out and "see the --tp 8 table below" in out
    assert "over NVLink 3 (A100 SXM, NVSwitch)" in out and "H100/H200" not in out
    assert "try --tp" in run_calc("--hardware", "a100")  # one device, and the weights do not fit
    out = run_calc("--tp", "8", "--hardware", "h200")
    assert "over NVLink 4 (H100/H200 SXM, NVSwitch)" in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
