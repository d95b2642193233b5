"""Bursts of real Ctrl-C: SIGINTs sent to this process a few microseconds to milliseconds apart.

A person who presses Ctrl-C twice, or a terminal that repeats it, delivers
interrupts anywhere: inside a forward pass, inside the cleanup that the first
one started, between two lines of bookkeeping. `InterruptBurst` reproduces
that for the soak and the tests: a thread sends `count` real SIGINTs, in
bursts of `burst_size` with random gaps inside a burst and longer pauses
between bursts, while the main thread keeps calling the engine.

Only the engine's work is under test, not the harness around it: the burst
installs its own SIGINT handler that raises `KeyboardInterrupt` while
`armed` (set around each engine call), and only counts the signals that land
in the harness's own lines. Signals reach Python's handler in the main thread
only, so the burst must be used from there.
"""

import os
import random
import signal
import threading
import time


class InterruptBurst:
    def __init__(
        self,
        count: int,
        gap_s: tuple[float, float] = (20e-6, 2e-3),
        burst_size: int = 4,
        pause_s: tuple[float, float] = (0.02, 0.2),
        seed: int = 0,
    ):
        self.count = count  # SIGINTs to send in all
        self.gap_s = gap_s  # random gap inside a burst, seconds (the OS's sleep granularity applies)
        self.burst_size = burst_size  # SIGINTs per burst
        self.pause_s = pause_s  # random pause between bursts, seconds: calls complete in between
        self.rng = random.Random(seed)
        self.armed = False  # True while the main thread is inside an engine call
        self.sent = 0  # signals sent so far
        self.raised = 0  # of those, turned into a KeyboardInterrupt (landed in an engine call)
        self._thread: threading.Thread | None = None
        self._previous = None

    def __enter__(self) -> "InterruptBurst":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("an interrupt burst must run from the main thread")
        self._previous = signal.signal(signal.SIGINT, self._handler)
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.wait()
        signal.signal(signal.SIGINT, self._previous)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until every signal is sent and handled (a short sleep lets the last one arrive)."""
        self.armed = False
        if self._thread is not None:
            self._thread.join()
        time.sleep(0.01)  # interrupted by a signal still in flight, which the handler then counts

    def _handler(self, signum, frame) -> None:
        if self.armed:
            self.raised += 1
            raise KeyboardInterrupt

    def _send(self) -> None:
        pid = os.getpid()
        for i in range(self.count):
            gap = self.gap_s if i % self.burst_size else self.pause_s
            time.sleep(self.rng.uniform(*gap))
            os.kill(pid, signal.SIGINT)
            self.sent += 1
