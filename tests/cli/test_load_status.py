"""Load phases and progress on stderr: shown on a terminal, never on stdout, in --out files or in a pipe.

The commands run as real processes whose stderr is a pseudo-terminal (or a pipe), on a tiny GGUF written here.
"""

import os
import pty
import select
import subprocess
import sys

import pytest

from tests.checkpoints import hf_tiny_model, write_gguf

ENV = {k: v for k, v in os.environ.items() if k != "STAGEWISE_QUIET"}
ENV |= {"COLUMNS": "120", "TERM": "xterm-256color", "HF_HUB_OFFLINE": "1"}
PHASES = ("reading the GGUF metadata and tokenizer of tiny.gguf", "reading the weights", "building the engine")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_tiny_model())


def run(args: list[str], stderr_tty: bool, env: dict | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `stagewise <args>`; stderr a pseudo-terminal when `stderr_tty`."""
    cmd = [sys.executable, "-m", "stagewise.cli", *args]
    if not stderr_tty:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, timeout=300)
        return res.returncode, res.stdout, res.stderr
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=terminal, env=env or ENV)
    os.close(terminal)
    err = b""
    while True:  # drain the terminal while the process runs (a full pty would block it)
        ready, _, _ = select.select([controller], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the process closed its end
                chunk = b""
            if not chunk and proc.poll() is not None:
                break
            err += chunk
        elif proc.poll() is not None:
            break
    out = proc.stdout.read().decode()
    proc.wait(timeout=60)
    os.close(controller)
    return proc.returncode, out, err.decode(errors="replace")


def test_trace_shows_each_load_phase_on_a_terminal_only(tiny_gguf, tmp_path):
    """The real command in its own process, its stderr a terminal: a line per phase there, none in --out."""
    target = tmp_path / "trace.txt"
    args = ["trace", "Hi", "--model", str(tiny_gguf), "--max-tokens", "1", "--out", str(target)]
    code, _, err = run(args, stderr_tty=True)
    assert code == 0, err
    for phase in PHASES:
        assert phase in err, f"{phase!r} not on the terminal: {err!r}"
    assert "embedding" in target.read_text() and not any(p in target.read_text() for p in PHASES)


@pytest.fixture
def stderr_as(monkeypatch):
    """stderr_as("terminal" | "pipe") -> read(): this process's stderr becomes a pseudo-terminal or a pipe."""
    opened = []

    def redirect(kind: str):
        reader, writer = pty.openpty() if kind == "terminal" else os.pipe()
        stream = os.fdopen(writer, "w")
        monkeypatch.setattr(sys, "stderr", stream)
        opened.append((reader, stream))

        def read() -> str:
            sys.stderr.flush()
            shown = b""
            while select.select([reader], [], [], 0.2)[0]:
                chunk = os.read(reader, 65536)
                if not chunk:
                    break
                shown += chunk
            return shown.decode(errors="replace")

        return read

    yield redirect
    for reader, stream in opened:
        stream.close()
        os.close(reader)


@pytest.mark.parametrize("where", ["terminal", "quiet terminal", "pipe"])
def test_load_status_only_on_a_terminal(tiny_gguf, monkeypatch, stderr_as, where):
    """STAGEWISE_QUIET=1 or a stderr that is not a terminal: nothing at all."""
    from stagewise.bench.harness.progress import load_status
    from stagewise.engine.llm import LLM

    read = stderr_as("pipe" if where == "pipe" else "terminal")
    if where == "quiet terminal":
        monkeypatch.setenv("STAGEWISE_QUIET", "1")
    else:
        monkeypatch.delenv("STAGEWISE_QUIET", raising=False)
    with load_status():
        LLM(str(tiny_gguf), mode="kv")
    text = read()
    if where == "terminal":
        assert all(p in text for p in PHASES), text
        assert "building the engine (backend torch): " in text  # each phase's line, its tier and time
    else:
        assert text == ""


def test_bench_progress_goes_to_the_terminal_not_the_results(tmp_path, capsys, monkeypatch, stderr_as):
    from stagewise.cli.bench import soak

    read = stderr_as("terminal")
    monkeypatch.delenv("STAGEWISE_QUIET", raising=False)
    threads = __import__("torch").get_num_threads()
    try:
        soak(model="tiny", out=str(tmp_path), quick=True, threads=None, num_requests=12, kv_blocks=24, max_num_seqs=8,
             seed=0, overwrite=False, speculative_config=None, speculative=None, prefix_cache=None)  # fmt: skip
    finally:
        __import__("torch").set_num_threads(threads)
    shown, out = read(), capsys.readouterr().out
    assert "soak" in shown and "building the engine" in shown  # the bar's row and a load phase
    assert "building the engine" not in out and "building" not in (tmp_path / "soak.json").read_text()
