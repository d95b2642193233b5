"""`stagewise bench serve-limits`: what one request or one watcher can cost everyone else.

A server has one engine thread for every request and one event loop for every connection, so a
single client's cost is everybody's. `stagewise serve` bounds the two largest such costs
(`stagewise/serve/limits.py`); this benchmark measures what is left at those bounds, against one
`stagewise serve` child process (its defaults unless `--server-arg` says otherwise):

1. stop strings: `streams` greedy streams decode at once, alone, then beside ONE more request
   carrying the largest stop list the server accepts (16 strings of 256 characters that never
   occur, scanned after every token). The others' time between tokens (TBT) beside it, over TBT
   alone: the target is <= 2x. A list one string longer is refused (400), checked too.
2. live-view watchers: `view_streams` streams decode, with no watcher, then while `subscribers`
   connections (2000 by default) ask for /api/events at once; the server keeps 32 (the rest get
   503) and those read slowly (a few hundred bytes a second). Decoding speed with them, over
   without: the target is >= 0.9 (slowed by at most 10%). Speed is 1 / the server's own mean TBT
   (its /metrics inter-token histogram, read before and after each run): measured where the
   tokens are made, so the benchmark's own work on 2000 sockets does not count as the server's.

Each comparison runs its two cases alternately, `repeats` times, on fresh prompts (no prefix-cache
hit between runs), and reports the median of each. Timings mean something only on a quiet machine.
"""

import asyncio
import random
import resource
import statistics
import string
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from stagewise.bench.commands.serve import make_requests, served_model, workload_tokenizer
from stagewise.bench.commands.serve_client import run_arrivals, summarize_results
from stagewise.bench.commands.serve_process import ServerProcess
from stagewise.bench.harness.progress import row
from stagewise.errors import StagewiseError
from stagewise.serve.limits import ServerLimits

LIMITS = ServerLimits()  # the server's defaults, which this benchmark measures


@dataclass(frozen=True)
class LimitsSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    streams: int = 200  # streams decoding beside the stop-list request
    view_streams: int = 16  # streams decoding while the view is watched
    subscribers: int = 2000  # /api/events connections tried at once
    prompt_tokens: int = 32  # every stream's prompt length
    output_tokens: int = 64  # every stream's max_tokens (ignore_eos: exactly this many)
    repeats: int = 2  # runs of each case, alternated
    backend: str = "torch"  # the server's stage tier
    threads: int | None = None  # the server's torch threads; None = its default
    server_args: tuple[str, ...] = ()  # more `serve` options
    seed: int = 0


QUICK = {"streams": 8, "view_streams": 4, "subscribers": 60, "output_tokens": 8, "repeats": 1}


def largest_stop_list(seed: int) -> list[str]:
    """As many stop strings as the server takes, each as long as it takes, none of which can occur."""
    rng = random.Random(seed)
    return [
        "\u2063" + "".join(rng.choice(string.ascii_letters) for _ in range(LIMITS.max_stop_length - 1))
        for _ in range(LIMITS.max_stop_strings)
    ]


def raise_open_files(wanted: int) -> int:
    """Raise this process's open-file limit (the server child inherits it) toward `wanted`; -> the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return max(soft, target)


# ---- clients ----


async def _stop_request(url: str, model: str, prompt: str, max_tokens: int, stop: list[str]) -> int:
    """One streamed request with `stop`; -> its HTTP status (read to the end when 200)."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    body |= {"stream": True, "stop": stop}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                pass
            return response.status_code


async def _watcher(host: str, port: int, stop: asyncio.Event, counts: dict) -> None:
    """One /api/events connection: 200 -> read ~256 bytes a second until `stop`; 503 -> counted, gone."""
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError:
        counts["failed"] += 1
        return
    try:
        writer.write(f"GET /api/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        status = (await reader.readline()).split(b" ")[1:2]
        kind = {b"200": "accepted", b"503": "refused"}.get(status[0] if status else b"", "failed")
        counts[kind] += 1
        while kind == "accepted" and not stop.is_set():
            if not await reader.read(256):
                break
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    except OSError:
        counts["failed"] += 1
    finally:
        writer.close()


async def _decode_with_watchers(url: str, model: str, requests, subscribers: int) -> tuple[list, float, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stop, counts = asyncio.Event(), {"accepted": 0, "refused": 0, "failed": 0}
    watchers = [asyncio.ensure_future(_watcher(host, int(port), stop, counts)) for _ in range(subscribers)]
    try:
        results, start = await run_arrivals(url, model, requests, [0.0] * len(requests))
    finally:
        stop.set()
        await asyncio.gather(*watchers)
    return results, start, counts


# ---- runs ----


class ServerTBT:
    """The server's own mean time between tokens over a block (its /metrics inter-token histogram):
    measured where the tokens are made, so the client's work (2000 sockets) does not count in it."""

    def __init__(self, url: str):
        self.url, self.mean_ms = url, None

    def _totals(self) -> tuple[float, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=30.0).text
        found = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("stagewise:inter_token_latency_seconds_") and s.name[-4:] in ("_sum", "ount"):
                    found[s.name.rsplit("_", 1)[1]] = s.value
        return found.get("sum", 0.0), found.get("count", 0.0)

    def __enter__(self) -> "ServerTBT":
        self._before = self._totals()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            (s0, n0), (s1, n1) = self._before, self._totals()
            self.mean_ms = 1e3 * (s1 - s0) / (n1 - n0) if n1 > n0 else None


def _summary(results, start) -> dict:
    keep = ("completed", "failed", "lost", "tbt_ms_p50", "tbt_ms_p99", "output_tok_per_s", "wall_s")
    return {k: v for k, v in summarize_results(results, start).items() if k in keep}


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_limits(settings: LimitsSettings, progress=None) -> dict:
    """Both comparisons against one server; -> the result dict (every run's summary included)."""
    from stagewise.bench.harness.machine import machine_info

    if min(settings.streams, settings.view_streams, settings.subscribers, settings.repeats) < 1:
        raise StagewiseError("--streams, --view-streams, --subscribers and --repeats must be >= 1")
    files = raise_open_files(2 * settings.subscribers + 256)  # the watchers' sockets, both ends in this machine
    tokenizer = workload_tokenizer(settings.model)
    length = settings.prompt_tokens + settings.output_tokens
    seats = max(settings.streams + 1, settings.view_streams)
    args = ["--model", settings.model, "--backend", settings.backend, "--max-num-seqs", str(seats)]
    args += ["--max-model-len", str(-(-(length + 16) // 16) * 16), "--kv-blocks", str(seats * (length // 16 + 3))]
    args += ["--token-budget", str(max(512, seats)), *settings.server_args]
    env = {"OMP_NUM_THREADS": str(settings.threads)} if settings.threads else {}
    stop_list = largest_stop_list(settings.seed)
    tags = iter(range(10**6))

    def workload(n: int) -> list:
        return make_requests(tokenizer, [(settings.prompt_tokens, settings.output_tokens)] * n, next(tags), 0)

    stops, views = [], []
    with (
        tempfile.TemporaryDirectory(prefix="stagewise-bench-limits-") as tmp,
        ServerProcess(args, Path(tmp) / "server.log", env=env) as server,
    ):
        url, model = server.url, served_model(server.url, None)
        asyncio.run(run_arrivals(url, model, workload(2), [0.0, 0.0]))  # warm-up
        too_many = asyncio.run(_stop_request(url, model, "x", 1, [*stop_list, "one more"]))
        for i in range(settings.repeats):
            for beside in (False, True) if i % 2 == 0 else (True, False):
                requests = workload(settings.streams)
                extra = make_requests(tokenizer, [(settings.prompt_tokens, settings.output_tokens)], "stops", i)[0]

                async def both(requests=requests, extra=extra, beside=beside):
                    tasks = [run_arrivals(url, model, requests, [0.0] * len(requests))]
                    if beside:
                        tasks.append(_stop_request(url, model, extra[0], settings.output_tokens, stop_list))
                    return await asyncio.gather(*tasks)

                case = "beside the stop list" if beside else "alone"
                with row(progress, f"run {i + 1}: {settings.streams} streams {case}"), ServerTBT(url) as tbt:
                    out = asyncio.run(both())
                run = {"case": case, **_summary(*out[0]), "server_tbt_ms_mean": tbt.mean_ms}
                stops.append({**run, "stop_request_status": out[1] if beside else None})
            for watched in (False, True) if i % 2 == 0 else (True, False):
                requests = workload(settings.view_streams)
                case = "watched" if watched else "unwatched"
                with row(progress, f"run {i + 1}: {settings.view_streams} streams {case}"), ServerTBT(url) as tbt:
                    results, start, counts = asyncio.run(
                        _decode_with_watchers(url, model, requests, settings.subscribers if watched else 0)
                    )
                views.append({"case": case, **_summary(results, start), "server_tbt_ms_mean": tbt.mean_ms, **counts})
    return _result(settings, stops, views, too_many, files, server, machine_info())


def _result(settings, stops, views, too_many, files, server, machine) -> dict:
    alone = [r for r in stops if r["case"] == "alone"]
    beside = [r for r in stops if r["case"] != "alone"]
    plain = [r for r in views if r["case"] == "unwatched"]
    watched = [r for r in views if r["case"] == "watched"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    stop_summary = {
        "stop_list": {"strings": LIMITS.max_stop_strings, "characters_each": LIMITS.max_stop_length},
        "one_more_string_status": too_many,
        "tbt_ms_p50_alone": _median(alone, "tbt_ms_p50"),
        "tbt_ms_p50_beside": _median(beside, "tbt_ms_p50"),
        "tbt_ms_p99_alone": _median(alone, "tbt_ms_p99"),
        "tbt_ms_p99_beside": _median(beside, "tbt_ms_p99"),
        "server_tbt_ms_mean_alone": _median(alone, "server_tbt_ms_mean"),
        "server_tbt_ms_mean_beside": _median(beside, "server_tbt_ms_mean"),
    }
    stop_summary["tbt_p50_ratio"] = ratio(stop_summary["tbt_ms_p50_beside"], stop_summary["tbt_ms_p50_alone"])
    stop_summary["tbt_p99_ratio"] = ratio(stop_summary["tbt_ms_p99_beside"], stop_summary["tbt_ms_p99_alone"])
    view_summary = {
        "subscribers_tried": settings.subscribers,
        "accepted": max((r["accepted"] for r in watched), default=0),
        "refused": max((r["refused"] for r in watched), default=0),
        "failed_to_connect": max((r["failed"] for r in watched), default=0),
        "open_files_limit": files,
        "tok_per_s_unwatched": _median(plain, "output_tok_per_s"),
        "tok_per_s_watched": _median(watched, "output_tok_per_s"),
        "server_tbt_ms_mean_unwatched": _median(plain, "server_tbt_ms_mean"),
        "server_tbt_ms_mean_watched": _median(watched, "server_tbt_ms_mean"),
    }
    # decoding speed as the server makes tokens (1 / its mean TBT), watched over unwatched
    view_summary["speed_ratio"] = ratio(
        view_summary["server_tbt_ms_mean_unwatched"], view_summary["server_tbt_ms_mean_watched"]
    )
    view_summary["client_speed_ratio"] = ratio(view_summary["tok_per_s_watched"], view_summary["tok_per_s_unwatched"])
    result = {
        "benchmark": "serve-limits",
        "settings": asdict(settings),
        "machine": machine,
        "limits": asdict(LIMITS),
        "targets": {"tbt_p50_ratio_at_most": 2.0, "speed_ratio_at_least": 0.9},
        "stop_strings": {**stop_summary, "runs": stops},
        "view": {**view_summary, "runs": views},
        "server": {"command": server.command[1:], "exit_code": server.exit_code},
    }
    result["notes"] = notes(result)
    return result


def notes(result: dict) -> list[str]:
    out = []
    s, v = result["stop_strings"], result["view"]
    if s["one_more_string_status"] != 400:
        out.append(f"a stop list over the limit was answered {s['one_more_string_status']}, not 400")
    if any(r["failed"] or r["lost"] for r in s["runs"] + v["runs"]):
        out.append("some decoding requests failed or were lost (see the runs)")
    if s["tbt_p50_ratio"] is not None and s["tbt_p50_ratio"] > 2.0:
        out.append(f"TBT beside the stop list is {s['tbt_p50_ratio']:.2f}x alone: over the 2x target")
    if v["speed_ratio"] is not None and v["speed_ratio"] < 0.9:
        out.append(f"decoding while watched runs at {v['speed_ratio']:.2f}x: slowed by more than 10%")
    if v["failed_to_connect"]:
        out.append(f"{v['failed_to_connect']} watchers could not connect (open files limit {v['open_files_limit']})")
    return out


def header(settings: LimitsSettings) -> str:
    return (
        f"bench serve-limits: {settings.model}; {settings.streams} streams beside {LIMITS.max_stop_strings} stop "
        f"strings of {LIMITS.max_stop_length} chars; {settings.view_streams} streams under "
        f"{settings.subscribers} view watchers; {settings.repeats} runs of each case"
    )
