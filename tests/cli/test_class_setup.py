"""What a class's first minute writes and runs: the README's output files are ignored by git, and
`make notebook` as root asks JupyterLab for --allow-root (which it refuses to start without)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", ["trace.json", "benchmarks/results/amd-epyc-2t/quick/modes.json"])
def test_readme_outputs_are_ignored(path):
    res = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
    assert res.returncode == 0, f"{path} is not in .gitignore"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_notebook_allows_root_only_as_root():
    res = subprocess.run(["make", "-n", "notebook"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    line = next(x for x in res.stdout.splitlines() if "jupyter lab" in x)
    assert ("--allow-root" in line) == (os.getuid() == 0)
