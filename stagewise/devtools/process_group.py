"""Run a command in a process group of its own, and on timeout kill the whole group.

`subprocess.run(..., timeout=...)` kills only the child it started. A child that started
workers of its own (pytest-xdist, a compile pool, a server) leaves them running, on a GPU
machine still holding device memory. Started with `start_new_session=True`, the child and
everything it spawns share one process group, and `os.killpg` ends them all at once.

A child that itself runs a command this way (the device check's tests section runs pytest)
puts that one in a group of its own, out of reach of its parent's `killpg`. So the kill is
two-step: SIGTERM to the group first, which `forward_terminate()` in the child turns into a
kill of the groups it started, then SIGKILL to whatever is left.
"""

import os
import signal
import subprocess

_live_groups: set[int] = set()  # groups this process started and has not yet seen end


def _kill_group(pgid: int, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM (a child passes it on to its own groups), a moment's grace, then SIGKILL."""
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=1)  # the child's handler has killed its own groups and exited
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid)


def forward_terminate() -> None:
    """In a child: on SIGTERM, kill every group this process started, then exit."""

    def handler(signum, frame):
        for pgid in list(_live_groups):
            _kill_group(pgid)
        os._exit(143)

    signal.signal(signal.SIGTERM, handler)


def run_in_group(cmd: list[str], timeout: float, **kwargs) -> tuple[str, int | str]:
    """Run `cmd` (stdout and stderr together) -> (its output, its exit code or "timeout").

    On timeout the group is killed and the output so far is kept; after a normal exit any
    process the command left behind in its group is killed too."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
        start_new_session=True, **kwargs,
    )  # fmt: skip
    _live_groups.add(proc.pid)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        _terminate(proc)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired as exp:  # a process outside the group holds the pipe open
            raw = exp.output or ""
            out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        out = (out or "") + f"\n[timed out after {timeout:.0f} s: its process group was killed]"
        code = "timeout"
    _kill_group(proc.pid)  # leftovers of a finished command (its workers, say)
    _live_groups.discard(proc.pid)
    return out or "", code
