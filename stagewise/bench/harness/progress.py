"""What a long command is doing right now: load phases and progress bars on stderr.

    with load_status():                     # while a model loads: one line per phase
        llm = LLM("smollm2-135m")           # "reading the GGUF metadata ...", "building the engine"
    with progress("bench modes", total=6) as bar:
        for mode in modes:
            bar.update(f"mode {mode}")
            ...
            bar.advance()
    with bench_display() as live:           # a rich Progress (or None when off) for a benchmark's
        run_modes(settings, progress=live)  # own rows, with the load phases shown in it too

Everything here goes to stderr and disappears when done (rich's transient display), so
stdout and `--out` files hold only results. Off when stderr is not a terminal (a log, a
pipe, a test) and under STAGEWISE_QUIET=1: then nothing is printed at all.

A command may nest them (a benchmark that loads a model inside its progress bar): they
share one live display, each bar or phase one row of it.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_live = None  # the rich Progress every bar and phase shares while one is open
_users = 0  # how many open bars / load statuses use it


def enabled() -> bool:
    """True when stderr is a terminal and STAGEWISE_QUIET is not set."""
    return not os.environ.get("STAGEWISE_QUIET") and sys.stderr.isatty()


@contextmanager
def _display():
    """The shared live display, started by its first user and stopped by its last."""
    global _live, _users
    if _live is None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        _live = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),  # data, never markup
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=True,
            redirect_stdout=False,  # results on stdout stay on stdout
            redirect_stderr=False,
        )
        _live.start()
    _users += 1
    try:
        yield _live
    finally:
        _users -= 1
        if _users == 0:
            _live.stop()
            _live = None


class Bar:
    """One progress row; every method is a no-op when progress is off."""

    def __init__(self, live=None, task=None):
        self._live, self._task = live, task

    def advance(self, steps: float = 1) -> None:
        if self._live is not None:
            self._live.advance(self._task, steps)

    def update(self, description: str | None = None, total: float | None = None) -> None:
        if self._live is not None:
            fields = {"description": description} if description is not None else {}
            self._live.update(self._task, total=total, **fields)


@contextmanager
def progress(description: str, total: float | None = None) -> Iterator[Bar]:
    """A progress row for `total` steps (None: a count without an end), removed when done."""
    if not enabled():
        yield Bar()
        return
    with _display() as live, row(live, description, total) as bar:
        yield bar


@contextmanager
def row(live, description: str, total: float | None = None) -> Iterator[Bar]:
    """A row on a rich Progress `live` (a benchmark's `progress=`; None: nothing shown), removed
    at the end of the block."""
    if live is None:
        yield Bar()
        return
    task = live.add_task(description, total=total)
    try:
        yield Bar(live, task)
    finally:
        live.remove_task(task)


@contextmanager
def load_status() -> Iterator[None]:
    """Show every `load_phase` inside the block: a row while it runs, a line with its time after."""
    from stagewise.runtime import listen_to_load_phases  # (imports torch: only when shown)

    if not enabled():
        yield
        return
    rows = {}  # phase text -> its row

    def on_phase(text: str, seconds: float | None) -> None:
        if seconds is None:
            rows[text] = live.add_task(text, total=None)
            return
        live.remove_task(rows.pop(text))
        live.console.print(f"{text}: {seconds:.1f} s", markup=False, highlight=False, style="dim")

    with _display() as live, listen_to_load_phases(on_phase):
        try:
            yield
        finally:
            for row in rows.values():  # a phase that raised
                live.remove_task(row)


@contextmanager
def bench_display() -> Iterator[object]:
    """The shared rich `Progress` for a benchmark to add its rows to (None when progress is off),
    with every load phase inside the block shown as well."""
    if not enabled():
        yield None
        return
    with _display() as live, load_status():
        yield live
