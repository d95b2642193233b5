"""The engine loop: ONE background thread steps the engine; HTTP handlers only talk to it.

An HTTP server has many handlers running at once (one per connection, all on
one asyncio event loop), but an engine step is one batch for everyone. So one
thread owns the engine and does nothing but step it:

    handler (event loop)                     engine thread
    ---------------------                    ----------------------------------------
    req = llm.make_request(...)
    loop.submit(handle)  --> inbox -------->  take every new request into the engine
                                              step()  (one batch: prefills and decodes)
    await handle.events.get() <------------  each token -> its request's asyncio queue
                                              (loop.call_soon_threadsafe: the only safe
                                               way to wake an asyncio queue from a thread)

When nothing is in flight the thread sleeps on a condition variable: an idle
server uses no CPU. Requests join the running batch at the next step: that is
continuous batching, seen from the network.

The inbox is bounded: `max_queue` is the most requests waiting for a seat
(submitted and not yet scheduled). One more is refused with 503 at once, so a
flood of clients gets a clear "retry later" instead of a queue that grows
without bound while every client times out.

A handler whose client disconnects calls `abort(handle)`: at the next step
boundary the request leaves the scheduler and its KV blocks go back to the
free list. When that leaves nothing to run, the loop still settles the books
before it sleeps: the gauges and the live view show the request gone (an
"idle step": a snapshot of its own, nothing scheduled), not a running request
holding blocks until some later request arrives.

Two modes, the two halves of the batching comparison:

- "paged" (continuous batching): the paged runner steps every request that has
  work; a request arriving mid-run is scheduled in the very next step.
- "kv" (static batching, the baseline): a batch is formed from the requests
  waiting when it starts (at most max_num_seqs of them), left-padded, and run
  to completion before the next batch starts; a request arriving meanwhile
  waits for the whole batch to end. Its time to first token is the price.

The loop owns the engine of the `LLM` it serves: nothing else may step that
`LLM` while the server runs.
"""

import sys
import threading
import time
from collections import deque

from stagewise.engine.kv_runner import KVRunner
from stagewise.engine.request import FinishReason, RequestStatus
from stagewise.serve.handle import Event, Handle
from stagewise.serve.protocol import APIError


class EngineLoop:
    def __init__(self, llm, mode: str = "paged", max_queue: int = 1024, metrics=None, hub=None):
        if mode not in ("paged", "kv"):
            raise ValueError(f"mode must be 'paged' or 'kv', got {mode!r}")
        if mode == "paged" and llm.engine is None:
            raise ValueError("mode 'paged' needs an LLM built with mode='paged'")
        self.llm = llm
        self.mode = mode
        self.max_queue = max_queue  # most requests waiting for a seat; one more gets 503
        self.metrics = metrics  # serve.metrics.ServerMetrics, or None
        self.hub = hub  # the live view's ViewHub (publish(snapshot) per step), or None
        self._cond = threading.Condition()
        self._inbox: deque[Handle] = deque()  # submitted, not yet given to the engine
        self._aborts: deque[Handle] = deque()  # handles whose client left
        self._num_waiting = 0  # submitted and not yet scheduled (inbox + scheduler's waiting)
        self._accepting = True
        self._stopping = False
        self._aborting_all = False  # the drain time is over: every request left is aborted
        self._live: dict[str, Handle] = {}  # request id -> handle, for requests in the engine
        self.step_index = 0  # the index of the next engine step (0 first, as in a trace)
        if metrics is not None and mode == "paged":
            metrics.baseline(llm.engine)
        self._thread = threading.Thread(target=self._run, name="stagewise-engine-loop", daemon=True)

    # ---- any thread ----

    def start(self) -> None:
        self._thread.start()

    def submit(self, handle: Handle) -> None:
        """Queue a request; APIError 503 when the queue is full or the server is stopping."""
        with self._cond:
            if not self._accepting:
                raise APIError(503, self.failure or "the server is shutting down; no new requests")
            if self._num_waiting >= self.max_queue:
                raise APIError(503, f"the request queue is full ({self.max_queue} waiting); retry later")
            self._num_waiting += 1
            self._inbox.append(handle)
            self._cond.notify()

    def abort(self, handle: Handle) -> None:
        """The client left: drop the request at the next step boundary (idempotent)."""
        with self._cond:
            if not handle.aborted and not handle.done:  # (done: it ended; nothing to drop)
                handle.aborted = True
                self._aborts.append(handle)
                self._cond.notify()

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def abort_all(self) -> None:
        """End every request in flight at the next step boundary (their streams end, blocks free)."""
        with self._cond:
            self._accepting = False
            self._aborting_all = True
            self._cond.notify()

    def num_in_flight(self) -> int:
        """Requests submitted and not finished."""
        with self._cond:
            return len(self._inbox) + len(self._live)

    def num_waiting(self) -> int:
        with self._cond:
            return self._num_waiting

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ----

    def alive(self) -> bool:
        """The engine thread runs (GET /health answers 503 otherwise)."""
        return self._thread.is_alive() and self.failure is None

    failure: str | None = None  # why the engine thread ended early, if it did

    def _run(self) -> None:
        try:
            if self.mode == "paged":
                self._run_paged()
            else:
                self._run_static()
        except BaseException as exc:  # a bug here must not leave a server that accepts and never answers
            self.failure = f"the engine loop stopped ({type(exc).__name__}: {exc})"
            print(f"error: {self.failure}", file=sys.stderr)
            with self._cond:
                self._accepting = False
        finally:
            self._end_all("error" if self.failure else "abort", self.failure)

    def _wait_for_work(self, busy) -> tuple[list[Handle], list[Handle]] | None:
        """Sleep until there is something to do; -> (new handles, aborted handles), None to stop."""
        with self._cond:
            while not (self._inbox or self._aborts or self._stopping or busy()):
                self._cond.wait()
            if self._stopping:
                return None
            return self._take_messages()

    def _take_messages(self) -> tuple[list[Handle], list[Handle]]:
        """(new handles, handles to abort), under the condition's lock; after abort_all(), all."""
        new, aborts = list(self._inbox), list(self._aborts)
        self._inbox.clear()
        self._aborts.clear()
        if self._aborting_all:
            aborts += [h for h in self._live.values() if h not in aborts]
            for h in new + aborts:
                h.aborted = True
        return new, aborts

    def _run_paged(self) -> None:
        runner = self.llm.engine
        while True:
            work = self._wait_for_work(runner.has_unfinished)
            if work is None:
                return
            with self.llm._lock:  # the LLM's lock, held for each engine step (as its own calls do)
                results, step_s = self._paged_step(runner, *work)
            if results is None:
                new, aborts = work
                if aborts or new:  # requests left (or came and went) and nothing is left to run
                    self._after_step(runner, 0.0, idle=True)
                    self.step_index += 1
                continue
            self._deliver(results)
            self._after_step(runner, step_s)
            self.step_index += 1

    def _paged_step(self, runner, new: list[Handle], aborts: list[Handle]) -> tuple[list | None, float]:
        """New requests join, aborted ones leave, one step; -> (its results, seconds), None when
        there was nothing to run, [] when the step failed (every request in it ended)."""
        for h in new:
            if h.aborted:
                self._finish(h, "abort", None)
                continue
            self._live[h.request.request_id] = h
            runner.add(h.request)
        for h in aborts:
            if not h.done and h.request.request_id in self._live:
                runner.abort(h.request)  # its blocks free at once
                self._finish(h, "abort", None)
        if not runner.has_unfinished():
            return None, 0.0
        start = time.perf_counter()
        try:
            results = runner.step()
        except Exception as exc:  # not pinned on one request (the runner pins those itself)
            for h in list(self._live.values()):
                runner.abort(h.request)
                self._finish(h, "error", f"the engine step failed ({type(exc).__name__}: {exc})")
            runner.repair()
            return [], 0.0
        return results, time.perf_counter() - start

    def _run_static(self) -> None:
        llm = self.llm
        pad = llm.tokenizer.pad_id if llm.tokenizer.pad_id is not None else 0
        seats = llm.engine_config.max_num_seqs
        while True:
            work = self._wait_for_work(lambda: False)
            if work is None:
                return
            new, aborts = work
            for h in aborts:  # aborted while waiting, no batch running: it just leaves
                if not h.done:
                    self._finish(h, "abort", None)
            pending = [h for h in new if not h.done]
            while pending:  # the requests waiting now, in batches of at most `seats`
                batch, pending = pending[:seats], pending[seats:]
                self._run_batch(KVRunner(llm.model, llm.tokenizer.stop_ids, pad, llm.max_model_len, seats), batch)
                with self._cond:  # requests that arrived meanwhile wait for the next batch
                    if self._stopping:
                        return
                    new, aborts = self._take_messages()
                    pending += new
                for h in aborts + [h for h in pending if h.aborted]:
                    if not h.done:
                        self._finish(h, "abort", None)
                pending = [h for h in pending if not h.done]
            if self.metrics is not None:  # the gauges settle before the thread sleeps
                self.metrics.after_step(None, self.num_waiting(), len(self._live))

    def _run_batch(self, runner: KVRunner, batch: list[Handle]) -> None:
        for h in batch:
            self._live[h.request.request_id] = h
        steps = runner.run([h.request for h in batch])
        try:
            while True:
                self._static_aborts()
                start = time.perf_counter()
                with self.llm._lock:
                    item = next(steps, None)  # a token of one request (a step yields one per row)
                if item is None:
                    return
                self._deliver([item])
                self._after_step(None, time.perf_counter() - start)
                if self._stopping:
                    return
        except Exception as exc:
            for h in batch:
                if not h.done:
                    self._finish(h, "error", f"the batch failed ({type(exc).__name__}: {exc})")
        finally:
            steps.close()

    def _static_aborts(self) -> None:
        """Static batching cannot drop a row: an aborted request's row runs on as padding."""
        with self._cond:
            if not (self._aborts or self._aborting_all):
                return
            new, aborts = self._take_messages()
            self._inbox.extendleft(reversed(new))  # arrivals wait for the next batch
        for h in aborts:
            if not h.done:
                if h.request.request_id in self._live:
                    h.request.status, h.request.finish_reason = RequestStatus.FINISHED, FinishReason.ABORT
                self._finish(h, "abort", None)

    def _deliver(self, results: list[tuple]) -> None:
        now = time.perf_counter()
        # a speculative step may give a request several tokens: only its last one can end it
        last = {id(req): i for i, (req, _, _) in enumerate(results)}
        for i, (req, token, delta) in enumerate(results):
            h = self._live.get(req.request_id)
            if h is None or h.done:
                continue
            self._mark_started(h)
            if self.metrics is not None and token is not None:
                self.metrics.on_token(req, now)
            if token is None:  # the step failed because of this request
                self._finish(h, "error", req.error or "the request failed in an engine step")
                continue
            finished = req.finished and last[id(req)] == i
            reason = req.finish_reason.value if req.finish_reason else None
            h.push(Event(delta, token, finished, reason if finished else None))
            if finished:
                self._finish(h, reason, None, push=False)

    def _mark_started(self, h: Handle) -> None:
        if not h.started:
            h.started = True
            with self._cond:
                self._num_waiting -= 1

    def _after_step(self, runner, step_s: float, idle: bool = False) -> None:
        """Books after a step (`idle`: after requests left with no step run): gauges, the view."""
        for h in self._live.values():  # scheduled this step, even with no token yet (a prefill chunk)
            if not h.started and h.request.first_scheduled_time is not None:
                self._mark_started(h)
        if self.metrics is not None:
            self.metrics.after_step(runner, self.num_waiting(), len(self._live))
        if self.hub is not None and runner is not None:
            self._publish(runner, step_s, idle)

    def _publish(self, runner, step_s: float, idle: bool) -> None:
        """A snapshot for the view: live at most view_publish_hz times a second, and always when
        the engine goes idle (the page must not keep a stale step); every step for a recorder."""
        from stagewise.engine.snapshot import engine_snapshot, step_latency

        live = idle or not runner.has_unfinished() or self.hub.live_due()
        if not live and not self.hub.wants_every_step():
            self.hub.carry(step_latency(runner))  # not built (it walks every request and block row);
            return  # its tokens' TTFT / TBT still reach the page's latency chart with the next one
        snapshot = engine_snapshot(
            runner,
            step_index=self.step_index,
            step_stats={"step_ms": round(1e3 * step_s, 3)},
            now=time.time(),
            idle=idle,
        )
        self.hub.publish(snapshot, live=live)

    def _finish(self, h: Handle, reason: str | None, error: str | None, push: bool = True) -> None:
        """The request's last event (unless it was just pushed); it leaves the books."""
        if h.done:
            return
        h.done = True
        if not h.started:
            h.started = True
            with self._cond:
                self._num_waiting -= 1
        self._live.pop(h.request.request_id, None)
        if push:
            h.push(Event("", None, True, reason, error))
        if self.metrics is not None:
            self.metrics.on_finish(h.request, reason)

    def _end_all(self, reason: str, error: str | None) -> None:
        """The thread ends: every request still in flight gets its last event."""
        with self._cond:
            left = list(self._inbox) + list(self._aborts)
            self._inbox.clear()
            self._aborts.clear()
        runner = self.llm.engine if self.mode == "paged" else None
        for h in list(self._live.values()) + left:
            if runner is not None and h.request.request_id in self._live:
                runner.abort(h.request)
            self._finish(h, reason, error)
