"""Soak: thousands of mixed requests through one paged engine; nothing lost, nothing changed, nothing leaked.

Not a unit test (it runs for minutes): `stagewise bench soak` writes soak.json + soak.png.

The workload is built to stress what goes wrong under load:

- shared prefixes (a few "system prompts" in front of varied questions), so the
  prefix cache hands the same blocks to many requests;
- a KV pool far smaller than the load (preemption by recompute, again and again);
- greedy and seeded-sampling requests, some with stop strings;
- requests arriving while others run (`add_request` between `step()`s), and
  streams that run alongside and are abandoned halfway (their requests aborted);
- bursts of real Ctrl-C (SIGINTs 20 us - 2 ms apart, `bench/harness/bursts.py`) landing
  on streams: in their steps, in their cleanup, in the cleanup of the cleanup;
- a thread that calls `generate` while the main thread streams (the threads take
  turns under the LLM's lock, step by step).

Checks, each recorded in the result:

- nothing lost: every hand-added request gets each of its tokens exactly once,
  through `step()`, ending with exactly one finished event;
- nothing changed: every finished request's tokens (hand-added, streamed, or
  generated in the other thread) equal the same request run alone on a fresh
  engine (greedy and seeded sampling alike); no request ends with an error;
- nothing leaked: every KV block is free at the end, and the process's resident
  memory does not grow over the run (sampled every few hundred steps).

With speculative decoding on (`speculative`, e.g. "ngram:4"), the same checks
run, with one exception: a seeded-sampling request's draws depend on how many
guesses each of its steps verified, and the token budget or a short KV pool
can cut those, so its tokens are not compared with a run alone (its length
and its single finished event still are). Greedy outputs must still be equal.
"""

import random
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from stagewise.bench.harness.bursts import InterruptBurst
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.plots import save_figure
from stagewise.config import EngineConfig
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.sampling_params import SamplingParams

PREFIXES = (
    "You are a careful assistant. Answer briefly and check every number twice before you answer.",
    "System: the user is a student. Explain each step, one short sentence at a time, then stop.",
    "Context: the cat sat on the mat, and then the cat ran far away quickly to the old mill.",
)
QUESTIONS = ("what happened next", "why", "and then", "who sat on the mat", "how far is it", "tell me more", "7 !")


@dataclass(frozen=True)
class SoakSettings:
    model: str = "tiny"  # preset, .gguf or Hugging Face directory
    num_requests: int = 2000  # requests added by hand (streams come on top)
    max_tokens: tuple[int, int] = (4, 40)  # output length range
    arrivals_per_step: int = 3  # requests added before each step while the workload lasts
    streams_every: int = 50  # every this many steps, a stream of 3 requests runs 5 events, then is abandoned
    max_num_seqs: int = 8  # seats
    num_kv_blocks: int = 24  # a tiny pool: preemption is the normal case
    block_size: int = 16  # tokens per block
    memory_every: int = 50  # sample resident memory every this many steps
    interrupts_every: int = 40  # every this many steps, streams run under a burst of real SIGINTs
    burst_size: int = 4  # SIGINTs per burst
    threads_every: int = 60  # every this many steps, a thread calls generate while a stream runs
    seed: int = 0  # workload seed
    speculative: str | None = None  # speculative decoding: "ngram:4", JSON (None: off)
    prefix_cache: str = "hash"  # the engine's prefix cache: hash, radix or none


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    except OSError:
        return 0.0


def make_workload(settings: SoakSettings) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(settings.seed)
    low, high = settings.max_tokens
    work = []
    for i in range(settings.num_requests):
        prompt = f"{rng.choice(PREFIXES)} {rng.choice(QUESTIONS)} {i % 17}"
        max_tokens = rng.randint(low, high)
        kind = rng.random()
        if kind < 0.5:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        elif kind < 0.8:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=rng.randrange(8))
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=(rng.choice(("e", "a", "t")),))
        work.append((prompt, params))
    return work


def run_soak(settings: SoakSettings, progress=None) -> dict:
    counts = ("num_requests", "arrivals_per_step", "streams_every", "interrupts_every", "threads_every")
    if any(getattr(settings, name) < 1 for name in counts):
        raise StagewiseError(f"{', '.join(counts)} must be >= 1")
    ecfg = EngineConfig(
        max_num_seqs=settings.max_num_seqs, num_kv_blocks=settings.num_kv_blocks, block_size=settings.block_size
    )
    llm = LLM(
        settings.model, engine_config=ecfg, speculative_config=settings.speculative, prefix_cache=settings.prefix_cache
    )
    work = make_workload(settings)
    task = progress.add_task("soak", total=len(work)) if progress else None
    pending = list(reversed(work))
    ids: dict[str, tuple[str, SamplingParams]] = {}
    tokens = defaultdict(list)  # request id -> token ids received (kept compact: the run holds them all)
    finished = defaultdict(int)  # request id -> finished events received
    blocks, memory, abandoned = [], [], 0
    rng = random.Random(settings.seed + 1)
    checked: list[tuple[str, SamplingParams, list[int]]] = []  # streamed / threaded, run to the end
    faults = {"bursts": 0, "sigints_sent": 0, "sigints_raised": 0, "streams_cut": 0, "threads": 0}
    errors = []  # request ids that ended with finish_reason "error"
    steps, start = 0, time.perf_counter()
    while pending or llm.has_unfinished_requests():
        for _ in range(settings.arrivals_per_step):
            if pending:
                prompt, params = pending.pop()
                ids[llm.add_request(prompt, params)] = (prompt, params)
        if steps and steps % settings.streams_every == 0:  # a stream joins, runs a little, is dropped
            stream = llm.stream([p for p, _ in work[:3]], [SamplingParams(max_tokens=30, temperature=0)] * 3)
            for n, _ in enumerate(stream):
                if n == 4:
                    break
            stream.close()
            abandoned += 1
        if steps and steps % settings.interrupts_every == 0:
            picks = rng.sample(work, 3)
            streams_under_interrupts(llm, picks, settings.burst_size, rng.randrange(2**31), faults, checked)
        if steps and steps % settings.threads_every == 0:
            generate_beside_a_stream(llm, rng.sample(work, 3), checked)
            faults["threads"] += 1
        for event in llm.step():
            if event.finish_reason == "error":
                errors.append(event.request_id)
            tokens[event.request_id].append(event.token_id)
            finished[event.request_id] += event.finished
            if event.finished and progress:
                progress.advance(task)
        blocks.append(llm.engine.block_manager.num_used_blocks)
        if steps % settings.memory_every == 0:
            memory.append((steps, resident_mib()))
        steps += 1
    wall_s = time.perf_counter() - start
    memory.append((steps, resident_mib()))
    bm = llm.engine.block_manager
    kept = bm.num_used_blocks  # with the radix cache: blocks its tree keeps for later requests
    bm.prefixes.evict(bm.num_blocks)  # once the tree lets them go, no block may stay held
    kept -= bm.num_used_blocks

    lost = [rid for rid in ids if finished[rid] != 1]
    alone = LLM(llm.loaded, mode="kv")  # the reference: each request by itself (same weights)
    reference: dict[tuple, list[int]] = {}
    mismatched, not_compared = [], 0
    for rid, (prompt, params) in ids.items():
        key = (prompt, params)
        if settings.speculative and not params.greedy:  # its draws depend on the guesses it got
            not_compared += 1
            if not 1 <= len(tokens[rid]) <= params.max_tokens or None in tokens[rid]:
                mismatched.append(rid)
            continue
        if key not in reference:
            reference[key] = alone.generate(prompt, params)[0].token_ids
        if tokens[rid] != reference[key]:
            mismatched.append(rid)
    for n, (prompt, params, got) in enumerate(checked):
        key = (prompt, params)
        if settings.speculative and not params.greedy:
            not_compared += 1
            continue
        if key not in reference:
            reference[key] = alone.generate(prompt, params)[0].token_ids
        if got != reference[key]:
            mismatched.append(f"streamed-{n}")
    warm = [mib for step, mib in memory if step >= steps // 4] or [m for _, m in memory]
    growth = max(warm) - warm[0]
    result = {
        "benchmark": "soak",
        "machine": machine_info(),
        "settings": asdict(settings),
        "summary": {
            "requests": len(ids),
            "abandoned_streams": abandoned,
            "step_calls": steps,  # llm.step() calls by the hand-stepping loop
            "engine_steps": llm.engine.stats.steps,  # engine iterations, those run by the streams included
            "wall_s": round(wall_s, 1),
            "output_tokens": sum(len(v) for v in tokens.values()),
            "preemptions": llm.engine.scheduler.num_preemptions,
            "prefix_cache_hit_rate": round(bm.stats.hit_rate, 3),
            "distinct_references": len(reference),
            "interrupt_bursts": faults["bursts"],
            "sigints_sent": faults["sigints_sent"],
            "sigints_in_engine_calls": faults["sigints_raised"],  # those that raised KeyboardInterrupt
            "streams_cut_by_sigint": faults["streams_cut"],
            "generate_threads_beside_streams": faults["threads"],
            "streamed_requests_checked": len(checked),
            "requests_ended_in_error": len(errors),
            "lost_requests": len(lost),
            "outputs_differing_from_alone": len(mismatched),
            "sampled_outputs_not_compared": not_compared,  # speculative runs only
            **spec_counters(llm),
            "blocks_kept_by_prefix_cache": kept,
            "blocks_held_at_end": bm.num_used_blocks,
            "rss_mib_first_quarter_to_end_growth": round(growth, 1),
        },
        "blocks_in_use": blocks,
        "rss_mib": memory,
        "lost": lost[:20],
        "mismatched": mismatched[:20],
    }
    ok = not lost and not mismatched and not errors and bm.num_used_blocks == 0
    result["notes"] = [] if ok else ["the soak found lost, changed or leaked requests: see lost / mismatched"]
    result["ok"] = ok
    return result


def spec_counters(llm) -> dict:
    """Guesses verified and kept by the engine (since its counters were last reset)."""
    stats = llm.engine.stats
    if llm.speculative_config is None:
        return {}
    return {
        "spec_draft_tokens": stats.spec_draft_tokens,
        "spec_accepted_tokens": stats.spec_accepted_tokens,
        "spec_acceptance_rate": round(stats.spec_acceptance_rate, 3),
    }


def streams_under_interrupts(llm, picks, count: int, seed: int, faults: dict, checked: list) -> None:
    """Streams of `picks` run, again and again, while a burst of `count` real SIGINTs lands on them.

    Each interrupt that lands inside the LLM cuts its stream (its requests are aborted, whatever
    the next interrupt then cuts in the cleanup); a stream that runs to its end is checked."""
    prompts, params = [p for p, _ in picks], [sp for _, sp in picks]
    with InterruptBurst(count=count, burst_size=count, pause_s=(0.001, 0.01), seed=seed) as burst:
        while burst.running:
            events = []
            try:
                burst.armed = True
                for event in llm.stream(prompts, params):
                    events.append(event)
                burst.armed = False
            except KeyboardInterrupt:
                burst.armed = False
                faults["streams_cut"] += 1
                continue
            checked.extend(outputs_of(prompts, params, events))
    faults["bursts"] += 1
    faults["sigints_sent"] += burst.sent
    faults["sigints_raised"] += burst.raised


def generate_beside_a_stream(llm, picks, checked: list) -> None:
    """A thread calls `generate` for two requests while this thread streams the third."""
    (p0, sp0), rest = picks[0], picks[1:]
    result = {}

    def generate():
        try:
            result["outputs"] = llm.generate([p for p, _ in rest], [sp for _, sp in rest])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the soak's thread
            result["error"] = exc

    thread = threading.Thread(target=generate)
    stream = llm.stream(p0, sp0)
    events = [next(stream)]
    thread.start()
    events += list(stream)
    thread.join()
    if "error" in result:
        raise result["error"]
    checked.extend(outputs_of([p0], [sp0], events))
    checked.extend((p, sp, o.token_ids) for (p, sp), o in zip(rest, result["outputs"]))


def outputs_of(prompts, params, events) -> list[tuple[str, SamplingParams, list[int]]]:
    """(prompt, params, token ids) of each request of a stream that ran to its end."""
    return [(p, sp, [e.token_id for e in events if e.index == i]) for i, (p, sp) in enumerate(zip(prompts, params))]


def soak_table(result: dict):
    from stagewise.trace.fit import Col, FitTable

    rows = [[key.replace("_", " "), str(value)] for key, value in result["summary"].items()]
    return FitTable("soak: one paged engine under mixed load", [Col("check", wrap=True), Col("value", "right")], rows)


def plot_soak(result: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(result["blocks_in_use"], linewidth=0.6)
    top.axhline(result["settings"]["num_kv_blocks"], linestyle=":", color="gray", label="pool")
    top.set_ylabel("KV blocks in use")
    top.legend(fontsize=7)
    steps, mib = zip(*result["rss_mib"])
    bottom.plot(steps, mib, marker="o")
    bottom.set_ylabel("resident memory (MiB)")
    bottom.set_xlabel("step() call")
    top.set_title(f"soak: {result['summary']['requests']} requests, {result['summary']['preemptions']} preemptions")
    save_figure(fig, path)
