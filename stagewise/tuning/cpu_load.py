"""How much of the machine other processes used while this one was measuring.

A timing taken while other jobs compete for the cores measures the contention,
not the code: a GEMM form that streams its weights in 45 ms on an idle 2-core
machine can take 270 ms when six other processes share those cores, and the
ranking of the forms changes with it. Such a timing is fine for the run that
took it (that run faces the same contention), but it must not be remembered
as this machine's answer.

On Linux the kernel counts, for all cores together, the time spent busy and
idle (`/proc/stat`, first line, in clock ticks). Over a measurement,

    others = (machine busy time - this process's CPU time) / (machine total time)

is the share of every core's time that went to someone else: about 0 on a
quiet machine, whatever number of threads this process used; near 1 - 1/n
when n equal jobs share the machine. The kernel counts in ticks (usually 100
per second per core), so a window of a few ticks cannot tell 0% from 20%: a
window shorter than `MIN_TICKS` of all cores' time, or a machine without
`/proc/stat`, leaves the share unknown (None).
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

BUSY_SHARE = 0.25  # others used more than this share of the machine: the timing was contended
# A run that shares its cores on purpose (a test suite's parallel workers, each calibrating in
# its own processes) sets this to a larger share, 1 to trust every timing; its cache is its own
# (STAGEWISE_CACHE_DIR)
BUSY_SHARE_ENV = "STAGEWISE_BUSY_SHARE"
# Fewer ticks than this (0.25 s on 2 cores at 100 Hz) and one tick more or less moves the share by
# over 2%: too short a window to call the machine quiet or busy
MIN_TICKS = 50


def busy_share() -> float:
    """The share of the machine others may use before a timing counts as contended."""
    try:
        return float(os.environ.get(BUSY_SHARE_ENV, BUSY_SHARE))
    except ValueError:
        return BUSY_SHARE


def _machine_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all cores since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


@dataclass
class LoadProbe:
    """A context manager: `others` is the share of the machine other processes used inside it.

    "Others" are all but the processes whose CPU seconds `own` counts: this process by default;
    a caller whose work runs elsewhere (a notebook's kernel) passes a function that counts those.
    """

    others: float | None = None  # 0..1, None where unknown
    own: Callable[[], float] = field(default=time.process_time, repr=False)  # CPU seconds so far
    _start: tuple | None = field(default=None, repr=False)

    def __enter__(self) -> "LoadProbe":
        self._start = (_machine_ticks(), self.own())
        return self

    def __exit__(self, *exc) -> None:
        machine, cpu = self._start
        end = _machine_ticks()
        if machine is None or end is None:
            return
        busy, total = end[0] - machine[0], end[1] - machine[1]
        if total < MIN_TICKS:
            return  # too short to tell: unknown
        ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        own = (self.own() - cpu) * ticks_per_s
        self.others = min(1.0, max(0.0, (busy - own) / total))

    @property
    def contended(self) -> bool:
        return self.others is not None and self.others > busy_share()
