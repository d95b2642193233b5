"""The client side of `bench serve`: when requests arrive, how one is sent, what is measured of it.

A real server is not called by one program in a loop: users arrive on their own, independently of
each other. The usual model of such arrivals (and what vLLM's `benchmark_serving` draws) is a
*Poisson process* at rate λ requests per second: the gaps between two arrivals are independent and
exponentially distributed with mean 1/λ (and variance 1/λ²). Most gaps are short, a few are long,
so requests come in bursts and lulls, which is exactly what a scheduler must cope with. Rate `inf`
sends every request at t = 0 (the offline "all at once" case the other benchmarks measure).

Each request is a real HTTP client: its own connection (no keep-alive, no shared pool), a
`POST /v1/completions` with `"stream": true`, read as server-sent events (`data: {...}` lines,
ending with `data: [DONE]`). Seen from the client, per request:

- TTFT: from sending the request to the first chunk that carries text (queueing + prefill);
- TBT: the gaps between consecutive chunks that carry text (each decode step as the user sees it);
- latency: from sending to the end of the stream;
- tokens: `usage.completion_tokens` of the final chunk (asked for with `stream_options`), else the
  number of text chunks.

A request is *failed* when the server answers with an error status or the connection breaks, and
*lost* when the stream ends without `[DONE]` or with fewer tokens than `max_tokens` (every request
asks for exactly that many, with `ignore_eos`).
"""

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np

from stagewise.engine.outputs import percentile
from stagewise.errors import StagewiseError


def parse_rates(text: str) -> tuple[str, ...]:
    """'0.5,1,2,inf' -> ('0.5', '1', '2', 'inf'): requests per second, each > 0 (inf: all at once)."""
    labels = tuple(x.strip().lower() for x in text.split(",") if x.strip())
    if not labels:
        raise StagewiseError(f"--request-rates needs at least one rate, got '{text}'")
    for label in labels:
        try:
            value = float(label)
        except ValueError:
            value = None
        if value is None or math.isnan(value) or value <= 0:
            raise StagewiseError(f"--request-rates must be numbers > 0 or 'inf', got '{label}'")
    return labels


def rate_value(label: str) -> float:
    """The rate a label names, in requests per second (math.inf for 'inf')."""
    return float(label)


def inter_arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Gaps in seconds between consecutive requests: Exp(rate) draws, mean 1/rate (all 0 for rate inf).

    Request i is sent `sum(gaps[:i])` seconds after the first; the last gap is drawn but never waited.
    """
    if num_requests < 0:
        raise StagewiseError(f"the number of requests must be >= 0, got {num_requests}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if not rate > 0:
        raise StagewiseError(f"a request rate must be > 0, got {rate}")
    rng = np.random.default_rng(seed)
    return [float(g) for g in rng.exponential(1.0 / rate, size=num_requests)]


def arrival_offsets(gaps: list[float]) -> list[float]:
    """Send times from the gaps: 0 for the first request, then the running sum."""
    offsets, t = [], 0.0
    for gap in gaps:
        offsets.append(t)
        t += gap
    return offsets


@dataclass
class RequestResult:
    """One request as its client saw it; times in perf_counter seconds."""

    index: int  # position in the workload
    prompt_tokens: int  # length of the prompt (the workload's count)
    max_tokens: int  # asked for (ignore_eos: exactly this many are due)
    sent: float = 0.0  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # when each chunk carrying text arrived
    text: str = ""  # the whole completion
    completion_tokens: int | None = None  # the server's usage count (None: the server sent none)
    finish_reason: str | None = None  # "length" expected
    done: bool = False  # the stream ended with data: [DONE]
    end: float = 0.0  # when the stream ended (or broke)
    error: str | None = None  # HTTP status or transport error, in one line

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def lost(self) -> bool:
        """Answered, but incomplete: no [DONE], or fewer (or more) tokens than asked for (without a usage
        count, a chunk may carry several tokens: then the stream must end for its length)."""
        if self.failed:
            return False
        if self.completion_tokens is None:
            return not self.done or self.finish_reason != "length"
        return not self.done or self.completion_tokens != self.max_tokens

    def row(self, start: float) -> dict:
        """The JSON's per-request record; times in seconds since the run started."""
        ttft = self.chunk_times[0] - self.sent if self.chunk_times else None
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        return {
            "index": self.index,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "tokens": self.tokens,
            "sent_s": round(self.sent - start, 6),
            "ttft_ms": None if ttft is None else round(1000 * ttft, 3),
            "latency_ms": round(1000 * (self.end - self.sent), 3),
            "tbt_ms": [round(1000 * g, 3) for g in gaps],
            "finish_reason": self.finish_reason,
            "failed": self.failed,
            "lost": self.lost,
            "error": self.error,
        }


async def send_completion(client, model: str, prompt: str, result: RequestResult, headers: dict) -> None:
    """POST one streaming completion and fill `result` as its chunks arrive (never raises for HTTP)."""
    import httpx

    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": result.max_tokens,
        "temperature": 0.0,  # greedy: the same text whichever mode serves it
        "ignore_eos": True,  # exactly max_tokens tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {' '.join(body.split())[:200]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, other event fields
                data = line[5:].strip()
                if data == "[DONE]":
                    result.done = True
                    break
                read_chunk(json.loads(data), result, time.perf_counter())
    except (httpx.HTTPError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    finally:
        result.end = time.perf_counter()


def read_chunk(chunk: dict, result: RequestResult, now: float) -> None:
    """One `text_completion` chunk: its text (timed if not empty), finish reason, usage, or error."""
    if "error" in chunk:
        raise ValueError(f"error in stream: {chunk['error']}")
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or ""
        if text:
            result.chunk_times.append(now)
            result.text += text
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = usage.get("completion_tokens")


async def run_arrivals(
    base_url: str, model: str, requests: list[tuple[str, int, int]], offsets: list[float], on_done=None, api_key=None
) -> tuple[list[RequestResult], float]:
    """Send `requests` ((prompt, prompt tokens, max_tokens) each) at `offsets` seconds after the start.

    Each runs as its own task on its own connection; returns the results (in workload order) and the
    perf_counter time of the start. `on_done()` is called as each one ends (a progress bar)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)  # one connection per request
    timeout = httpx.Timeout(600.0, connect=30.0)  # a request that hangs this long is failed, not waited for
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = [RequestResult(i, p, n) for i, (_, p, n) in enumerate(requests)]

    async def one(result: RequestResult, prompt: str, at: float) -> None:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)  # scheduled on the absolute clock: late sends do not shift the rest
        await send_completion(client, model, prompt, result, headers)
        if on_done is not None:
            on_done()

    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(r, q[0], at) for r, q, at in zip(results, requests, offsets)))
    return results, start


def summarize_results(results: list[RequestResult], start: float) -> dict:
    """Percentiles over the requests that completed; throughput over the run's wall time."""
    ok = [r for r in results if not r.failed and not r.lost]
    ttft = [1000 * (r.chunk_times[0] - r.sent) for r in ok if r.chunk_times]
    tbt = [1000 * (b - a) for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    latency = [1000 * (r.end - r.sent) for r in ok]
    wall = max((r.end for r in results), default=start) - start
    tokens = sum(r.tokens for r in ok)
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": sum(r.failed for r in results),
        "lost": sum(r.lost for r in results),
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall > 0 else 0.0,
        "output_tok_per_s": tokens / wall if wall > 0 else 0.0,
        "output_tokens": tokens,
        "ttft_ms_p50": p50,
        "ttft_ms_p99": p99,
        "ttft_p99_over_p50": p99 / p50 if p50 > 0 else None,
        "tbt_ms_p50": percentile(tbt, 50),
        "tbt_ms_p99": percentile(tbt, 99),
        "latency_ms_p50": percentile(latency, 50),
        "latency_ms_p99": percentile(latency, 99),
        "usage_reported": all(r.completion_tokens is not None for r in ok),
    }


COUNTERS = ("generation_tokens", "prompt_tokens", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


def server_counters(base_url: str, api_key: str | None = None) -> dict:
    """The server's own totals from GET /metrics (Prometheus text): tokens, preemptions, prefix-cache
    hits, finished requests by reason; {} when it has no /metrics. A cross-check of the client's counts."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30.0)
        response.raise_for_status()
        families = list(text_string_to_metric_families(response.text))
    except (httpx.HTTPError, ValueError):
        return {}
    out = {}
    for family in families:
        name = family.name.removeprefix("stagewise:")
        for sample in family.samples:
            if sample.name.endswith("_total") and name in COUNTERS:
                out[name] = sample.value
            elif name == "request_success" and sample.name.endswith("_total"):
                out[f"finished_{sample.labels.get('finished_reason')}"] = sample.value
    return out
