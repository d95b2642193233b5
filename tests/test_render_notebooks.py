"""scripts/render_notebooks.py: a timing cell run on a busy machine is not written, and every render is logged.

A real kernel executes a two-cell notebook whose second cell is tagged `timing`; the load limit
is set below zero (STAGEWISE_BUSY_SHARE=-1), so any measured share of other processes is over it
and the render must refuse, then write it with --allow-load and say so in the log.
"""

import importlib.util
import json
from pathlib import Path

import jupytext
import nbformat
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "render_notebooks.py"
SOURCE = """# %%
import time

# %% tags=["timing"]
start = time.perf_counter()
time.sleep(0.6)  # long enough for the probe: 0.6 s of every core's time is over MIN_TICKS
print(f"slept {time.perf_counter() - start:.1f} s")
"""


@pytest.fixture
def renderer(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("render_notebooks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(module, "RENDER_LOG", tmp_path / "render_log.json")
    (tmp_path / "99_timed.py").write_text(SOURCE)
    return module


def test_a_contended_timing_cell_is_not_written_unless_allowed(renderer, tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEWISE_BUSY_SHARE", "-1")  # every known share is over the limit
    entry = renderer.render("99_timed", quick=True, allow_load=False)
    assert [c["cell"] for c in entry["timing_cells"]] == [1]
    assert entry["others_share_timing"] is not None, "the timing cell was too short for the probe"
    assert not entry["written"] and not (tmp_path / "99_timed.ipynb").exists()

    entry = renderer.render("99_timed", quick=True, allow_load=True)
    assert entry["written"] and entry["load_check_bypassed"]
    renderer.record({"99_timed": entry})
    log = json.loads((tmp_path / "render_log.json").read_text())
    assert log["99_timed"]["load_check_bypassed"] and log["99_timed"]["limit"] == -1
    assert 0 <= log["99_timed"]["others_share_timing"] <= 1 and log["99_timed"]["mode"] == "quick"
    nb = nbformat.read(tmp_path / "99_timed.ipynb", as_version=4)
    assert nb.cells[1].metadata["tags"] == ["timing"]  # the tag travels to the .ipynb
    assert nb.metadata["stagewise"]["source_sha256"] == renderer.source_hash(tmp_path / "99_timed.py")


def test_the_timing_cells_of_the_course_are_tagged():
    """Every notebook cell that times something with a clock, tagged; tags only on code cells."""
    notebooks = sorted((SCRIPT.parent.parent / "notebooks").glob("[0-9]*.py"))
    clocks = (
        "perf_counter",
        "stream_timed(",
        "step_costs(",
        "compare(",
        "do_bench",
        "run_stages(",
        "probe_this_machine",
    )
    for path in notebooks:
        for cell in jupytext.read(path).cells:
            tagged = "timing" in cell.metadata.get("tags", [])
            assert not tagged or cell.cell_type == "code", f"{path.name}: a markdown cell tagged timing"
            timed = cell.cell_type == "code" and any(c in cell.source for c in clocks)
            defines = cell.source.lstrip().startswith(("def ", "import ", "from ")) or "import os" in cell.source
            assert tagged or not timed or defines, f"{path.name}: untagged timing cell:\n{cell.source[:200]}"
