"""`generate`'s output: text as it is produced, one request after another, and `--stats` per request.

With several prompts the engine batches them, so their tokens arrive interleaved. Printing them
interleaved mid-line would be unreadable; waiting for the end would print nothing for a long time.
`stream_texts` does what a reader wants: request 0 streams live under its header; the others'
text is kept until their turn comes (already finished ones then print at once, the running one
streams on).

`--stats` times each request as this command sees it, from the moment the prompts are submitted:

    TTFT      time to the first output token (the prefill, plus any wait for a seat)
    TBT       mean time between two output tokens (one decode step, shared by the batch)
    TPS       1 / TBT: the decode speed of this one stream
    latency   submission to the last token
    tokens/s  output tokens / latency (TTFT included, so below TPS)
"""

import sys
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.text import Text

from stagewise.trace.fit import Col, FitTable


def rate(per_s: float) -> str:
    """A rate with three significant digits and no exponent: 0.0874, 7.27, 31.4, 1234."""
    if per_s >= 100:
        return f"{per_s:.0f}"
    return f"{per_s:.3g}" if per_s >= 1e-3 else f"{per_s:.1e}"


@dataclass
class RequestClock:
    """Arrival times (perf_counter seconds) of one request's output tokens."""

    start: float  # when the prompts were submitted
    times: list[float] = field(default_factory=list)  # one per sampled token

    def row(self, index: int) -> list[str]:
        n = len(self.times)
        if not n:
            return [str(index), "0", "-", "-", "-", "-", "-"]
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        tbt = sum(gaps) / len(gaps) if gaps else None
        latency = self.times[-1] - self.start
        return [
            str(index),
            str(n),
            f"{(self.times[0] - self.start) * 1e3:.1f}",
            "-" if tbt is None else f"{tbt * 1e3:.1f}",
            "-" if not tbt else rate(1 / tbt),
            f"{latency:.2f}",
            rate(n / latency) if latency > 0 else "-",
        ]


def stream_texts(events, prompts: list[str], out=None) -> list[RequestClock]:
    """Write the requests' text as it comes (one after another, see the module docstring); their clocks.

    `out` defaults to the sys.stdout of the moment of the call, not of the import (a redirect made later,
    or a replaced stdout, is then the one written to).
    """
    out = sys.stdout if out is None else out
    start = time.perf_counter()
    clocks = [RequestClock(start) for _ in prompts]
    many = len(prompts) > 1
    pending = [""] * len(prompts)  # text of a request whose turn has not come yet
    done = [False] * len(prompts)
    current = 0

    def header(i: int) -> None:
        if many:
            out.write(f"[{i}] {prompts[i]!r}\n")

    header(0)
    for event in events:
        i = event.index
        if event.token_id is not None:
            clocks[i].times.append(time.perf_counter())
        if i == current:
            out.write(event.text)
        else:
            pending[i] += event.text
        done[i] = done[i] or event.finished
        while current < len(prompts) and done[current]:  # its turn is over: the next one catches up
            out.write("\n\n" if many else "\n")
            current += 1
            if current < len(prompts):
                header(current)
                out.write(pending[current])
                pending[current] = ""
        out.flush()
    return clocks


def stats_table(clocks: list[RequestClock]) -> FitTable:
    cols = [Col("request"), *(Col(h, "right") for h in ("output tokens", "TTFT ms", "TBT ms"))]
    cols += [Col(h, "right") for h in ("TPS (1/TBT)", "latency s", "tokens/s")]
    rows = [clock.row(i) for i, clock in enumerate(clocks)]
    total = sum(len(c.times) for c in clocks)
    end = max((c.times[-1] for c in clocks if c.times), default=None)
    caption = None
    if end is not None and end > clocks[0].start:
        caption = f"all requests: {total} output tokens in {end - clocks[0].start:.2f} s = "
        caption += f"{rate(total / (end - clocks[0].start))} tokens/s together (the throughput; TPS is one "
        caption += "stream's decode speed)"
    return FitTable("per request, as this command saw it", cols, rows, caption=Text(caption) if caption else None)


def print_stats(clocks: list[RequestClock], speculative=None) -> None:
    """The table on stderr: stdout keeps only the generated text (it may be piped).

    `speculative`: the run's RunStats when speculative decoding was on: one more line says how
    many guesses were verified and kept."""
    console = Console(stderr=True)
    console.print(stats_table(clocks))
    if speculative is not None:
        console.print(Text(spec_line(speculative)))


def spec_line(stats) -> str:
    """The speculative line of `--stats`: guesses verified, kept, and kept per verify step (each
    verify step adds one token of the target's own)."""
    if not stats.spec_draft_tokens:
        return "speculative decoding: no guesses were made (nothing repeated to look up)"
    return (
        f"speculative decoding: {stats.spec_draft_tokens} guesses verified, "
        f"{stats.spec_accepted_tokens} kept (acceptance {100 * stats.spec_acceptance_rate:.1f}%), "
        f"{stats.spec_mean_accepted:.2f} kept per verify step (+1 token of the target's own)"
    )
