"""One paged engine shared by every call on an `LLM`: whose tokens are whose, and who steps.

In paged mode an `LLM` keeps a single `PagedRunner` for its lifetime. Streams,
`generate` calls and requests added by hand (`add_request` / `step()`) all
put their requests into it, and each of them gets an *owner*: a live stream's
key, or `HAND`. Whichever call runs an engine step, every token event of that
step goes to its owner's inbox, and each call hands out only its own. A
stream therefore never waits for "its" step: if another stream (in this
thread, or in another thread) ran the step that sampled its token, the token
is already in its inbox.

Threads: every engine step, and every change to the owners, runs under the
`LLM`'s lock (a `threading.RLock`), so calls from several threads take turns
step by step. The lock is never held while a stream yields: a consumer that
stops between two tokens (to wait for another thread, or to pull from a
second stream) blocks nobody.

Closing a stream (a `break`, an exception, Ctrl-C, the iterator dropped) aborts
its unfinished requests. The first thing its cleanup does is note the stream
as closing; the rest runs with Ctrl-C deferred, and if a second interrupt
still cuts it short, the next engine call finishes it (`_close_streams`), so
no request is left running for an owner that is gone.
"""

import itertools
import threading
from collections import deque
from collections.abc import Iterator

from stagewise.engine.interrupts import deferred_interrupts
from stagewise.engine.outputs import TokenEvent
from stagewise.engine.paged_runner import PagedRunner
from stagewise.engine.request import Request, prompt_indices

HAND = "add_request"  # owner key of the requests added by hand


class SharedEngine:
    def __init__(self, runner: PagedRunner, lock: threading.RLock):
        self.runner = runner
        self.lock = lock  # the LLM's lock: held for each engine step, never across a yield
        # request id -> (owner key, index in its owner's list, the request)
        self._owner: dict[str, tuple[str, int, Request]] = {}
        self._inbox: dict[str, deque[TokenEvent]] = {HAND: deque()}  # owner -> events to hand out
        self._stream_requests: dict[str, list[Request]] = {}  # stream key -> its requests
        self._closing: list[str] = []  # streams whose cleanup began and may not have ended
        self._keys = itertools.count()
        self._num_hand = 0  # requests added by hand so far (their event index)

    # ---- streams ----

    def stream(self, requests: list[Request]) -> Iterator[TokenEvent]:
        """Queue `requests` as one stream's and yield their events; closing it aborts the rest."""
        runner = self.runner
        key = f"stream-{next(self._keys)}"
        try:
            with self.lock:
                for req in requests:  # all or nothing: check every request before queueing any
                    runner.check_fits(req)
                if not runner.has_unfinished():
                    runner.reset_stats()  # a run of its own: fresh counters
                with deferred_interrupts():
                    inbox = self._inbox[key] = deque()
                    self._stream_requests[key] = requests
                    index = prompt_indices(requests)  # parallel samples: their prompt's index
                    for req in requests:
                        self._owner[req.request_id] = (key, index[req.request_id], req)
                        runner.add(req)
            remaining = len(requests)
            while remaining:
                event = self._next_event(inbox)
                remaining -= event.finished
                yield event
        finally:
            self._closing.append(key)  # first: if this cleanup is cut short, the next call ends it
            with self.lock, deferred_interrupts():
                self._close_streams()

    def _next_event(self, inbox: deque[TokenEvent]) -> TokenEvent:
        while not inbox:
            with self.lock:
                if not inbox:  # another thread may have run the step while this one waited
                    self._step()
        return inbox.popleft()

    def _close_streams(self) -> None:
        """Abort the unfinished requests of every closing stream; idempotent, resumable."""
        while self._closing:
            key = self._closing[-1]
            for req in self._stream_requests.get(key, ()):
                if not req.finished:
                    self.runner.abort(req)
                self._owner.pop(req.request_id, None)
            self._inbox.pop(key, None)
            self._stream_requests.pop(key, None)
            self._closing.pop()
        self.runner.repair()  # an abort cut short may have left a row or blocks behind

    # ---- stepping ----

    def _step(self) -> None:
        """One engine iteration (the caller holds the lock); each event goes to its owner."""
        if self._closing:
            with deferred_interrupts():
                self._close_streams()
        if self.runner.has_unfinished():
            self.runner.step(deliver=self._deliver)

    def _deliver(self, results: list[tuple]) -> None:
        # a speculative step may give a request several tokens: only its last one can end it
        last = {id(req): i for i, (req, _, _) in enumerate(results)}
        for i, (req, token, delta) in enumerate(results):
            key, index, _ = self._owner[req.request_id]
            final = last[id(req)] == i
            self._inbox[key].append(TokenEvent.of(req, index, token, delta, final=final))
            if req.finished and final:
                del self._owner[req.request_id]

    # ---- stepping by hand ----

    def add(self, requests: list[Request]) -> None:
        """Queue a hand-added request: the n samples of one prompt (one event index)."""
        with self.lock, deferred_interrupts():
            for req in requests:
                self.runner.add(req)
                self._owner[req.request_id] = (HAND, self._num_hand, req)
            self._num_hand += 1

    def step(self) -> list[TokenEvent]:
        """One iteration; -> the events of hand-added requests (those sampled meanwhile too)."""
        with self.lock:
            if self.runner.has_unfinished():
                self._step()
            with deferred_interrupts():
                inbox = self._inbox[HAND]
                events = list(inbox)
                inbox.clear()
        return events

    def has_unfinished(self) -> bool:
        with self.lock:
            if self._closing:
                with deferred_interrupts():
                    self._close_streams()
            return self.runner.has_unfinished() or bool(self._inbox[HAND])
