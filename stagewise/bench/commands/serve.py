"""`stagewise bench serve`: the server under real arrivals, continuous vs static batching.

The other benchmarks hand every request to the engine at t = 0. A server sees users arrive one by
one while others are being served. This benchmark starts `stagewise serve` (a child process on a
free loopback port) once per mode, sends requests to it with Poisson arrivals at each given rate
(`serve_client.py`), every request through its own streaming HTTP connection, and measures what the
users see: time to first token (TTFT), time between tokens (TBT), whole-request latency, and the
throughput of the server.

The two modes:

- continuous batching (`serve --mode paged`, the default): the engine schedules per step; a request
  that arrives joins the running batch at the next step (its prompt prefilled in chunks beside the
  others' decodes), and one that finishes leaves at once.
- static batching (`serve --mode kv`, the baseline): a batch is formed from the requests waiting when
  it starts (at most `max_num_seqs` of them, in arrival order); it runs until every request in it has
  finished, and a request that arrives meanwhile waits for the next batch, however short the batch's
  remaining requests or its own.

Under static batching the TTFT of a request depends on when it arrives: at an idle server, only its
own prefill; just after a batch started, the whole rest of that batch first. Its tail (p99) runs far
from its median. Continuous batching takes it in at the next step, so its TTFT stays near the median.
That difference shows most at a *low* rate, where most requests find the server idle (the median
is one prefill) and a few land in a running batch (the tail is a whole batch): hence the default
rates start at 0.1 req/s. At high rates both queue, and the medians grow too.

The workload is seeded: prompt and output lengths are drawn once and reused at every rate and in
every mode; greedy, `ignore_eos`, a `max_tokens` per request, so every request makes exactly that
many tokens. Each prompt starts with its own tag ("Request 2.17:") so no two requests of the whole
run share a KV block: the prefix cache (paged only) would otherwise serve a rate's prompts from the
rate before it.
"""

import asyncio
import random
import secrets
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from stagewise.bench.commands.serve_client import (
    arrival_offsets,
    inter_arrival_times,
    parse_rates,
    rate_value,
    run_arrivals,
    server_counters,
    summarize_results,
)
from stagewise.bench.commands.serve_process import ServerProcess
from stagewise.bench.harness.progress import row
from stagewise.errors import StagewiseError

MODES = {"paged": "continuous", "kv": "static"}  # serve --mode -> the batching it does
STATIC_RULE = (
    "static batching (serve --mode kv): a batch is formed from the requests waiting when it starts "
    "(at most max_num_seqs, in arrival order) and runs until all of them finish; later arrivals wait "
    "for the next batch"
)


@dataclass(frozen=True)
class ServeSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory (also gives the workload's tokenizer)
    url: str | None = None  # an already running server; None = start one per mode
    modes: tuple[str, ...] = ("paged", "kv")  # serve --mode values (with url: the mode that server runs)
    request_rates: tuple[str, ...] = ("0.1", "1", "inf")  # requests per second; inf = all at t = 0
    num_prompts: int = 24  # requests per rate
    prompt_tokens: tuple[int, int] = (16, 32)  # prompt length range (uniform)
    output_tokens: tuple[int, int] = (16, 40)  # max_tokens range (uniform)
    max_num_seqs: int = 8  # the server's seats: most running requests, and the static batch size
    backend: str = "torch"  # the server's stage tier
    threads: int | None = None  # the server's torch threads (OMP_NUM_THREADS); None = its default
    server_args: tuple[str, ...] = ()  # more `serve` options, passed as they are
    api_key: str | None = None  # with url: the server's --api-key
    seed: int = 0  # workload and arrival seed


QUICK = {"num_prompts": 6, "request_rates": ("8", "inf"), "prompt_tokens": (16, 32), "output_tokens": (4, 8)}


def check_settings(settings: ServeSettings) -> None:
    """Every setting in range, before a server starts."""
    from stagewise.bench.commands.modes import refuse_weightless

    refuse_weightless(settings.model, None)
    for mode in settings.modes:
        if mode not in MODES:
            raise StagewiseError(f"unknown mode '{mode}'; use {', '.join(MODES)}")
    if not settings.modes or len(set(settings.modes)) != len(settings.modes):
        raise StagewiseError("--modes needs distinct modes, e.g. paged,kv")
    if settings.url is not None:
        if not settings.url.startswith(("http://", "https://")):
            raise StagewiseError(f"--url must start with http:// or https://, got '{settings.url}'")
        if len(settings.modes) != 1:
            raise StagewiseError("with --url, --modes names the one mode that server runs (e.g. --modes paged)")
        if settings.server_args or settings.threads:
            raise StagewiseError("--server-arg and --threads set up the servers bench serve starts; not with --url")
    parse_rates(",".join(settings.request_rates))
    for name in ("num_prompts", "max_num_seqs"):
        if getattr(settings, name) < 1:
            raise StagewiseError(f"{name} must be >= 1, got {getattr(settings, name)}")
    for name in ("prompt_tokens", "output_tokens"):
        low, high = getattr(settings, name)
        if low < 2 or high < low:
            raise StagewiseError(f"{name} must be a range LOW-HIGH with 2 <= LOW <= HIGH, got {low}-{high}")


def header(settings: ServeSettings) -> str:
    """What the run does, in two lines (printed before it starts)."""
    where = settings.url or f"stagewise serve --model {settings.model}, one server per mode"
    return (
        f"bench serve: {settings.num_prompts} requests per rate, Poisson arrivals at "
        f"{', '.join(settings.request_rates)} req/s, against {where}; seats {settings.max_num_seqs}\n{STATIC_RULE}"
    )


def workload_tokenizer(model: str):
    """The model's tokenizer, without its weights (the workload counts prompt tokens with it)."""
    from pathlib import Path as _Path

    from stagewise.models import tokenizer_files
    from stagewise.models.files import smollm2_gguf_path
    from stagewise.tokenizer import Tokenizer

    if model == "tiny":
        return Tokenizer.tiny()
    if model == "smollm2-135m":
        return tokenizer_files.tokenizer_from_gguf(smollm2_gguf_path())
    path = _Path(model).expanduser()
    if path.is_dir():
        return tokenizer_files.tokenizer_from_hf_dir(path)
    if path.is_file():
        return tokenizer_files.tokenizer_from_gguf(path)
    raise StagewiseError(f"bench serve needs the model's tokenizer: '{model}' is not tiny, smollm2-135m or a file")


def make_lengths(settings: ServeSettings) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) per request: drawn once from the seed, the same at every rate and mode."""
    rng = random.Random(settings.seed)
    return [
        (rng.randint(*settings.prompt_tokens), rng.randint(*settings.output_tokens))
        for _ in range(settings.num_prompts)
    ]


def make_requests(tokenizer, lengths, tag: str, seed: int) -> list[tuple[str, int, int]]:
    """(prompt, its token count, max_tokens) per request; prompt i starts with `{tag}.{i}:` (no shared block)."""
    from stagewise.bench.harness.workloads import count_tokens, prompt_with_tokens

    rng = random.Random(seed)
    out = []
    for i, (prompt_tokens, max_tokens) in enumerate(lengths):
        label = f"Request {tag}.{i}:"
        body = prompt_with_tokens(tokenizer, max(1, prompt_tokens - count_tokens(tokenizer, label)), rng, lead=i)
        prompt = f"{label} {body}"
        out.append((prompt, count_tokens(tokenizer, prompt), max_tokens))
    return out


def served_model(url: str, api_key: str | None) -> str:
    """The model id the server serves (GET /v1/models): what every request must name."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0).json()["data"]
        return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise StagewiseError(f"{url}/v1/models did not name a model ({type(exc).__name__}: {exc})") from None


def server_args(settings: ServeSettings, mode: str, max_model_len: int) -> list[str]:
    """serve's options for one mode; the KV cache sized for the workload (every seat at its longest request)."""
    args = ["--model", settings.model, "--mode", mode, "--backend", settings.backend]
    args += ["--max-num-seqs", str(settings.max_num_seqs), "--max-model-len", str(max_model_len)]
    if mode == "paged":  # enough blocks that no request is ever preempted, instead of a share of free memory
        args += ["--kv-blocks", str(settings.max_num_seqs * -(-max_model_len // 16) + 1)]
    return args + list(settings.server_args)  # the user's last: a repeated option takes its last value


def run_serve(settings: ServeSettings, progress=None) -> dict:
    """Every mode's server, every rate; returns the result dict (raw per-request rows included).

    The servers of all modes load at the same time (loading is most of a short run's time), then are
    measured one after another: an idle server waits on its queue and takes no CPU from the one measured.
    """
    from stagewise.bench.harness.machine import machine_info

    check_settings(settings)
    tokenizer = workload_tokenizer(settings.model)
    lengths = make_lengths(settings)
    nonce = secrets.token_hex(3) if settings.url else ""  # a running server may hold an earlier run's prefixes
    warm = make_requests(tokenizer, [(16, 4), (16, 4)], f"{nonce}w", settings.seed)
    work = [make_requests(tokenizer, lengths, f"{nonce}{k}", settings.seed) for k in range(len(settings.request_rates))]
    longest = max(p + n for requests in [warm, *work] for _, p, n in requests)
    max_model_len = -(-(longest + 1) // 16) * 16  # rounded up to whole blocks
    env = {"OMP_NUM_THREADS": str(settings.threads)} if settings.threads else {}
    runs, servers = [], {}
    with tempfile.TemporaryDirectory(prefix="stagewise-bench-serve-") as tmp, ExitStack() as stack:
        started = {}
        if not settings.url:
            for mode in settings.modes:
                args = server_args(settings, mode, max_model_len)
                started[mode] = ServerProcess(args, Path(tmp) / f"{mode}.log", env)
                stack.callback(started[mode].stop)  # however the run ends, no server is left behind
                started[mode].start()
            for server in started.values():
                server.wait_ready()
        counters = {}
        for mode in settings.modes:
            url = started[mode].url if started else settings.url
            runs += _run_mode(settings, mode, url, warm, work, progress)
            counters[mode] = server_counters(url, settings.api_key)  # the server's own totals, warm-up included
        for server in started.values():
            server.terminate()  # all drain at once
        for mode, server in started.items():
            server.stop()
            servers[mode] = {"command": server.command[1:], "ready_s": server.ready_s, "exit_code": server.exit_code}
        for mode in settings.modes:
            servers.setdefault(mode, {"url": settings.url})["metrics"] = counters[mode]
    summary = {MODES[m]: {r["rate"]: r["summary"] for r in runs if r["mode"] == m} for m in settings.modes}
    result = {
        "benchmark": "serve",
        "machine": machine_info(),
        "settings": asdict(settings) | {"api_key": None},
        "static_batching": STATIC_RULE,
        "servers": servers,
        "workload": {
            "prompt_tokens": [p for _, p, _ in work[0]],  # of the first rate's prompts (tags differ by a digit)
            "max_tokens": [n for _, n in lengths],
            "max_model_len": max_model_len,
        },
        "summary": summary,
        "target": target(summary),
        "runs": runs,
    }
    result["notes"] = notes(result)
    return result


def _run_mode(settings, mode, url, warm, work, progress) -> list[dict]:
    model = served_model(url, settings.api_key)
    asyncio.run(run_arrivals(url, model, warm, [0.0, 0.0], api_key=settings.api_key))  # untimed
    runs = []
    for k, label in enumerate(settings.request_rates):
        requests = work[k]
        gaps = inter_arrival_times(len(requests), rate_value(label), settings.seed + k)
        with row(progress, f"{MODES[mode]:>10} ({mode}), {label} req/s", total=len(requests)) as bar:
            results, start = asyncio.run(
                run_arrivals(url, model, requests, arrival_offsets(gaps), bar.advance, settings.api_key)
            )
        runs.append(
            {
                "mode": mode,
                "system": MODES[mode],
                "rate": label,
                "summary": summarize_results(results, start),
                "requests": [r.row(start) for r in results],
                "errors": sorted({r.error for r in results if r.error})[:10],
            }
        )
    return runs


def target(summary: dict) -> dict:
    """The rates where static batching's TTFT p99 exceeds 10x its p50, and continuous's p99/p50 there."""
    static, cont = summary.get("static", {}), summary.get("continuous", {})
    rows = []
    for rate, s in static.items():
        ratio = s.get("ttft_p99_over_p50")
        if ratio is not None and ratio > 10 and rate in cont:
            c = cont[rate].get("ttft_p99_over_p50")
            rows.append({"rate": rate, "static_ttft_p99_over_p50": ratio, "continuous_ttft_p99_over_p50": c})
    met = any(r["continuous_ttft_p99_over_p50"] is not None and r["continuous_ttft_p99_over_p50"] <= 3 for r in rows)
    return {"rule": "static TTFT p99 > 10x p50, continuous <= 3x at that rate", "rates": rows, "met": met}


def notes(result: dict) -> list[str]:
    out = []
    for run in result["runs"]:
        s = run["summary"]
        if s["failed"] or s["lost"]:
            why = "; ".join(run["errors"]) or "streams ended early or short"
            out.append(f"{run['system']} at {run['rate']} req/s: {s['failed']} failed, {s['lost']} lost ({why})")
    for name, server in result["servers"].items():
        if server.get("exit_code") not in (None, 0, 143):
            out.append(f"the {name} server exited with status {server['exit_code']} after SIGTERM")
    if "static" in result["summary"] and "continuous" in result["summary"] and not result["target"]["rates"]:
        out.append("no rate here made static batching's TTFT p99 exceed 10x its p50")
    return out


def failures(result: dict) -> int:
    return sum(r["summary"]["failed"] + r["summary"]["lost"] for r in result["runs"])
