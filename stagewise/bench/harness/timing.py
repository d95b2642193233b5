"""The timing harness: what makes a number trustworthy enough to print.

Rules (from the project's design notes, "Measuring"):

- synchronize inside the timer: CUDA kernels are launched asynchronously, so
  a timer stopped without `torch.cuda.synchronize()` measures the launch, not
  the work;
- warm up first: the first calls pay for allocation, kernel compilation
  (Triton JIT, autotuning) and cold caches;
- repeat and report the median (robust to a stray slow run) with p10 / p90 to
  show the spread; never the mean of a handful of samples;
- run compared variants in the same process, alternating them (A B A B ...),
  so a drift of the machine (another job, thermal throttling, a frequency
  change) hits every variant alike instead of all of one variant's samples.

Whole generation runs are timed from the caller's side (`stream_timed`): all
requests arrive when the call starts, and a token counts when it reaches the
caller. The same clock serves stagewise and transformers, and the metrics are
the engine's own `RequestMetrics` formulas (TTFT, TBT, latency; chapter 4).
"""

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from stagewise.engine.outputs import RequestMetrics, percentile


def synchronize(device: str | torch.device | None) -> None:
    """Wait for queued GPU work (no-op on the CPU)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """`with Stopwatch(device) as sw: work()` -> `sw.elapsed_s`, synchronized at both ends."""

    def __init__(self, device: str | torch.device | None = None):
        self.device = device
        self.elapsed_s = 0.0

    def __enter__(self) -> "Stopwatch":
        synchronize(self.device)  # earlier queued work must not be billed to this block
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)  # this block's queued work must be billed to it
        self.elapsed_s = time.perf_counter() - self._start


def summarize(values) -> dict:
    """median / p10 / p90 / min / max / n of a list of numbers (numpy's linear percentiles)."""
    values = list(values)
    if not values:
        return {"median": None, "p10": None, "p90": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(values),
        "p10": percentile(values, 10),
        "p90": percentile(values, 90),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one variant, in milliseconds."""

    samples_ms: tuple[float, ...]  # every timed repeat, in the order run

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        return percentile(self.samples_ms, 10)

    @property
    def p90_ms(self) -> float:
        return percentile(self.samples_ms, 90)

    def as_dict(self) -> dict:
        return {
            "median_ms": self.median_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "samples_ms": list(self.samples_ms),
        }


def alternating(names: list[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(round, name) in the order A B C A B C ...: every round runs every variant once."""
    for round_index in range(repeats):
        for name in names:
            yield round_index, name


def time_call(fn: Callable[[], object], device: str | torch.device | None = None) -> float:
    """Seconds one call of `fn` takes, synchronized."""
    with Stopwatch(device) as sw:
        fn()
    return sw.elapsed_s


def compare(
    variants: dict[str, Callable[[], object]],
    repeats: int = 10,
    warmup: int = 2,
    device: str | torch.device | None = None,
    on_sample: Callable[[str, float], None] | None = None,
) -> dict[str, Timing]:
    """Time every variant `repeats` times, alternating them, after `warmup` untimed alternating rounds.

    `on_sample(name, ms)` is called after each timed call (progress bars).
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    names = list(variants)
    for _, name in alternating(names, warmup):
        variants[name]()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _, name in alternating(names, repeats):
        ms = 1000 * time_call(variants[name], device)
        samples[name].append(ms)
        if on_sample is not None:
            on_sample(name, ms)
    return {name: Timing(tuple(values)) for name, values in samples.items()}


@dataclass
class StreamedRequest:
    """What the caller sees of one request: when it was submitted, and each token with its arrival time."""

    arrival_time: float  # perf_counter seconds when the call that submitted it started
    token_ids: list[int] = field(default_factory=list)  # output tokens, in order
    token_times: list[float] = field(default_factory=list)  # perf_counter seconds each token reached the caller
    first_scheduled_time: float | None = None  # unseen by the caller (RequestMetrics then uses the first token)
    # speculative decoding's counters are the engine's, unseen by the caller: none here
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    def metrics(self) -> RequestMetrics:
        return RequestMetrics.of(self)  # the engine's definitions of TTFT, TBT, latency and tokens/s


def stream_timed(llm, prompts: list[str], params, on_event: Callable | None = None) -> list[StreamedRequest]:
    """Run `llm.stream(prompts, params)`, timestamping every token as it arrives.

    `on_event(event, now)` is called after each token (progress bars, KV samples). Token ids are
    Python ints by the time they are yielded, so a GPU run is synchronized at every token.
    """
    events = llm.stream(prompts, params)
    arrival = time.perf_counter()
    requests = [StreamedRequest(arrival) for _ in prompts]
    for event in events:
        now = time.perf_counter()
        req = requests[event.index]
        req.token_ids.append(event.token_id)
        req.token_times.append(now)
        if on_event is not None:
            on_event(event, now)
    return requests
