"""Every command-line entry point of stagewise, in one package at the top of the layers.

- `main`     the `stagewise` script: generate, stages, and the commands below
- `trace`    `stagewise trace` (also the `trace` script): the shape flow of a run
- `bench`    `stagewise bench modes|batching|stages|soak` (`python -m stagewise.cli.bench` alone)
- `calc`     `stagewise calc`, the calculator (`python -m stagewise.cli.calc` alone)
- `command`  `run_command`: how every command ends (exit 0, 2 for bad input, 130 for Ctrl-C, 1 otherwise)

`pyproject.toml` names `stagewise.cli:main` and `stagewise.cli:trace_main`; `python -m stagewise.cli` runs `main`.

This file stays light on purpose: it imports nothing slow. The entry points below first install the signal
handling (through `command`, which needs only the standard library), then import typer, rich and torch with
Ctrl-C and SIGTERM held: a signal that arrives while they load takes effect when they are loaded (one line,
exit 130 or 143). Raised in the middle of those imports, it would print a traceback out of importlib, be
swallowed (torch's C extension discards errors while it imports numpy) or abort the process (raised
inside torch's C++ start-up, it cannot unwind). Only Python's own start-up, before this file runs (the
first ~0.1 s), is out of reach.
"""

import importlib
import os
import shutil
import sys
import types

RICH_HELP_COLUMNS = 100  # narrower than this, help is click's plain layout (see _fit_help)


def main() -> None:
    """Entry point of the `stagewise` script."""
    _start("main")


def trace_main() -> None:
    """Entry point of the `trace` script: `stagewise trace` under its own name."""
    _start("trace_main")


def _fit_help() -> None:
    """Below ~100 columns (a projector at 80), Rich's help panels cut option names and long words with
    an ellipsis (`--tensor-parallel-…`). There the help is click's plain layout instead, which wraps and
    never cuts: typer reads TYPER_USE_RICH when it is imported. A value the user set is kept."""
    if "TYPER_USE_RICH" not in os.environ and shutil.get_terminal_size().columns < RICH_HELP_COLUMNS:
        os.environ["TYPER_USE_RICH"] = "0"


def _start(entry: str) -> None:
    _fit_help()
    try:
        from stagewise.cli import command  # light: the standard library, errors and files

        command.install_signal_handlers()
        with command.signals_deferred():  # a signal now takes effect once these imports are complete
            commands = importlib.import_module("stagewise.cli.main")  # typer and rich
            importlib.import_module("torch")  # seconds; every command but --help needs it
    except KeyboardInterrupt:
        if "stagewise.cli.command" not in sys.modules:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        command.exit_interrupted()
    getattr(commands, entry)()


class _EntryPointPackage(types.ModuleType):
    """Keeps `stagewise.cli.main` the entry function above once the submodule of that name is imported.

    Importing a submodule sets it as an attribute of its package (`stagewise.cli.main = <module>`), which
    would replace the function after its first call; the module itself stays in `sys.modules`.
    """

    def __setattr__(self, name: str, value) -> None:
        if name == "main" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _EntryPointPackage

__all__ = ["main", "trace_main"]
