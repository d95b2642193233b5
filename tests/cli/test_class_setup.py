"""What a class's first minute writes and runs: the README's output files are ignored by git,
`make notebook` as root asks JupyterLab for --allow-root (which it refuses to start without), and the
notebooks' kernel is there after the install alone."""

import os
import shutil
import subprocess
import sys
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


def test_the_notebooks_kernel_runs_without_make_notebook():
    """The notebooks name the kernel "stagewise"; scripts/install.sh registers it inside the .venv, so a
    Jupyter run from the .venv (`.venv/bin/jupyter execute`, nbclient) starts it by that name."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    spec = KernelSpecManager().get_kernel_spec("stagewise")
    assert Path(spec.argv[0]).parent == Path(sys.executable).parent, spec.argv  # this .venv's Python
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import stagewise\nprint(stagewise.__version__)")])
    nb.metadata["kernelspec"] = {"name": "stagewise", "display_name": "Python (stagewise)", "language": "python"}
    NotebookClient(nb, timeout=120).execute()  # the kernel named by the notebook, no kernel_name given
    from stagewise import __version__

    assert nb.cells[0].outputs[0]["text"] == __version__ + "\n"
