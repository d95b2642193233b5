"""One request in flight between an HTTP handler and the engine thread.

The handler (on the server's asyncio event loop) creates a `Handle` for its
`Request` and awaits `handle.events.get()`; the engine thread calls
`handle.push(event)` for each token. An asyncio queue may only be touched from
its own event loop, so `push` hands the `put` to that loop with
`call_soon_threadsafe`, which also wakes the waiting handler.
"""

import asyncio
from dataclasses import dataclass

from stagewise.engine.request import Request


@dataclass(frozen=True)
class Event:
    """What the engine thread hands a request's handler: one token's text, or the end."""

    text: str  # newly settled text (may be empty: a character or stop string still incomplete)
    token_id: int | None  # the sampled token; None on an error / abort event
    finished: bool  # the request's last event
    finish_reason: str | None  # "stop", "length", "abort" or "error" when finished
    error: str | None = None  # with "error": one line saying what failed


class Handle:
    """One request in flight: the engine's `Request` and the asyncio queue its handler reads."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.events: asyncio.Queue[Event] = asyncio.Queue()  # read by the handler only
        self._loop = loop  # the handler's event loop
        self.started = False  # scheduled at least once (no longer counted as waiting)
        self.aborted = False  # abort() was asked for
        self.done = False  # its last event was sent (engine thread only)

    def push(self, event: Event) -> None:
        """From the engine thread: queue an event and wake the handler."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down): nobody listens
            pass


async def events_of(handles: list["Handle"]):
    """(index in `handles`, event) from every handle's queue as they come, until each has finished:
    the n samples of one request (choice i is sample i) read together."""
    waiting = {asyncio.ensure_future(h.events.get()): i for i, h in enumerate(handles)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.get):  # several at once: in choice order
                index = waiting.pop(task)
                event = task.result()
                if not event.finished:
                    waiting[asyncio.ensure_future(handles[index].events.get())] = index
                yield index, event
    finally:
        for task in waiting:
            task.cancel()
