"""scripts/install.sh skips pip when nothing it installs from has changed since its last complete run.

The script runs on a copy of pyproject.toml and itself, with a `.venv/bin/python` that is this
environment's Python but refuses `-m pip` (it leaves a mark instead): no package is installed here.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fake_checkout(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "${1:-}" = "-m" ] && [ "${2:-}" = "pip" ]; then touch "$(dirname "$0")/pip-ran"; exit 99; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return tmp_path


def install(checkout: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "scripts" / "install.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_an_unchanged_checkout_skips_pip_and_a_change_reinstalls(tmp_path):
    checkout = fake_checkout(tmp_path)
    pip_ran = checkout / ".venv" / "bin" / "pip-ran"
    res = install(checkout)  # no stamp yet: a first install, which runs pip
    assert res.returncode != 0 and pip_ran.exists()
    stamp = checkout / ".venv" / ".install-stamp"
    assert not stamp.exists(), "an install that did not finish left a stamp"
    # what a completed install writes: the hash of pyproject.toml and install.sh
    hashed = subprocess.run(
        ["bash", "-c", "source <(sed -n '/^inputs_hash()/,/^}/p' scripts/install.sh); VENV=.venv inputs_hash"],
        cwd=checkout, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    stamp.write_text(hashed)
    pip_ran.unlink()
    res = install(checkout)
    assert res.returncode == 0 and "up to date" in res.stdout and not pip_ran.exists(), res.stderr
    res = install(checkout, STAGEWISE_REINSTALL="1")
    assert res.returncode != 0 and pip_ran.exists()
    pip_ran.unlink()
    stamp.write_text(hashed)
    with open(checkout / "pyproject.toml", "a") as f:
        f.write("\n# a changed dependency list\n")
    res = install(checkout)
    assert res.returncode != 0 and pip_ran.exists(), "a changed pyproject.toml was not installed"
