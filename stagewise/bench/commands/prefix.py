"""Prefix caches side by side: none vs hash (vLLM) vs radix (SGLang) on the workloads where they differ.

`stagewise bench prefix` writes prefix.json + prefix.png. Each workload runs once per cache, on its
own engine (the same model), as rounds of requests submitted together; a later round may extend an
earlier one's outputs, as a chat does:

    chat       C conversations over T turns: turn t + 1's prompt is turn t's prompt, its answer and
               a new user message (token ids, never re-tokenized); a system prompt shared by all
    few-shot   one request per round, each with the same K examples in its own order, then its
               question: a prefix is shared up to the first example where two orders differ
    samples    P prompts of `prompt_tokens` tokens, each asked twice with n seeded samples: the
               samples share the prompt's blocks (parallel sampling, any cache), and the second
               asking finds it in the cache

Measured per workload and cache: tokens reused (prefix-cache hits, and the prompt blocks the n
samples shared), tokens computed, mean time to first token, the most blocks requests held at once
and the most the pool had in use (the radix tree keeps blocks of its own), lookup time per request
(hashing the prompt's blocks, or walking the tree), and whether every request's tokens and
log-probabilities equal the run without a cache, bit for bit (greedy answers; the samples draw from
seeded streams).
"""

import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from stagewise.bench.harness.machine import machine_info
from stagewise.config import PREFIX_CACHES, EngineConfig
from stagewise.engine.llm import LLM
from stagewise.engine.outputs import RequestOutput
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams

WORKLOADS = ("chat", "few-shot", "samples")
SYSTEM = "You are a helpful assistant. Answer in one or two short sentences, then stop."
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Name a prime number larger than ten.",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is water made of?",
    "Tell me a fact about cats.",
)
EXAMPLES = tuple(f"Q: {q}\nA: an answer of a few words about it.\n" for q in QUESTIONS)
LOGPROBS = 4  # top log-probabilities kept per token, for the bitwise comparison


@dataclass(frozen=True)
class PrefixSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    backend: str = "torch"  # stage tier
    caches: tuple[str, ...] = ("none", "hash", "radix")  # compared; the first is the reference
    workloads: tuple[str, ...] = WORKLOADS
    block_size: int = 16  # tokens per KV block
    max_tokens: int = 24  # greedy tokens per answer (chat, few-shot) or per sample
    conversations: int = 4  # chat: conversations running together
    turns: int = 6  # chat: turns per conversation
    examples: int = 6  # few-shot: examples shared by every prompt (up to 8)
    few_shot_requests: int = 8  # few-shot: prompts, one per round
    samples: int = 4  # samples: n
    sample_prompts: int = 2  # samples: prompts, each asked twice
    prompt_tokens: int = 500  # samples: tokens per prompt
    max_num_seqs: int = 16  # seats
    repeats: int = 3  # timed runs of each workload per cache, alternating caches (medians reported)
    seed: int = 0  # the text and the samples' seeds
    batch_invariant: bool = True  # the bitwise comparison needs it


def quick_settings(model: str = "tiny") -> PrefixSettings:
    """Tiny sizes: a smoke run that proves the benchmark runs, not a measurement."""
    return PrefixSettings(
        model=model, max_tokens=4, conversations=2, turns=3, examples=3, few_shot_requests=3,
        samples=2, sample_prompts=1, prompt_tokens=40, max_num_seqs=4, repeats=1,
    )  # fmt: skip


def check_settings(s: PrefixSettings) -> None:
    for name in ("block_size", "max_tokens", "conversations", "turns", "examples", "few_shot_requests",
                 "samples", "sample_prompts", "prompt_tokens", "max_num_seqs", "repeats"):  # fmt: skip
        if getattr(s, name) < 1:
            raise StagewiseError(f"{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    bad = [c for c in s.caches if c not in PREFIX_CACHES]
    if bad or not s.caches:
        raise StagewiseError(f"unknown prefix cache {bad[0] if bad else ''!r}; use {', '.join(PREFIX_CACHES)}")
    bad = [w for w in s.workloads if w not in WORKLOADS]
    if bad or not s.workloads:
        raise StagewiseError(f"unknown workload {bad[0] if bad else ''!r}; use {', '.join(WORKLOADS)}")
    if s.examples > len(EXAMPLES):
        raise StagewiseError(f"examples must be <= {len(EXAMPLES)}, got {s.examples}")
    if s.samples > 16:
        raise StagewiseError(f"samples must be <= 16 (SamplingParams.n), got {s.samples}")


# ---- the workloads: rounds of (prompt token ids, params); `ask` runs one round ----


def chat(llm: LLM, s: PrefixSettings, ask) -> None:
    rng = random.Random(s.seed)
    greedy = SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True, logprobs=LOGPROBS)
    system = llm.encode(SYSTEM)
    histories = [system + llm.encode(f"\nUser: {rng.choice(QUESTIONS)}\nAssistant:") for _ in range(s.conversations)]
    for _ in range(s.turns):
        outs = ask([(h, greedy) for h in histories])
        follow = [llm.encode(f"\nUser: {rng.choice(QUESTIONS)} Why?\nAssistant:") for _ in histories]
        histories = [h + o.token_ids + f for h, o, f in zip(histories, outs, follow)]


def few_shot(llm: LLM, s: PrefixSettings, ask) -> None:
    rng = random.Random(s.seed + 1)
    greedy = SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True, logprobs=LOGPROBS)
    head = llm.encode("Answer the last question as the examples do.\n")
    examples = [llm.encode(e) for e in EXAMPLES[: s.examples]]
    for i in range(s.few_shot_requests):
        order = rng.sample(range(s.examples), s.examples)
        question = llm.encode(f"Q: {QUESTIONS[i % len(QUESTIONS)]} (number {i})\nA:")
        ask([(head + [t for k in order for t in examples[k]] + question, greedy)])


def samples(llm: LLM, s: PrefixSettings, ask) -> None:
    rng = random.Random(s.seed + 2)
    vocab = llm.config.vocab_size
    for p in range(s.sample_prompts):
        ids = [rng.randrange(vocab) for _ in range(s.prompt_tokens)]
        params = SamplingParams(
            max_tokens=s.max_tokens, temperature=0.8, seed=s.seed + 100 * p, n=s.samples,
            ignore_eos=True, logprobs=LOGPROBS,
        )  # fmt: skip
        ask([(ids, params)])
        ask([(ids, params)])  # asked again: the prompt is in the cache now


RUNS = {"chat": chat, "few-shot": few_shot, "samples": samples}


# ---- running one workload on one cache ----


def requests_from_ids(llm: LLM, prompts: list[tuple[list[int], SamplingParams]]):
    """Requests (and their parallel samples) whose prompts are token ids."""
    firsts = []
    for ids, params in prompts:
        req = llm.make_request("x", params)
        req.prompt_token_ids = list(ids)
        if len(ids) + params.max_tokens > llm.max_model_len:
            raise StagewiseError(f"a prompt of {len(ids)} tokens + {params.max_tokens} exceeds max_model_len")
        firsts.append(req)
    return firsts + [r for f in firsts for r in llm._more_samples(f)]


def run_workload(llm: LLM, name: str, s: PrefixSettings) -> dict:
    """Run a workload on `llm`'s paged engine, stepping it by hand to read the blocks after each step."""
    engine, bm = llm.engine, llm.engine.block_manager
    done: list = []  # every request, in submission order
    held, used, steps, computed = [], [], 0, 0

    def ask(prompts):
        nonlocal steps, computed
        requests = requests_from_ids(llm, prompts)
        for r in requests:
            engine.add(r)
        while engine.has_unfinished():
            engine.step()
            steps += 1
            computed += engine.last_step.num_tokens if engine.last_step else 0
            held.append(bm.num_held_blocks())
            used.append(bm.num_used_blocks)
        done.extend(requests)
        return [RequestOutput.of(r) for r in requests if r.fork_of is None]

    before, start = bm.stats.__class__(**asdict(bm.stats)), time.perf_counter()
    RUNS[name](llm, s, ask)
    wall = time.perf_counter() - start
    st = bm.stats
    lookups = st.lookups - before.lookups
    outputs = [RequestOutput.of(r) for r in done]
    return {
        "requests": len(done),
        "prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "hit_tokens": st.hit_tokens - before.hit_tokens,
        "forked_tokens": st.forked_tokens - before.forked_tokens,
        "reused_tokens": st.hit_tokens - before.hit_tokens + st.forked_tokens - before.forked_tokens,
        "computed_tokens": computed,
        "steps": steps,
        "ttft_ms": 1000 * sum(o.metrics.ttft for o in outputs) / len(outputs),
        "peak_blocks_held": max(held, default=0),
        "peak_blocks_used": max(used, default=0),
        "lookup_us_per_request": 1e6 * (st.lookup_seconds - before.lookup_seconds) / lookups if lookups else 0.0,
        "wall_s": wall,
        "_outputs": outputs,  # for the comparison; dropped before the JSON
    }


def same_bits(a: RequestOutput, b: RequestOutput) -> bool:
    la, lb = a.logprobs, b.logprobs
    return a.token_ids == b.token_ids and torch.equal(la.values, lb.values) and torch.equal(la.token_ids, lb.token_ids)


def run_prefix(settings: PrefixSettings, progress=None) -> dict:
    check_settings(settings)
    s = settings
    loaded = load_model(s.model)
    longest = min(2048, loaded.config.max_position_embeddings)
    ecfg = EngineConfig(max_num_seqs=s.max_num_seqs, block_size=s.block_size, max_model_len=longest)

    def fresh(cache: str) -> LLM:  # an empty cache for every run
        bi = s.batch_invariant
        return LLM(loaded, backend=s.backend, engine_config=ecfg, prefix_cache=cache, batch_invariant=bi)

    for cache in s.caches:  # warm-up, untimed: every stage's first call
        fresh(cache).generate(["warm up"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    results: dict[str, dict[str, dict]] = {}
    task = progress.add_task("prefix", total=len(s.workloads) * len(s.caches) * s.repeats) if progress else None
    for name in s.workloads:
        runs: dict[str, list[dict]] = {cache: [] for cache in s.caches}
        for k in range(s.repeats):
            order = s.caches[k % len(s.caches) :] + s.caches[: k % len(s.caches)]  # alternate who goes first
            for cache in order:
                runs[cache].append(run_workload(fresh(cache), name, s))
                if progress:
                    progress.advance(task)
        results[name] = {cache: summarize(runs[cache]) for cache in s.caches}
        reference = runs[s.caches[0]][0]["_outputs"]
        for cache, r in results[name].items():
            r["identical"] = all(same_bits(a, b) for run in runs[cache] for a, b in zip(reference, run["_outputs"]))
    chat_runs, notes, extra = results.get("chat", {}), [], None
    if "hash" in chat_runs and "radix" in chat_runs:
        later_turns = s.conversations * (s.turns - 1)
        extra = (chat_runs["radix"]["reused_tokens"] - chat_runs["hash"]["reused_tokens"]) / max(1, later_turns)
        notes.append(
            f"chat: radix reused {extra:.1f} tokens more per turn than hash (block size {s.block_size}: "
            f"(block_size - 1) / 2 = {(s.block_size - 1) / 2:.1f} expected)"
        )
    if any(not r["identical"] for runs in results.values() for r in runs.values()):
        notes.append("some outputs differ from the run without a cache (see 'same bits')")
    return {
        "benchmark": "prefix",
        "settings": asdict(s),
        "machine": machine_info(),
        "model": fresh(s.caches[0]).describe(),
        "results": results,
        "chat_extra_tokens_per_turn": extra,  # radix's reuse over hash's, per chat turn after the first
        "notes": notes,
    }


TIMED = ("ttft_ms", "lookup_us_per_request", "wall_s")  # medians over the repeats; the rest is counted


def summarize(runs: list[dict]) -> dict:
    """One cache's repeats of a workload: the counts (equal in every run) and median times."""
    out = {k: v for k, v in runs[0].items() if not k.startswith("_")}
    for key in TIMED:
        out[key] = statistics.median(r[key] for r in runs)
        out[f"{key}_runs"] = [round(r[key], 3) for r in runs]
    return out
