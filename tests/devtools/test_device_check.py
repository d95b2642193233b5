"""The device check's orchestration in a CPU dry run: sections in child processes, JSON + markdown out.

The full dry run (every section, tiny shapes) is `bash benchmarks/gpu/run.sh --dry-run`; CI runs the
two cheapest sections, enough to prove the command starts, runs children and writes its files.
"""

import json
import subprocess
import sys


def test_dry_run_writes_results_and_tables(tmp_path):
    cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, "--sections", "env,tests"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "device_check.json").read_text())
    assert results["dry_run"] is True
    env, tests = results["sections"]["env"], results["sections"]["tests"]
    assert env["copy"]["gb_per_s"] > 0 and env["machine"]["torch"]
    assert tests["returncode"] == 0 and "collected" in tests["summary"]
    md = (tmp_path / "device_check.md").read_text()
    assert md.startswith("# Device check (dry run") and "copy bandwidth" in md
    assert "== env" in (tmp_path / "log.txt").read_text()


def test_unknown_section_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "stagewise.devtools.device_check", "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, "--sections", "env,warp"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown sections ['warp']" in proc.stderr


SAMPLE_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def test_report_names_failures_even_when_the_run_is_cut_short(tmp_path):
    """The tests section's parser on real pytest -v output: whole, and cut before the summary (a timeout)."""
    from stagewise.devtools.device_check import test_report

    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", "-rfE", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    whole = test_report(proc.stdout)
    assert whole["counts"] == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1}, proc.stdout
    assert sorted(f.split()[0] for f in whole["failures"]) == ["ERROR", "FAILED"]
    assert any("test_fails" in f and "assert 1 == 2" in f for f in whole["failures"])  # the summary's reason
    assert "1 failed, 1 passed, 1 skipped, 1 error" in whole["summary"]
    cut = proc.stdout[: proc.stdout.index("short test summary")]  # what a killed run leaves
    assert sorted(f.split("::")[-1] for f in test_report(cut)["failures"]) == ["test_errors", "test_fails"], cut


def test_report_reads_xdist_lines():
    """pytest-xdist -v (the device machine runs 8 workers) prints the worker and progress first."""
    from stagewise.devtools.device_check import test_report

    stdout = "\n".join([
        "[gw1] [  3%] PASSED tests/engine/test_host_sync.py::test_counter_sees_every_kind_of_read[item]",
        "[gw0] [  6%] FAILED tests/engine/test_cuda_graphs.py::test_graph_path_gives_the_eager_tokens[triton]",
        "[gw2] [  9%] SKIPPED tests/kernels/test_precision.py::test_tf32 ",
        "[gw3] [ 12%] ERROR tests/models/test_triton_model.py::test_per_stage_override",
    ])  # fmt: skip
    report = test_report(stdout)
    assert report["counts"] == {"PASSED": 1, "FAILED": 1, "ERROR": 1, "SKIPPED": 1}
    assert report["failures"] == [
        "FAILED tests/engine/test_cuda_graphs.py::test_graph_path_gives_the_eager_tokens[triton]",
        "ERROR tests/models/test_triton_model.py::test_per_stage_override",
    ]
