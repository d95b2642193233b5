"""Ctrl-C that cannot tear the engine's bookkeeping in half.

Python turns SIGINT into a `KeyboardInterrupt` raised between two bytecodes of
the main thread, wherever it happens to be. Inside a forward pass that is what
we want: the step is undone and recomputed later. Inside the few lines that
move a request between the scheduler's queues, the block manager and the
block table, an interrupt between two of them leaves a block-table row or a
block that nobody owns; a later request then finds the pool empty.

`deferred_interrupts()` makes such a section atomic with respect to Ctrl-C:
while it runs, a SIGINT is only noted; when the section ends, the previous
handler is put back and the interrupt is delivered (a `KeyboardInterrupt`
from there) — unless one is already propagating, or the section is a
generator's cleanup on close (Python could only print an exception raised
there). The sections are short (list and dict moves, a few
microseconds), so Ctrl-C still feels instant. Python runs signal handlers in
the main thread only, and only the main thread may install one: in any other
thread the section runs as it is, since no `KeyboardInterrupt` can land there.

The engine also repairs what an interrupt outside a section could leave
(`PagedRunner.repair`), so the two together keep it usable after any number
of interrupts.
"""

import signal
import sys
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupts():
    """Run the body with SIGINT held back; deliver it (once) when the body is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    if previous is None:  # a handler installed outside Python: what Python can put back instead
        previous = signal.SIG_DFL
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            _deliver(previous)


def _deliver(handler) -> None:
    """Hand a held-back SIGINT to the handler that was in place before the section."""
    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return  # an interrupt is already on its way up: a second one says nothing new
    if isinstance(sys.exc_info()[1], GeneratorExit):
        # A stream being closed, most often by the garbage collector after an interrupt in the
        # consumer's loop: an exception raised from there is only printed ("Exception ignored").
        return
    if handler is signal.SIG_IGN:
        return
    if callable(handler):
        handler(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
    else:  # SIG_DFL (or a handler installed outside Python): what Ctrl-C would have done
        raise KeyboardInterrupt
