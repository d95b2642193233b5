"""Soak: thousands of mixed requests through one paged engine; nothing lost, nothing changed, nothing leaked.

Not a unit test (it runs for minutes): `stagewise bench soak` writes soak.json + soak.png.

The workload is built to stress what goes wrong under load:

- shared prefixes (a few "system prompts" in front of varied questions), so the
  prefix cache hands the same blocks to many requests;
- a KV pool far smaller than the load (preemption by recompute, again and again);
- greedy and seeded-sampling requests, some with stop strings;
- requests arriving while others run (`add_request` between `step()`s), and
  streams that run alongside and are abandoned halfway (their requests aborted).

Checks, each recorded in the result:

- nothing lost: every hand-added request gets each of its tokens exactly once,
  through `step()`, ending with exactly one finished event;
- nothing changed: every finished request's tokens equal the same request run
  alone on a fresh engine (greedy and seeded sampling alike);
- nothing leaked: every KV block is free at the end, and the process's resident
  memory does not grow over the run (sampled every few hundred steps).
"""

import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from stagewise.bench.machine import machine_info
from stagewise.bench.plots import save_figure
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
    seed: int = 0  # workload seed


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
    if settings.num_requests < 1 or settings.arrivals_per_step < 1 or settings.streams_every < 1:
        raise StagewiseError("num_requests, arrivals_per_step and streams_every must be >= 1")
    ecfg = EngineConfig(
        max_num_seqs=settings.max_num_seqs, num_kv_blocks=settings.num_kv_blocks, block_size=settings.block_size
    )
    llm = LLM(settings.model, engine_config=ecfg)
    work = make_workload(settings)
    task = progress.add_task("soak", total=len(work)) if progress else None
    pending = list(reversed(work))
    ids: dict[str, tuple[str, SamplingParams]] = {}
    tokens = defaultdict(list)  # request id -> token ids received (kept compact: the run holds them all)
    finished = defaultdict(int)  # request id -> finished events received
    blocks, memory, abandoned = [], [], 0
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
        for event in llm.step():
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

    lost = [rid for rid in ids if finished[rid] != 1]
    alone = LLM(llm.loaded, mode="kv")  # the reference: each request by itself (same weights)
    reference: dict[tuple, list[int]] = {}
    mismatched = []
    for rid, (prompt, params) in ids.items():
        key = (prompt, params)
        if key not in reference:
            reference[key] = alone.generate(prompt, params)[0].token_ids
        if tokens[rid] != reference[key]:
            mismatched.append(rid)
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
            "lost_requests": len(lost),
            "outputs_differing_from_alone": len(mismatched),
            "blocks_held_at_end": bm.num_used_blocks,
            "rss_mib_first_quarter_to_end_growth": round(growth, 1),
        },
        "blocks_in_use": blocks,
        "rss_mib": memory,
        "lost": lost[:20],
        "mismatched": mismatched[:20],
    }
    ok = not lost and not mismatched and bm.num_used_blocks == 0
    result["notes"] = [] if ok else ["the soak found lost, changed or leaked requests: see lost / mismatched"]
    result["ok"] = ok
    return result


def soak_table(result: dict):
    from rich.table import Table

    table = Table(title="soak: one paged engine under mixed load")
    table.add_column("check")
    table.add_column("value", justify="right")
    for key, value in result["summary"].items():
        table.add_row(key.replace("_", " "), str(value))
    return table


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
