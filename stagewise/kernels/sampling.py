"""Fused sampling: penalty, temperature, min_p, top-k, top-p and the draw in one kernel, no sort.

One program per row of logits [B, V] (B = num_seqs, V = vocab). The program
streams its row in blocks of BLOCK tokens, several times; it never writes a
[B, V] intermediate and never sorts. Every pass recomputes, per block,

    z = penalized logit   (seen: z / penalty if z > 0 else z * penalty)
    p = exp(z / T - m) / S   (m = max z / T, S = sum exp(z / T - m)): the softmax prob

The thresholds, all on p (the reference's order, `stagewise.stages.sampling`):

- greedy (T < 1e-5): the argmax of z, the first index on ties. Pass 1 finds it.
- min_p: prob >= min_p * max prob, and max prob = exp(0) / S, so the threshold
  is the number min_p / S: no search.
- top-k: keep p >= the k-th largest p. The k-th largest value is the largest t
  with count(p >= t) >= k; count is a step function of t, so a search over t
  finds it. Searching over the float's bit pattern makes it exact (a
  non-negative float32 and its int32 bits sort the same way): p lies in
  [0, 1], whose bits are below 2^30, so deciding those 30 bits from the top
  lands on the k-th largest value itself, and ties at it are all kept, as in
  the reference. A binary search would fix one bit per pass over the row (30
  passes); here each pass fixes RADIX_BITS = 5 bits by counting at 32
  candidate thresholds at once (prefix + j * 2^shift, j = 0..31, a [block, 32]
  comparison) and keeping the largest j with count >= k: 6 passes.
- top-p: over the survivors renormalized, keep p >= p_cut, p_cut = the largest
  t with mass(p >= t) / mass(survivors) >= top_p (the prob of the first sorted
  token at which the running mass reaches top_p, and its ties). The same
  6-pass search, each pass summing the kept mass above 32 candidates.
min_p and top-k both keep a top set, so the kept set is p >= max(both
thresholds); top-p then searches above that. Cost: O(passes * V) reads with
passes = 3 + 6 (top-k) + 7 (top-p) <= 16, registers only, no [B, V] scratch,
no sort; a filter that is off for a row costs that row nothing. The
interpreter pays per operation, not per element, so there a search pass uses
the full block; a GPU uses SEARCH_BLOCK_GPU to keep the [block, 32] tile in
registers. (For the same reason p is recomputed inline, not in a helper.)

The draw is Gumbel-max: argmax over the kept tokens of (log p + g), with
g = -log(-log u) and u uniform, picks token i with probability p_i / sum(kept p):
the renormalization is free and the draw is one more pass, an argmax. u comes
from Philox (`tl.randint`), a counter-based generator: u = f(seed of the row,
token index), so a row's draw depends only on its request's (seed, offset),
mixed on the host as the reference does (`stream_seed`), never on the batch.
Same distribution as the reference's `torch.multinomial`, different stream.
Philox is integer arithmetic, so the noise is the same on CPU and GPU.

Numerics: fp32 throughout (bf16/fp16 logits are converted at the load), IEEE
division (`tl.div_rn`) as in torch. A threshold can still differ from the
reference when a prob lies within an ulp of it (exp and the sums round
differently), which random logits essentially never do.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from stagewise.engine.sampling_params import GREEDY_TEMPERATURE
from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    KernelInputError,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
)
from stagewise.stages.sampling import SamplingTensors

BLOCK_MAX = 1024  # tokens per block of a streaming pass over the row
SEARCH_BLOCK_GPU = 256  # tokens per block of a search pass on a GPU: a [256, 32] comparison in registers
RADIX_BITS = 5  # threshold bits decided per search pass: 2^5 = 32 candidates at once
NUM_DIGITS = 6  # 6 * 5 = 30 bits: every float32 in [0, 1] has its bits below 2^30


@triton.jit
def _penalized(logits_row, seen_row, offs, vocab, penalty):
    """One block of penalized logits z, float32; -inf outside the vocab."""
    in_vocab = offs < vocab
    z = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
    seen = tl.load(seen_row + offs, mask=in_vocab, other=0) != 0
    return tl.where(seen, tl.where(z < 0, z * penalty, tl.div_rn(z, penalty)), z)  # div_rn: IEEE, like torch


@triton.jit
def _sample_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_k_ptr,  # [B] int64; 0 = off
    top_p_ptr,  # [B] float32; 1 = off
    min_p_ptr,  # [B] float32; 0 = off
    penalty_ptr,  # [B] float32; 1 = off
    seed_ptr,  # [B] int64: the row's Philox seed, stream_seed(seed, offset)
    out_ptr,  # [B] int64: the drawn token ids
    mask_ptr,  # [B, V] uint8: the allowed set (written only when WRITE_MASK)
    mask_row_stride,  # elements between two rows of mask
    vocab,  # V
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    WRITE_MASK: tl.constexpr,  # debug: also store the set of tokens the draw may pick
    BLOCK: tl.constexpr,  # tokens per block of a streaming pass
    SEARCH_BLOCK: tl.constexpr,  # tokens per block of a search pass
    RADIX_BITS: tl.constexpr,  # threshold bits decided per search pass
    NUM_DIGITS: tl.constexpr,  # search passes per threshold: RADIX_BITS * NUM_DIGITS >= 30
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    seen_row = seen_ptr + row * seen_row_stride
    mask_row = mask_ptr + row * mask_row_stride
    penalty = tl.load(penalty_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    arange = tl.arange(0, BLOCK)
    search_arange = tl.arange(0, SEARCH_BLOCK)

    # pass 1: max of the penalized logits and its first index (the greedy token)
    z_max = float("-inf")
    argmax = 0
    for start in range(0, vocab, BLOCK):
        z = _penalized(logits_row, seen_row, start + arange, vocab, penalty)
        block_max = tl.max(z, axis=0)
        block_arg = tl.min(tl.where(z == block_max, start + arange, vocab), axis=0)  # first index of the max
        argmax = tl.where(block_max > z_max, block_arg, argmax)  # strict >: an earlier block wins ties
        z_max = tl.maximum(z_max, block_max)

    if temperature < GREEDY:
        token = argmax
        if WRITE_MASK:
            for start in range(0, vocab, BLOCK):
                offs = start + arange
                tl.store(mask_row + offs, (offs == argmax).to(tl.uint8), mask=offs < vocab)
    else:
        # pass 2: the softmax denominator S (the max prob is exp(0) / S = 1 / S)
        m = tl.div_rn(z_max, temperature)  # = max(z / T): dividing by T > 0 keeps the order
        s = 0.0
        for start in range(0, vocab, BLOCK):
            z = _penalized(logits_row, seen_row, start + arange, vocab, penalty)
            s += tl.sum(tl.exp(tl.div_rn(z, temperature) - m), axis=0)
        threshold = tl.load(min_p_ptr + row) * tl.div_rn(1.0, s)  # min_p: p >= min_p * max prob

        # top-k: the largest t with count(p >= t) >= k, its bits decided 5 at a time from the top
        candidates = tl.arange(0, 1 << RADIX_BITS)  # [R] the values of one digit
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < vocab):
            kth = 0  # the answer's bits so far; count(p >= 0) = V >= k holds for it
            for digit in range(NUM_DIGITS):
                shift = (NUM_DIGITS - 1 - digit) * RADIX_BITS
                t = (kth + (candidates << shift)).to(tl.float32, bitcast=True)  # [R] candidate thresholds
                count = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
                for start in range(0, vocab, SEARCH_BLOCK):
                    offs = start + search_arange
                    z = _penalized(logits_row, seen_row, offs, vocab, penalty)
                    p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                    above = (p[:, None] >= t[None, :]) & (offs < vocab)[:, None]  # [SB, R]
                    count += tl.sum(above.to(tl.int32), axis=0)  # [SB, R] -> [R]
                kth += tl.max(tl.where(count >= k, candidates, 0), axis=0) << shift  # largest j still holding k
            threshold = tl.maximum(threshold, kth.to(tl.float32, bitcast=True))  # the k-th largest p

        # top-p: the largest t with mass(p >= max(t, threshold)) / mass(p >= threshold) >= top_p
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            kept_mass = 0.0
            for start in range(0, vocab, BLOCK):
                z = _penalized(logits_row, seen_row, start + arange, vocab, penalty)
                p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                kept_mass += tl.sum(tl.where(p >= threshold, p, 0.0), axis=0)
            cut = 0  # the answer's bits so far; the mass ratio at t = 0 is 1 >= top_p
            for digit in range(NUM_DIGITS):
                shift = (NUM_DIGITS - 1 - digit) * RADIX_BITS
                t = tl.maximum((cut + (candidates << shift)).to(tl.float32, bitcast=True), threshold)  # [R]
                mass = tl.zeros([1 << RADIX_BITS], dtype=tl.float32)
                for start in range(0, vocab, SEARCH_BLOCK):
                    z = _penalized(logits_row, seen_row, start + search_arange, vocab, penalty)
                    p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                    mass += tl.sum(tl.where(p[:, None] >= t[None, :], p[:, None], 0.0), axis=0)  # [SB, R] -> [R]
                cut += tl.max(tl.where(mass / kept_mass >= top_p, candidates, 0), axis=0) << shift
            threshold = tl.maximum(threshold, cut.to(tl.float32, bitcast=True))  # p_cut

        # last pass: Gumbel-max over the kept tokens; log p = z / T - m - log S, and the constant drops out
        seed = tl.load(seed_ptr + row)
        best = float("-inf")
        token = 0
        for start in range(0, vocab, BLOCK):
            offs = start + arange
            z = _penalized(logits_row, seen_row, offs, vocab, penalty)
            x = tl.div_rn(z, temperature) - m  # log p + log S
            p = tl.div_rn(tl.exp(x), s)
            keep = (p >= threshold) & (p > 0.0) & (offs < vocab)
            bits = tl.randint(seed, offs).to(tl.uint32)  # Philox: a function of (row seed, token index)
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits -> (0, 1), never 0 or 1
            score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))  # log p + Gumbel noise, up to a constant
            block_max = tl.max(score, axis=0)
            block_arg = tl.min(tl.where(score == block_max, offs, vocab), axis=0)
            token = tl.where(block_max > best, block_arg, token)
            best = tl.maximum(best, block_max)
            if WRITE_MASK:
                tl.store(mask_row + offs, keep.to(tl.uint8), mask=offs < vocab)
    tl.store(out_ptr + row, token.to(tl.int64))


# ---- the launcher ----

_U64 = 2**64


def _signed(c: int) -> int:
    """The int64 with the same bits as the uint64 `c`."""
    return c - _U64 if c >= 2**63 else c


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 bits: torch's >> is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    """`stages.sampling._splitmix64` on int64 tensors: wrapping int64 arithmetic is uint64 on the bits."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def stream_seeds(seeds: Tensor, offsets: Tensor) -> Tensor:
    """Per-row Philox seeds [B] int64: `stream_seed(seed, offset)` with the same bits, on the device (no sync)."""
    return _splitmix64(_splitmix64(seeds) + offsets)  # [B]


def _check(logits: Tensor, sampling: SamplingTensors) -> None:
    name = "sample"
    check_dim(name, "logits", logits, 2)
    check_dtype(name, "logits", logits, (torch.float32, torch.bfloat16, torch.float16))
    check_last_dim_contiguous(name, "logits", logits)
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        raise KernelInputError(f"{name}: logits has shape {list(logits.shape)}; need at least one row and token")
    if vocab >= 2**30:
        raise KernelInputError(f"{name}: vocab {vocab} is too large (token indices are int32)")
    check_shape(name, "sampling.seen", sampling.seen, (batch, vocab))
    check_dtype(name, "sampling.seen", sampling.seen, (torch.bool, torch.uint8))
    check_last_dim_contiguous(name, "sampling.seen", sampling.seen)
    fields = {
        "temperature": torch.float32,
        "top_k": torch.int64,
        "top_p": torch.float32,
        "min_p": torch.float32,
        "repetition_penalty": torch.float32,
        "seeds": torch.int64,
        "offsets": torch.int64,
    }
    for field, dtype in fields.items():
        t = getattr(sampling, field)
        check_shape(name, f"sampling.{field}", t, (batch,))
        check_dtype(name, f"sampling.{field}", t, (dtype,))
    check_same_device(name, logits=logits, **{f: getattr(sampling, f) for f in fields}, seen=sampling.seen)


def _launch(logits: Tensor, sampling: SamplingTensors, write_mask: bool) -> tuple[Tensor, Tensor]:
    _check(logits, sampling)
    batch, vocab = logits.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)  # [B]
    mask = torch.empty((batch, vocab) if write_mask else (1, 1), dtype=torch.uint8, device=logits.device)
    seen = sampling.seen.view(torch.uint8)  # [B, V] bool -> uint8, same bytes
    seeds = stream_seeds(sampling.seeds, sampling.offsets)  # [B] int64
    block = min(BLOCK_MAX, triton.next_power_of_2(vocab))
    penalty, temperature = sampling.repetition_penalty.contiguous(), sampling.temperature.contiguous()
    _sample_kernel[(batch,)](
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        seen_ptr=seen,
        seen_row_stride=seen.stride(0),
        temperature_ptr=temperature,
        top_k_ptr=sampling.top_k.contiguous(),
        top_p_ptr=sampling.top_p.contiguous(),
        min_p_ptr=sampling.min_p.contiguous(),
        penalty_ptr=penalty,
        seed_ptr=seeds,
        out_ptr=tokens,
        mask_ptr=mask,
        mask_row_stride=mask.stride(0),
        vocab=vocab,
        GREEDY=GREEDY_TEMPERATURE,
        WRITE_MASK=write_mask,
        BLOCK=block,
        SEARCH_BLOCK=block if INTERPRETER else min(block, SEARCH_BLOCK_GPU),  # the interpreter pays per op
        RADIX_BITS=RADIX_BITS,
        NUM_DIGITS=NUM_DIGITS,
    )
    return tokens, mask.bool()


def sample(logits: Tensor, sampling: SamplingTensors) -> Tensor:
    """One token per row: logits [B, V] -> token ids [B] int64 (the reference's semantics, Gumbel-max draw)."""
    return _launch(logits, sampling, write_mask=False)[0]


def sample_with_mask(logits: Tensor, sampling: SamplingTensors) -> tuple[Tensor, Tensor]:
    """Debug entry: the tokens [B] and the set each row could draw from, [B, V] bool (= processed_probs > 0)."""
    return _launch(logits, sampling, write_mask=True)
