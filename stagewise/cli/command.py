"""How every command ends: a result, or one line on stderr and a known exit status.

Every command-line entry point (`stagewise`, `trace`, `python -m stagewise.cli.bench`,
`python -m stagewise.cli.calc`) runs its Typer app through `run_command`, so they all behave alike:

    exit 0    done
    exit 2    bad input: a `StagewiseError` or a bad option, one line (`error: ...`)
    exit 130  interrupted (Ctrl-C): one line, no traceback, no half-written file
    exit 1    an unexpected exception: one line naming it, and the advice to rerun
              with --debug, which shows the traceback

It imports only `errors`, so `cli/bench.py` and `cli/calc.py` run on their own (`python -m`) through it
without loading the `stagewise` command's module.
"""

import os
import sys

import typer

from stagewise.errors import StagewiseError

DEBUG_FLAG = "--debug"
INTERRUPTED = 130  # 128 + SIGINT, the shell's convention


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


def run_command(app: typer.Typer, prepare=None) -> None:
    """Run a Typer app with stagewise's exit statuses (see the module docstring).

    `prepare()` (registering commands: slow imports) runs inside the same guard, so
    Ctrl-C while torch is still loading is an interruption like any other.
    """
    debug = take_debug_flag(sys.argv)
    try:
        check_utf8_arguments(sys.argv)
        if prepare is not None:
            prepare()
        status = app(standalone_mode=False)
    except StagewiseError as exc:
        fail(f"error: {exc}", 2)
    except KeyboardInterrupt:
        fail("interrupted", INTERRUPTED)
    except Exception as exc:
        if is_click("Abort", exc):  # click turns Ctrl-C during its own prompts into Abort
            fail("interrupted", INTERRUPTED)
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
        fail("interrupted", INTERRUPTED)
    if isinstance(status, int) and status:
        raise SystemExit(status)
