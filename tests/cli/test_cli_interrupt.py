"""Ctrl-C during a long command: exit 130, one line, no traceback, the old output file intact, no temp file.

The subprocess cases send a real SIGINT once the command is at work (it has
used more CPU than a whole short run needs, so the imports are over and the
run has begun); the in-process cases
raise KeyboardInterrupt at the precise moments a signal is hardest to survive:
while the trace is rendered and while a benchmark's PNG is being written.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagewise import cli

ENV = {**os.environ, "STAGEWISE_QUIET": "1", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "120"}
OLD = "the old result, which must survive\n"


# A whole short run (imports, model, one token) takes ~2.5 s of CPU (more in a fresh clone, which compiles its
# bytecode first); past 4 s the command is at work. Each command below (naive recompute: quadratic work) has
# many seconds left then, so the signal never lands in interpreter shutdown (where Python has restored the
# default handler: exit -2). `generate` samples, so it ignores the end-of-sequence token: a sampled EOS would
# otherwise end it after a token or two.
AT_WORK_CPU_S = 4.0


# `python -m stagewise.cli ARGS` with Ctrl-C's usual handler: a test run started as a background job (`make test &`)
# hands its children SIGINT ignored, and a Python started that way keeps ignoring it.
AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'stagewise'; runpy.run_module('stagewise.cli', run_name='__main__', alter_sys=True)"
)


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used so far (all threads), from /proc; unlike wall time, load does not stretch it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def interrupt_when_busy(args: list[str], cwd: Path, sig: int = signal.SIGINT) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *args],
        cwd=cwd,
        env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while cpu_seconds(proc.pid) < AT_WORK_CPU_S and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"the command ended before it could be interrupted: {proc.communicate()}"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp-" in p.name]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see when the command is at work")
@pytest.mark.parametrize(
    ("args", "target"),
    [
        (
            ["trace", "a", "b", "c", "--model", "tiny", "--mode", "naive", "--max-tokens", "800"]
            + ["--layers", "all", "--out", "t.txt"],
            "t.txt",
        ),
        (["bench", "modes", "--model", "tiny", "--out", ".", "--output-lengths", "2,400", "--overwrite"], "modes.json"),
        (
            ["generate", "hi", "--model", "tiny", "--mode", "naive", "--max-tokens", "1000"]
            + ["--temperature", "0.5", "--seed", "0", "--ignore-eos"],
            None,
        ),
    ],
    ids=["trace --out", "bench modes", "generate"],
)
def test_sigint_exits_130_and_keeps_the_old_file(tmp_path, args, target):
    if target:
        (tmp_path / target).write_text(OLD)
    res = interrupt_when_busy(args, tmp_path)
    assert res.returncode == 130, (res.returncode, res.stderr)
    assert res.stderr.strip().splitlines()[-1] == "interrupted", res.stderr
    assert "Traceback" not in res.stderr
    if target:
        assert (tmp_path / target).read_text() == OLD
    assert leftovers(tmp_path) == []


TRACE_OUT = ["trace", "a", "b", "c", "--model", "tiny", "--mode", "naive", "--max-tokens", "800", "--layers", "all"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see when the command is at work")
def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    """`kill PID` (or a job scheduler's time limit) during `trace --out`: exit 143, one line, no temp file."""
    (tmp_path / "t.txt").write_text(OLD)
    res = interrupt_when_busy([*TRACE_OUT, "--out", "t.txt"], tmp_path, signal.SIGTERM)
    assert res.returncode == 143, (res.returncode, res.stderr)
    assert res.stderr.strip().splitlines()[-1] == "terminated" and "Traceback" not in res.stderr
    assert (tmp_path / "t.txt").read_text() == OLD and leftovers(tmp_path) == []


# The console script's own lines, with Ctrl-C's usual handler (see AS_FROM_A_TERMINAL). "ready" comes once Python
# has started, before the script imports stagewise.cli: the light entry point takes milliseconds, then typer,
# rich and torch load for a second or more, so a signal 0.1-0.2 s later lands in those imports.
AS_THE_CONSOLE_SCRIPT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); print('ready', flush=True); "
    "from stagewise.cli import main; sys.argv[0] = 'stagewise'; sys.exit(main())"
)
IMPORTING_S = (0.1, 0.2)


def test_ctrl_c_while_the_command_line_imports_is_one_line():
    """Ctrl-C in the first fraction of a second: typer, rich and torch are still loading."""
    args = ["generate", "hi", "--model", "tiny", "--mode", "naive", "--max-tokens", "1000", "--ignore-eos"]
    procs = []
    for delay in IMPORTING_S:
        proc = subprocess.Popen(
            [sys.executable, "-c", AS_THE_CONSOLE_SCRIPT, *args],
            env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline() == "ready\n"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        procs.append(proc)
    for proc, delay in zip(procs, IMPORTING_S):
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err.strip()) == (130, "interrupted"), (delay, proc.returncode, err[-2000:])


def test_a_closed_stdout_pipe_is_quiet():
    """`stagewise generate ... | head -c1`: the reader goes away; exit 141 (as SIGPIPE), nothing on stderr."""
    args = ["generate", "hi", "--model", "tiny", "--max-tokens", "300", "--ignore-eos"]
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *args],
        env={**ENV, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert len(proc.stdout.read(1)) == 1  # the first byte of the answer...
    proc.stdout.close()  # ...and the reader is gone, as `head -c1` exits
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=120), err) == (141, "")


def run_in_process(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["stagewise", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["tree", "table", "json"])
def test_interrupt_while_the_trace_is_rendered(tmp_path, monkeypatch, capsys, fmt):
    """rich lays the tree out inside Console.print; the JSON is built by to_json: Ctrl-C lands there."""
    import rich.console

    import stagewise.trace.export as export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rich.console.Console, "print", interrupted)
    monkeypatch.setattr(export, "to_json", interrupted)
    out = tmp_path / "trace.txt"
    out.write_text(OLD)
    argv = ["trace", "hi", "--model", "tiny", "--format", fmt, "--out", str(out)]
    code, err = run_in_process(argv, monkeypatch, capsys)
    assert (code, err.strip()) == (130, "interrupted")
    assert out.read_text() == OLD and leftovers(tmp_path) == []


def test_interrupt_while_the_png_is_written(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    real_savefig = Figure.savefig

    def half_written(self, path, *args, **kwargs):
        real_savefig(self, path, *args, **kwargs)  # the temporary file is complete...
        raise KeyboardInterrupt  # ...and Ctrl-C lands before the rename

    monkeypatch.setattr(Figure, "savefig", half_written)
    for name in ("modes.json", "modes.png"):
        (tmp_path / name).write_text(OLD)
    argv = ["bench", "modes", "--model", "tiny", "--out", str(tmp_path), "--modes", "kv", "--overwrite"]
    code, err = run_in_process(
        [*argv, "--prompt-tokens", "4", "--output-lengths", "4", "--repeats", "1"], monkeypatch, capsys
    )
    assert (code, err.strip()) == (130, "interrupted")
    assert (tmp_path / "modes.png").read_text() == OLD
    assert (tmp_path / "modes.json").read_text() == OLD  # the pair lands together or not at all
    assert leftovers(tmp_path) == []


def test_a_failed_plot_keeps_the_old_json_and_png(tmp_path):
    """The JSON is complete when the plot fails: it must not be renamed over the old one alone."""
    from rich.console import Console

    from stagewise.cli.bench import finish

    def failing_plot(result, path):
        path.write_bytes(b"\x89PNG half")  # a real partial write into the temporary file...
        raise OSError(28, "No space left on device")  # ...then the disk is full

    for name in ("soak.json", "soak.png"):
        (tmp_path / name).write_text(OLD)
    with pytest.raises(OSError, match="No space"):
        finish(Console(quiet=True), {"benchmark": "soak", "summary": {}}, "table", failing_plot, tmp_path, "soak")
    assert [(tmp_path / n).read_text() for n in ("soak.json", "soak.png")] == [OLD, OLD]
    assert leftovers(tmp_path) == []


def test_atomic_path_keeps_the_old_file_on_failure(tmp_path):
    from stagewise.files import atomic_path, write_text_atomic

    target = tmp_path / "out.json"
    target.write_text(OLD)
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("failed mid-write")
    assert target.read_text() == OLD and leftovers(tmp_path) == []
    write_text_atomic(target, "new\n")
    assert target.read_text() == "new\n" and leftovers(tmp_path) == []
