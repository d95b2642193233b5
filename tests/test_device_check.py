"""The device check's orchestration in a CPU dry run: sections in child processes, JSON + markdown out.

The full dry run (every section, tiny shapes) is `bash benchmarks/gpu/run.sh --dry-run`; CI runs the
two cheapest sections, enough to prove the command starts, runs children and writes its files.
"""

import json
import subprocess
import sys


def test_dry_run_writes_results_and_tables(tmp_path):
    cmd = [sys.executable, "-m", "stagewise.bench.device_check", "--dry-run", "--out", str(tmp_path)]
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
    cmd = [sys.executable, "-m", "stagewise.bench.device_check", "--dry-run", "--out", str(tmp_path)]
    proc = subprocess.run([*cmd, "--sections", "env,warp"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown sections ['warp']" in proc.stderr
