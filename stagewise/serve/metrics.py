"""`GET /metrics`: the server's counters in the Prometheus text format.

Prometheus (or `curl`) scrapes this page now and then; each line is one
number, e.g.

    stagewise:num_requests_running{model_name="tiny"} 3.0
    stagewise:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 12.0

The names are vLLM's (`vllm:num_requests_running` ...) with a `stagewise:`
prefix, so a dashboard built for one reads the other:

    gauges       num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1)
    counters     num_preemptions_total, prefix_cache_queries_total / prefix_cache_hits_total
                 (prompt tokens looked up / found), prompt_tokens_total, generation_tokens_total,
                 request_success_total{finished_reason}
    histograms   time_to_first_token_seconds (TTFT), inter_token_latency_seconds (TBT),
                 e2e_request_latency_seconds (arrival to last token)

Each app has its own `CollectorRegistry`, so two servers in one process (the
tests start several) keep separate books. The engine thread updates them;
prometheus_client's metrics are thread-safe.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds; TTFT and latency span a CPU's slow prefill as well as a GPU's fast one
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"stagewise:{name}", doc, list(label), registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:  # exposed with the suffix _total
            return Counter(f"stagewise:{name}", doc, list(label), registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"stagewise:{name}", doc, list(label), buckets=buckets, registry=r).labels(**label)

        self.running = gauge("num_requests_running", "Requests in the running batch (holding KV).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a seat.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV blocks in use, 0..1.")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed) so far.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            "stagewise:request_success",
            "Requests ended, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._label = model_name
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS)
        self._seen = (0, 0, 0)  # the engine's (preemptions, prefix queried, prefix hit) at the last step

    def baseline(self, runner) -> None:
        """Count from the engine's totals now (an LLM may have run before it served)."""
        bm = runner.block_manager
        self._seen = (runner.scheduler.num_preemptions, bm.stats.queried_tokens, bm.stats.hit_tokens)

    def on_token(self, req, now: float) -> None:
        """A token of `req` was sampled (engine thread)."""
        self.generation_tokens.inc()
        times = req.token_times
        if len(times) == 1:
            self.ttft.observe(times[0] - req.arrival_time)
            self.prompt_tokens.inc(req.num_prompt_tokens)
        elif len(times) > 1:
            self.itl.observe(times[-1] - times[-2])

    def on_finish(self, req, reason: str | None) -> None:
        self._success.labels(model_name=self._label, finished_reason=reason or "abort").inc()
        if req.token_times and reason in ("stop", "length"):
            self.e2e.observe(req.token_times[-1] - req.arrival_time)

    def after_step(self, runner, num_waiting: int, num_live: int) -> None:
        """Gauges after an engine step; `runner` is the paged runner (None in static-batching mode)."""
        self.waiting.set(num_waiting)
        self.running.set(max(num_live - num_waiting, 0) if runner is None else len(runner.scheduler.running))
        if runner is None:
            return
        bm = runner.block_manager
        self.kv_usage.set(bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0)
        now = (runner.scheduler.num_preemptions, bm.stats.queried_tokens, bm.stats.hit_tokens)
        for metric, before, after in zip((self.preemptions, self.prefix_queries, self.prefix_hits), self._seen, now):
            if after > before:
                metric.inc(after - before)
        self._seen = now

    def idle(self) -> None:
        """Nothing in flight."""
        self.running.set(0)
        self.waiting.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
