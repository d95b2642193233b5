"""The bench tables at projector width (80 and 100 columns), from the committed results: every number cell
printed whole (never cut with '…'), and data with brackets ([interpreter], shapes) kept, not read as markup."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from stagewise.bench.commands.batching import batching_table
from stagewise.bench.commands.modes import add_ratios, modes_table
from stagewise.bench.commands.soak import soak_table
from stagewise.bench.commands.stages import stages_table
from stagewise.trace.fit import FitTable

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "amd-epyc-2t"


def tables_in(renderable) -> list[FitTable]:
    if isinstance(renderable, FitTable):
        return [renderable]
    return [t for part in getattr(renderable, "renderables", []) for t in tables_in(part)]


def soak_result() -> dict:
    summary = {"requests": 150, "lost": 0, "note": "[num_slots, Hkv, d] stays free"}
    return {"summary": summary}


def stage_result() -> dict:
    result = json.loads((RESULTS / "stages.json").read_text())
    result["rows"][0]["note"] = "skipped: [num_tokens] too big"  # a note with brackets (shown as "[note]")
    return result


def built() -> list:
    modes = json.loads((RESULTS / "modes.json").read_text())
    for by_length in modes["summary"].values():  # results older than the TPS column: TPS = 1 / TBT
        for row in by_length.values():
            row.setdefault("tps", 1000 / row["tbt_ms"])
    add_ratios(modes)  # as run_modes does before the table
    batching = json.loads((RESULTS / "batching.json").read_text())
    return [modes_table(modes), batching_table(batching), stages_table(stage_result()), soak_table(soak_result())]


@pytest.mark.parametrize("width", [80, 100])
def test_bench_tables_whole_numbers_and_brackets(width):
    console = Console(file=io.StringIO(), width=width, no_color=True)
    renderables = built()
    for renderable in renderables:
        console.print(renderable)
    out = console.file.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) <= width
    for table in (t for r in renderables for t in tables_in(r)):
        for row in table.rows:
            for col, cell in zip(table.cols, row):
                if not col.wrap:
                    assert cell.plain in out, (width, cell.plain)
    words = out.split()
    for word in "[num_tokens] [num_slots, Hkv, d]".split():
        assert word in words, word
