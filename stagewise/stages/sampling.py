"""Sampling: turn each sequence's next-token logits into one token id.

The LM head gives one row of logits per running sequence; sampling picks the
next token of each row, with that request's own `SamplingParams`:

    logits [num_seqs, vocab] -> token ids [num_seqs]   (B = num_seqs, V = vocab)

Order of operations (the seed's section 10, and vLLM's):

1. repetition penalty, on the logits: every token already seen (in the prompt
   or generated so far, as Hugging Face penalizes all input_ids) has its logit
   divided by the penalty when positive and multiplied by it when negative.
2. greedy check: a row with temperature < 1e-5 takes the argmax of the
   penalized logits (the first index on ties, like `torch.argmax`); no
   temperature division (it would divide by ~0), no filters, no randomness.
3. temperature: logits / T, then softmax to probabilities.
4. min_p: keep tokens with prob >= min_p * (the row's max prob).
5. top-k: keep tokens with prob >= the k-th largest prob (so ties at the k-th
   value are all kept; more than k tokens can survive).
6. top-p: over the renormalized survivors, keep the smallest set of
   highest-probability tokens whose mass reaches top_p (always at least one),
   plus any token tied with the last one kept. As a threshold: keep prob >=
   p_cut, where p_cut is the largest prob value whose "mass of tokens at least
   as likely" is >= top_p. top_p == 1 keeps everything.
7. draw one token from the renormalized result.

Each filter renormalizes what survives, so order matters only for top-p: it
sees the distribution left by min_p and top-k (min_p and top-k both keep a
top set by probability, so they commute). Hugging Face's `generate` applies
temperature, top-k, top-p, then min_p; the tests compare each processor alone
and our order composed from Hugging Face's processors.

Randomness: row b draws with a `torch.Generator` seeded by
`stream_seed(seeds[b], offsets[b])` (splitmix64 of the seed, plus the offset,
splitmix64 again), where `offsets[b]` counts the tokens that request has drawn
so far. A request's tokens therefore depend only on (seed, offset) and its own
logits, never on which other requests share the batch. Streams differ between
CPU and CUDA generators (different torch RNGs).

What the Triton tier changes (`stagewise.kernels.sampling`):
a few streaming passes over the logits apply penalty, temperature and the
three filters in registers, never writing a [B, V] intermediate; each row's
vocabulary is split into chunks, one program per (row, chunk), with a small
per-row combine between passes, so a few rows still fill a GPU. Which passes
run is decided from SamplingTensors' host flags, not by reading the tensors (that
would be a host sync). min_p is a direct threshold (min_p / S, with S
the softmax denominator); the top-k and top-p thresholds (p_cut above) are
found without a sort, by an exact search over the float bits of the
threshold, 5 bits per pass over the row (counting, then summing the mass,
above 32 candidate thresholds at once; 6 passes each), so ties behave as
here. The draw is Gumbel-max, argmax(log p + Gumbel noise), with the noise
from Philox keyed by the row's `stream_seed(seed, offset)` and the token
index: reproducible and batch-independent, but not token-for-token equal to
this reference's `torch.multinomial` draws (same distribution, different
stream). Greedy rows give the same token as here.
"""

import torch
from torch import Tensor

from stagewise.config import ModelConfig
from stagewise.sampling_params import (
    PENALIZED_LOGIT_MAX,
    SamplingParams,
    SamplingTensors,  # lives in the ground layer, where the sampling kernel reads it too
)
from stagewise.stages.base import Stage

_MASK64 = 2**64 - 1


# ---- the processors, one per parameter; probs stay zero outside the allowed set ----


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """Make seen tokens less likely: positive logits / penalty, negative logits * penalty.

    The result is clamped to +-PENALIZED_LOGIT_MAX: a tiny or huge penalty can push a logit past
    float32, and an infinite logit would turn the softmax into NaN.
    """
    penalty = penalty[:, None]  # [B] -> [B, 1]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)  # [B, V]
    penalized = penalized.clamp(-PENALIZED_LOGIT_MAX, PENALIZED_LOGIT_MAX)
    return torch.where(seen, penalized, logits)  # [B, V]


def _renormalize(probs: Tensor) -> Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)  # [B, V]


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens with prob >= min_p * max prob (min_p = 0 keeps all)."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return _renormalize(probs.masked_fill(probs < threshold, 0.0))  # [B, V]


def apply_top_k(probs: Tensor, top_k: Tensor) -> Tensor:
    """Keep tokens with prob >= the k-th largest prob (top_k = 0 keeps all)."""
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]; off -> k = V
    sorted_probs = probs.sort(dim=-1, descending=True).values  # [B, V]
    kth = sorted_probs.gather(-1, (k - 1)[:, None])  # [B, 1]: the k-th largest prob
    return _renormalize(probs.masked_fill(probs < kth, 0.0))  # [B, V]


def apply_top_p(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest top set with mass >= top_p (ties with its last one too; 1 keeps all)."""
    vocab = probs.shape[-1]
    sorted_probs = probs.sort(dim=-1, descending=True).values  # [B, V]
    mass = sorted_probs.cumsum(dim=-1)  # [B, V]: mass of the i+1 most likely tokens
    # the first position whose running mass reaches top_p is the last token kept
    # [B, V] -> [B, 1]
    last = (mass < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(max=vocab - 1)
    cut = sorted_probs.gather(-1, last)  # [B, 1]: p_cut, the prob of the last token kept
    # top_p = 1 is off, whatever the rounding of mass
    cut = torch.where(top_p[:, None] >= 1.0, 0.0, cut)
    return _renormalize(probs.masked_fill(probs < cut, 0.0))  # [B, V]


def processed_probs(logits: Tensor, sampling: SamplingTensors) -> Tensor:
    """The distribution each row draws from, [B, V] float32 (greedy rows: one-hot at the argmax)."""
    logits = logits.float()  # [B, V] in float32 whatever the model dtype
    if sampling.any_penalty:  # off for every row: nothing to change (and three [B, V] passes saved)
        # [B, V]
        logits = apply_repetition_penalty(logits, sampling.seen, sampling.repetition_penalty)
    greedy = sampling.greedy  # [B]
    # [B]; greedy rows skip the division
    temperature = torch.where(greedy, 1.0, sampling.temperature)
    probs = torch.softmax(logits / temperature[:, None], dim=-1)  # [B, V]
    # A filter that is off for every row changes nothing; skipping it skips a [B, V] sort.
    # The host flags decide: testing the tensors (`bool(top_k.any())`) would be a host sync.
    if sampling.any_min_p:
        probs = apply_min_p(probs, sampling.min_p)  # [B, V]
    if sampling.any_top_k:
        probs = apply_top_k(probs, sampling.top_k)  # [B, V]
    if sampling.any_top_p:
        probs = apply_top_p(probs, sampling.top_p)  # [B, V]
    # [B, V]
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)  # [B, V]


# ---- the draw ----


def _splitmix64(x: int) -> int:
    """One step of splitmix64: a bijective 64-bit mixer (Steele, Lea, Flood 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, offset: int) -> int:
    """The generator seed of a request's `offset`-th draw: splitmix64(splitmix64(seed) + offset)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + offset) & _MASK64)


def naive(logits: Tensor, sampling: SamplingTensors) -> Tensor:
    """Sample one token per row: [B, V] logits -> [B] int64 token ids."""
    if sampling.all_greedy:  # no probabilities needed: the argmax of the penalized logits
        penalized = logits.float()
        if sampling.any_penalty:
            penalized = apply_repetition_penalty(
                penalized, sampling.seen, sampling.repetition_penalty
            )
        return penalized.argmax(dim=-1)  # [B, V] -> [B]
    probs = processed_probs(logits, sampling)  # [B, V] float32
    tokens = probs.argmax(dim=-1)  # [B]; exact for greedy rows (one-hot), redrawn for the others
    random_rows = [row for row, greedy in enumerate(sampling.greedy_rows) if not greedy]  # host
    for row in random_rows:
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(stream_seed(sampling.seeds_host[row], sampling.offsets_host[row]))
        drawn = torch.multinomial(probs[row], num_samples=1, generator=generator)  # [V] -> [1]
        tokens[row] = drawn[0]
    return tokens  # [B] int64


def triton(logits: Tensor, sampling: SamplingTensors) -> Tensor:
    """The fused Triton kernel: [B, V] logits -> [B] int64 tokens (same law, its own stream)."""
    # lazy: importing kernels first picks GPU or interpreter
    from stagewise.kernels.sampling import sample

    return sample(logits, sampling)  # [B, V] -> [B]


OPTIMIZED_KIND = "triton: fused penalty/temperature/min_p/top-k/top-p + Gumbel-max, no sort"


def example_inputs(
    config: ModelConfig, num_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict:
    """Seeded logits [num_tokens, V] (num_tokens = num_seqs) and a mix of greedy and random rows."""
    generator = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    logits = 3.0 * torch.randn(num_tokens, vocab, generator=generator)  # [B, V]
    seen = torch.rand(num_tokens, vocab, generator=generator) < 0.05  # [B, V]: ~5% seen
    menu = [
        SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=7
        ),
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=1.1),
        SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.3),  # greedy all the same
    ]
    params = [menu[i % len(menu)] for i in range(num_tokens)]
    offsets, seeds = list(range(num_tokens)), [1000 + i for i in range(num_tokens)]
    sampling = SamplingTensors.from_params(
        params, seen, offsets=offsets, seeds=seeds, device=device
    )
    return {"logits": logits.to(device=device, dtype=dtype), "sampling": sampling}


STAGE = Stage(
    name="sampling",
    summary=(
        "repetition penalty, greedy or temperature, min_p, top-k, top-p, "
        "then one seeded draw per sequence"
    ),
    shapes="[num_seqs, vocab] -> [num_seqs]",
    naive=naive,
    triton=triton,
    triton_kind=OPTIMIZED_KIND,
    example_inputs=example_inputs,
    outputs=("next_tokens",),
    axes={"logits": "num_seqs vocab", "next_tokens": "num_seqs"},
)
