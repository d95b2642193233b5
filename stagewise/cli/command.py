"""How every command ends: a result, or one line on stderr and a known exit status.

Every command-line entry point (`stagewise`, `trace`, `python -m stagewise.cli.bench`,
`python -m stagewise.cli.calc`) runs its Typer app through `run_command`, so they all behave alike:

    exit 0    done
    exit 2    bad input: a `StagewiseError` or a bad option, one line (`error: ...`)
    exit 130  interrupted (Ctrl-C): one line, no traceback, no half-written file
    exit 143  terminated (SIGTERM, as `kill` or a job scheduler sends): handled like Ctrl-C
    exit 141  the reader of stdout went away (`stagewise generate ... | head`): quiet, as a Unix tool
              killed by SIGPIPE
    exit 1    an unexpected exception: one line naming it, and the advice to rerun
              with --debug, which shows the traceback

SIGTERM raises `Terminated`, a kind of KeyboardInterrupt, so every cleanup that Ctrl-C runs (temporary
files removed, requests aborted, tensor-parallel workers shut down) runs for it too.

It imports only `errors`, `files` and the standard library (no typer, no torch), so the entry points in
`stagewise/cli/__init__.py` install the signal handling through it before any slow import, and
`cli/bench.py` and `cli/calc.py` run on their own (`python -m`) through it.
"""

import errno
import os
import signal
import sys

from stagewise.errors import StagewiseError
from stagewise.files import signals_deferred

DEBUG_FLAG = "--debug"
INTERRUPTED = 130  # 128 + SIGINT, the shell's convention
TERMINATED = 143  # 128 + SIGTERM
BROKEN_PIPE = 141  # 128 + SIGPIPE


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds the program as Ctrl-C does, and the command exits with 143."""


_terminated = False  # set by the SIGTERM handler; the exit status and message depend on it


def _on_sigterm(signum, frame) -> None:
    global _terminated
    _terminated = True
    raise Terminated


def install_signal_handlers() -> None:
    """SIGTERM unwinds like Ctrl-C. A SIGTERM that the parent set to be ignored stays ignored."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def exit_interrupted() -> None:
    """One line and the shell's status for the signal that stopped the command."""
    if _terminated:
        fail("terminated", TERMINATED)
    fail("interrupted", INTERRUPTED)


def is_broken_pipe(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.EPIPE


def exit_broken_pipe() -> None:
    """The reader closed stdout: nothing more can be said there, so say nothing and exit 141.

    As Python's documentation advises (signal module, "Note on SIGPIPE"): stdout is pointed at /dev/null,
    so the interpreter's last flush of the unwritten output does not fail a second time.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is not a real file (a test's capture): nothing is flushed to a closed pipe then
    raise SystemExit(BROKEN_PIPE)


def take_debug_flag(argv: list[str]) -> bool:
    """Remove --debug from the arguments (any position before `--`); True if it was there."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = DEBUG_FLAG in argv[1:end]
    if found:
        argv[:] = [a for i, a in enumerate(argv) if not (0 < i < end and a == DEBUG_FLAG)]
    return found or os.environ.get("STAGEWISE_DEBUG") == "1"


def check_utf8_arguments(argv: list[str]) -> None:
    """Arguments that are not valid UTF-8 arrive as lone surrogates; refuse them by position."""
    for i, arg in enumerate(argv[1:], start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = arg.encode("utf-8", errors="replace").decode("utf-8")
            raise StagewiseError(f"argument {i} ({shown!r}) is not valid UTF-8") from None


def is_click(name: str, exc: BaseException) -> bool:
    """Is `exc` click's `name` exception? Typer may carry its own copy of click, so match by class name."""
    return any(cls.__name__ == name and "click" in cls.__module__ for cls in type(exc).__mro__)


def fail(message: str, status: int) -> None:
    print(message, file=sys.stderr)
    raise SystemExit(status)


def run_command(app, prepare=None) -> None:
    """Run a Typer app (`app`) with stagewise's exit statuses (see the module docstring).

    `prepare()` (registering commands: slow imports) runs inside the same guard, so
    Ctrl-C while torch is still loading is an interruption like any other.
    """
    global _terminated
    _terminated = False
    debug = take_debug_flag(sys.argv)
    try:
        install_signal_handlers()
        check_utf8_arguments(sys.argv)
        if prepare is not None:
            with signals_deferred():  # slow imports: a signal takes effect once they are complete
                prepare()
        status = app(standalone_mode=False)
    except StagewiseError as exc:
        fail(f"error: {exc}", 2)
    except KeyboardInterrupt:
        exit_interrupted()
    except SystemExit as exc:
        if is_broken_pipe(exc.__context__):  # typer turns EPIPE into a bare exit 1
            exit_broken_pipe()
        raise
    except Exception as exc:
        if is_broken_pipe(exc):
            exit_broken_pipe()
        if is_click("Abort", exc):  # click turns Ctrl-C during its own prompts into Abort
            exit_interrupted()
        if is_click("NoArgsIsHelpError", exc):  # no arguments at all: the help text
            exc.show()
            raise SystemExit(exc.exit_code) from None
        if is_click("ClickException", exc):  # a bad option or argument
            fail(f"error: {exc.format_message()} (see --help)", exc.exit_code)
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"error: unexpected {type(exc).__name__}: {first} (rerun with {DEBUG_FLAG} for the traceback)", 1)
    if status == INTERRUPTED:  # typer turns a KeyboardInterrupt inside the command into exit code 130
        exit_interrupted()
    if isinstance(status, int) and status:
        raise SystemExit(status)
