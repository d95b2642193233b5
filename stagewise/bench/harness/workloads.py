"""Seeded benchmark workloads: prompts of an exact token length, greedy, fixed output lengths.

A benchmark must be repeatable: the same seed gives the same prompts, the same
lengths and (greedy, `ignore_eos=True`, a `max_tokens` per request) the same
number of output tokens on every run and every system, so two runs differ only
in how fast they are.

Prompts are real English sentences (the tiny tokenizer's training text plus a
few paragraphs paraphrasing the seeds), shuffled by the seed and cut at a
token boundary so that the *model's own tokenizer* turns the prompt into
exactly the requested number of tokens. Each prompt is a different shuffle,
and the prompts of a workload start with different sentences, so they share
no KV block (the prefix cache would otherwise turn a batching benchmark into
a caching benchmark).

- `single_prompt`: one prompt, for the naive / kv / paged modes comparison;
- `mixed_workload`: the seeds' chapter 7 situation, where static batching
  hurts: requests of very different prompt and output lengths (default 32
  requests, prompts 16-512 tokens, outputs 16-256 tokens).
"""

import random
import re
from dataclasses import dataclass

from stagewise.errors import StagewiseError
from stagewise.sampling_params import SamplingParams
from stagewise.tokenizer.train import TINY_CORPUS

# More English in the same plain style (paraphrasing the seeds), so long prompts need few repeats.
SEED_TEXT = """\
Naive inference feeds the whole sentence through every layer again to get one more word.
If the sentence has N tokens, one such step costs about N times the square of the hidden size in the linear
layers, and N squared times the hidden size in attention. The keys and values of old tokens never change,
so a KV cache keeps them and each new step computes only the newest token. The cost of a step then grows
only a little with the length of the context. The price is memory: every token of every request keeps its
keys and values in every layer. A server wants many users at once, because reading the weights once for a
whole batch is much cheaper than reading them once per user. Static batching starts a batch together and
ends it together, so short requests wait for long ones and the padding is computed for nothing. Continuous
batching lets a finished request leave at once and a waiting one take its place in the very next step.
The prefill reads the prompt in one large matrix product and is limited by arithmetic. The decode reads all
weights to make a single token and is limited by memory bandwidth. Time to first token measures the prefill,
and the time between tokens measures each decode step. Throughput counts the tokens the whole system makes
in one second, across all of its users.
"""

BUILTIN_TEXT = TINY_CORPUS + SEED_TEXT


def builtin_sentences() -> list[str]:
    """The built-in text as a list of sentences (each ends with . ? ! or a quote)."""
    flat = " ".join(BUILTIN_TEXT.split())
    return [s for s in re.split(r"(?<=[.!?;\"])\s+(?=[A-Z\"])", flat) if s.strip()]


def count_tokens(tokenizer, text: str) -> int:
    """How many token ids the engine will see for `text` (same ids as its tokenize stage)."""
    return len(tokenizer.encode(text, backend="fast"))


def prompt_with_tokens(tokenizer, num_tokens: int, rng: random.Random, lead: int | None = None) -> str:
    """A shuffle of the built-in sentences cut so that it tokenizes to exactly `num_tokens` ids.

    `lead` picks the first sentence (index into `builtin_sentences()`), so prompts can start differently.
    """
    sentences = builtin_sentences()
    for _attempt in range(20):
        parts: list[str] = [] if lead is None else [sentences[lead % len(sentences)]]
        while True:
            order = sentences[:]
            rng.shuffle(order)
            parts += order
            text = " ".join(parts)
            ids = tokenizer.encode(text, backend="fast")
            if len(ids) > num_tokens + 8:
                break
        keep = num_tokens  # ids to keep; special tokens (a BOS) are dropped by decode and re-added by encode
        for _ in range(8):
            prompt = tokenizer.decode(ids[:keep], skip_special_tokens=True)
            got = count_tokens(tokenizer, prompt) if prompt.strip() else 0
            if got == num_tokens:
                return prompt
            keep += num_tokens - got
            if keep < 1:
                break
    raise StagewiseError(f"could not build a prompt of exactly {num_tokens} tokens with this tokenizer")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # prompt text
    prompt_tokens: int  # ids the model's tokenizer makes of it
    max_tokens: int  # output tokens it generates (ignore_eos: exactly this many)

    def params(self) -> SamplingParams:
        """Greedy, never stopping early: every system produces exactly `max_tokens` tokens."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Workload:
    name: str  # "single" or "mixed"
    seed: int  # the random seed everything was drawn from
    requests: tuple[BenchRequest, ...]  # in arrival order

    def prompts(self) -> list[str]:
        return [r.prompt for r in self.requests]

    def params(self) -> list[SamplingParams]:
        return [r.params() for r in self.requests]

    def max_seq_len(self) -> int:
        """The longest prompt + output of the workload (what a KV cache must hold for one request)."""
        return max(r.prompt_tokens + r.max_tokens for r in self.requests)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": len(self.requests),
            "prompt_tokens": [r.prompt_tokens for r in self.requests],
            "max_tokens": [r.max_tokens for r in self.requests],
            "total_prompt_tokens": sum(r.prompt_tokens for r in self.requests),
            "total_output_tokens": sum(r.max_tokens for r in self.requests),
        }


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if not (isinstance(low, int) and isinstance(high, int)) or low < 2 or high < low:
        raise StagewiseError(f"{name} must be a range LOW-HIGH with 2 <= LOW <= HIGH, got {low}-{high}")


def single_prompt(tokenizer, prompt_tokens: int = 32, seed: int = 0) -> str:
    """One prompt of exactly `prompt_tokens` tokens (the modes comparison's prompt)."""
    _check_range("prompt tokens", (prompt_tokens, prompt_tokens))
    return prompt_with_tokens(tokenizer, prompt_tokens, random.Random(seed))


def mixed_workload(
    tokenizer,
    num_requests: int = 32,
    prompt_tokens: tuple[int, int] = (16, 512),
    output_tokens: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> Workload:
    """`num_requests` requests with prompt and output lengths drawn uniformly from the two ranges."""
    if num_requests < 1:
        raise StagewiseError(f"the workload needs at least one request, got {num_requests}")
    _check_range("prompt tokens", prompt_tokens)
    _check_range("output tokens", output_tokens)
    rng = random.Random(seed)
    lengths = [(rng.randint(*prompt_tokens), rng.randint(*output_tokens)) for _ in range(num_requests)]
    leads = list(range(len(builtin_sentences())))
    rng.shuffle(leads)  # a different first sentence per request (while there are enough sentences)
    # the rng continues into the prompts, so the whole workload follows from `seed`
    requests = tuple(
        BenchRequest(prompt_with_tokens(tokenizer, p, rng, lead=leads[i % len(leads)]), p, n)
        for i, (p, n) in enumerate(lengths)
    )
    return Workload("mixed", seed, requests)
