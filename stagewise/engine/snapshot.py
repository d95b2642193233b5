"""A picture of the paged engine after one step, as plain JSON-able values.

Continuous batching is easiest to understand by watching it: which requests
wait, which run, how far each one's `num_computed_tokens` has caught up with
its `num_tokens`, and which physical KV blocks each request holds. After every
engine step, `engine_snapshot(runner, ...)` reads that state from the
scheduler and the block manager and returns a dict of lists, ints and strings
only — the live view (`stagewise serve`, page at `/`) streams it to a browser,
and the trace (`trace --format json`, `serve --record`) stores one per step
under the key "view", so the same page can replay a run step by step.

    {
      "version": 1, "step": 12, "time": 1234.5,
      "queues": {"waiting": [id, ...], "running": [id, ...], "preempted": [id, ...]},
      "requests": {id: {num_prompt_tokens, num_computed_tokens, num_tokens, num_output_tokens,
                        status, blocks: [block id, ...], num_scheduled, phase, text_tail}},
      "finished": [{request_id, finish_reason}],      requests that left in this step
      "kv": {num_blocks, block_size, num_used, num_free,
             shared: [block id, ...],                 held by two or more requests (a shared prefix)
             cached: [block id, ...] | null,          no request holds it, the prefix cache keeps it
             prefix_cache: "hash" | "radix" | "none"},  the prefix cache in use
      "budget": {max_num_batched_tokens, prefill_beside_decodes,
                 prefill_tokens, decode_tokens, num_scheduled_requests},
      "latency": [{request_id, ttft_ms} or {request_id, tbt_ms}],   tokens produced in this step
      "counters": {preemptions, prefix_queried_tokens, prefix_hit_tokens, forked_tokens}
    }

The queues are the scheduler's, in order: `waiting` holds requests that have
never run, `preempted` the waiting requests that ran before and were sent
back (preemption by recompute: their blocks were freed, their tokens will be
computed again) — in the scheduler both sit in one FCFS queue, preempted ones
at its front. A block's owners are the requests whose block-table row lists
it; a prefix-cache hit, or parallel samples sharing their prompt, make two
rows list the same block. "cached" blocks are held by no request: the hashed
cache's are free blocks that keep their name, the radix cache's are blocks its
tree holds (they count in num_used).

It runs every step, so it only walks what the engine holds (requests in the
queues, block ids in block-table rows), never the whole block pool.
"""

from collections import Counter

from stagewise.engine.request import Request

SNAPSHOT_VERSION = 1  # bump when a field changes meaning; the page checks it
TEXT_TAIL = 48  # characters of each request's latest output text the view shows
MAX_CACHED_LISTED = 4096  # above this many named blocks, the free cached ones are not listed


def _phase(req: Request, num_new: int, samples: bool) -> str:
    """What the step did for a request, judged after it settled."""
    computed_before = req.num_computed_tokens - num_new
    if num_new == 1 and computed_before >= req.num_prompt_tokens:
        return "decode"  # the one token sampled last step
    return "prefill" if samples else "prefill chunk"  # a chunk: more of the prompt to come


def _request_entry(req: Request, blocks: list[int]) -> dict:
    text = req.text_stream.text
    return {
        "num_prompt_tokens": req.num_prompt_tokens,
        "num_computed_tokens": req.num_computed_tokens,  # K/V in the cache
        "num_tokens": req.num_tokens,  # prompt + output so far
        "num_output_tokens": len(req.output_token_ids),
        "max_tokens": req.params.max_tokens,
        "status": req.status.value,
        "blocks": blocks,  # block-table row, in logical order
        "num_scheduled": 0,  # tokens computed for it in this step
        "phase": None,  # "prefill", "prefill chunk", "decode" or "verify" when scheduled
        "text_tail": text[-TEXT_TAIL:],
    }


def _latency_item(s) -> dict | None:
    """The TTFT or TBT of the token a scheduled request sampled in the step, if it sampled one."""
    req, times = s.request, s.request.token_times
    if not (s.samples and times):
        return None
    if len(times) == 1:
        return {"request_id": req.request_id, "ttft_ms": (times[0] - req.arrival_time) * 1e3}
    return {"request_id": req.request_id, "tbt_ms": (times[-1] - times[-2]) * 1e3}


def step_latency(runner) -> list[dict]:
    """Only the "latency" entry of the latest step's snapshot (cheap: the step's requests only)."""
    last = getattr(runner, "last_step", None)
    items = (_latency_item(s) for s in (last.scheduled if last is not None else ()))
    return [item for item in items if item is not None]


def engine_snapshot(
    runner, *, step_index: int, step_stats: dict | None, now: float, idle: bool = False
) -> dict:
    """The state of a `PagedRunner` after its latest step (see the module docstring).

    `step_stats`: extra numbers about the step the caller measured (e.g. its wall time);
    they are copied into the snapshot's "budget" entry. `now`: the time to stamp it with,
    in the caller's clock (seconds). `idle`: no step ran since the latest one, only requests
    left (a server's aborted requests): the snapshot schedules nothing.
    """
    sched = runner.scheduler
    bm = runner.block_manager
    requests: dict[str, dict] = {}
    preempted, waiting = [], []
    for req in sched.waiting:  # one FCFS queue: preempted requests sit at its front
        (preempted if req.first_scheduled_time is not None else waiting).append(req.request_id)
        requests[req.request_id] = _request_entry(req, [])
    running = []
    for req in sched.running:
        running.append(req.request_id)
        requests[req.request_id] = _request_entry(req, bm.block_ids(req.request_id))

    last = None if idle else getattr(runner, "last_step", None)  # the settled step
    prefill = decode = 0
    finished, latency = [], []
    for s in last.scheduled if last is not None else ():
        req = s.request
        entry = requests.get(req.request_id)
        if entry is None:  # it finished in this step: show it once more, holding nothing
            entry = requests[req.request_id] = _request_entry(req, [])
            reason = req.finish_reason.value if req.finish_reason else None
            finished.append({"request_id": req.request_id, "finish_reason": reason})
        # a verify step (speculative decoding): the last token and its guesses, a decode's work
        phase = "verify" if s.num_spec_tokens else _phase(req, s.num_new_tokens, s.samples)
        entry["num_scheduled"], entry["phase"] = s.num_new_tokens, phase
        if phase in ("decode", "verify"):
            decode += s.num_new_tokens
        else:
            prefill += s.num_new_tokens
        item = _latency_item(s)
        if item is not None:
            latency.append(item)

    rows = Counter(b for blocks in bm.req_blocks.values() for b in blocks)
    shared = [b for b, n in rows.items() if n > 1]
    cached = bm.prefixes.cached_blocks(MAX_CACHED_LISTED)  # None: too many to list
    budget = {
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "prefill_beside_decodes": sched.prefill_beside_decodes,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "num_scheduled_requests": len(last.scheduled) if last is not None else 0,
        **(step_stats or {}),
    }
    stats = bm.stats
    return {
        "version": SNAPSHOT_VERSION,
        "step": step_index,
        "time": now,
        "queues": {"waiting": waiting, "running": running, "preempted": preempted},
        "requests": requests,
        "finished": finished,
        "kv": {
            "num_blocks": bm.num_blocks,
            "block_size": bm.block_size,
            "num_used": bm.num_used_blocks,
            "num_free": bm.num_free_blocks,
            "shared": sorted(shared),
            "cached": cached,
            "prefix_cache": bm.prefix_cache,
        },
        "budget": budget,
        "latency": latency,
        "counters": {
            "preemptions": sched.num_preemptions,
            "prefix_queried_tokens": stats.queried_tokens,
            "prefix_hit_tokens": stats.hit_tokens,
            "forked_tokens": stats.forked_tokens,
        },
    }
