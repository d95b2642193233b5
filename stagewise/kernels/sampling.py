"""Fused sampling: penalty, temperature, min_p, top-k, top-p and the draw, no sort, rows split across programs.

Logits [B, V] (B = num_seqs, V = vocab) -> one token per row. Nothing [B, V]
is ever written (but the debug mask); every pass re-reads the logits and
recomputes, per block of tokens,

    z = penalized logit   (seen: z / penalty if z > 0 else z * penalty)
    p = exp(z / T - m) / S   (m = max z / T, S = sum exp(z / T - m)): the softmax prob

The thresholds, all on p (the reference's order, `stagewise.stages.sampling`):

- greedy (T < 1e-5): the argmax of z, the first index on ties.
- min_p: prob >= min_p * max prob, and max prob = exp(0) / S, so the threshold
  is the number min_p / S: no search.
- top-k: keep p >= the k-th largest p. The k-th largest value is the largest t
  with count(p >= t) >= k; count is a step function of t, so a search over t
  finds it. Searching over the float's bit pattern makes it exact (a
  non-negative float32 and its int32 bits sort the same way): p lies in
  [0, 1], whose bits are below 2^30, so deciding those 30 bits from the top
  lands on the k-th largest value itself, and ties at it are all kept, as in
  the reference. Each pass decides RADIX_BITS = 5 bits by counting at 32
  candidate thresholds at once (prefix + j * 2^shift, j = 0..31, a [block, 32]
  comparison) and keeping the largest j with count >= k: 6 passes.
- top-p: over the survivors renormalized, keep p >= p_cut, p_cut = the largest
  t with mass(p >= t) / mass(survivors) >= top_p. The same 6-pass search,
  summing the kept mass above 32 candidates.
min_p and top-k both keep a top set, so the kept set is p >= max(both
thresholds); top-p then searches above that.

The draw is Gumbel-max: argmax over the kept tokens of (log p + g), with
g = -log(-log u) and u uniform, picks token i with probability p_i / sum(kept p):
the renormalization is free and the draw is one more pass, an argmax. u comes
from Philox (`tl.randint`), keyed by the row's `stream_seed(seed, offset)`
(mixed on the device below, as the reference does on the host) and the token
index: a row's draw never depends on the batch. Same distribution as the
reference's `torch.multinomial`, a different stream; Philox is integer
arithmetic, so the noise is the same on CPU and GPU.

Parallelism: a row is cut into chunks. One program per row would leave a GPU
idle (8 rows = 8 programs on 132 SMs, each streaming the vocabulary up to 16
times). So each row's vocabulary is cut into chunks of CHUNK = 2048 tokens and
every pass runs one program per (row, chunk), B * ceil(V / CHUNK) programs.
A pass streams its chunk and writes one partial per chunk; then a combine
kernel, one program per row (per block of rows in the interpreter), folds the
row's partials into the row's state (m, S, threshold, the search prefix, the
token), which the next pass reads — the launch boundary is the only
synchronisation, so the same code runs in the interpreter:

    pass            partial of a chunk                   combine: row state
    max             max z and its first index            m = max z / T; the greedy token
    sum             sum exp(z / T - m)                   S; threshold = min_p / S
    count x 6       count(p >= t_j), 32 candidates t_j   5 more bits of the k-th largest p
    kept            sum of p >= threshold                the survivors' mass
    mass x 6        mass(p >= t_j), 32 candidates t_j    5 more bits of p_cut
    draw            best Gumbel score and its index      the token: the first index of the best

The chunks partition the row in index order, so "first index of the max"
combines exactly: the smallest index among the chunks that reach the row's
best. Counts are integers; sums of floats are added chunk by chunk (a fixed
order: the chunk size depends on V only, so results never depend on the batch
size or the GPU). Which passes run is decided on the host from SamplingParams'
host flags (`SamplingTensors.all_greedy`, `any_top_k`, ...), never by reading
the device: an all-greedy step runs max alone (2 launches), a step without
top-p skips the 7 top-p passes, a batch without a repetition penalty never
reads `seen`; within a launched pass, a row whose filter is off does nothing.
Cost: O(passes * V) reads per row with passes <= 16, spread over the chunks,
and up to 32 small launches (CUDA graphs make their launch cost vanish); the
partials are [B, chunks, 32].

Numerics: fp32 throughout (bf16/fp16 logits are converted at the load), IEEE
division (`tl.div_rn`) as in torch. A threshold can still differ from the
reference when a prob lies within an ulp of it (exp and the sums round
differently), which random logits essentially never do. The interpreter pays
per operation, not per element, so there a search pass uses the full block; a
GPU uses SEARCH_BLOCK_GPU to keep the [block, 32] tile in registers. (For the
same reason p is recomputed inline, not in a helper.)
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    KernelInputError,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
)
from stagewise.sampling_params import GREEDY_TEMPERATURE, PENALIZED_LOGIT_MAX, SamplingTensors

CHUNK = 2048  # tokens of a row per program (a function of nothing but this constant: batch-independent results)
MAX_CHUNKS = 128  # a vocab over 128 * 2048 gets larger chunks, so the combine's [chunks, 32] tile stays small
BLOCK_MAX = 1024  # tokens per block of a streaming pass over a chunk
SEARCH_BLOCK_GPU = (
    256  # tokens per block of a search pass on a GPU: a [256, 32] comparison in registers
)
RADIX_BITS = 5  # threshold bits decided per search pass: 2^5 = 32 candidates at once
NUM_DIGITS = 6  # 6 * 5 = 30 bits: every float32 in [0, 1] has its bits below 2^30
_PENALIZED_MAX = tl.constexpr(
    PENALIZED_LOGIT_MAX
)  # penalized logits are clamped to +-this (sampling_params)

# the passes, in order (constexpr: each compiles to its own kernel)
MAX, SUM, COUNT, KEPT, MASS, DRAW = (tl.constexpr(i) for i in range(6))


@triton.jit
def _penalized(logits_row, seen_row, offs, vocab, penalty, PENALTY: tl.constexpr):
    """One block of penalized logits z, float32; -inf outside the vocab."""
    in_vocab = offs < vocab
    z = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if PENALTY:  # some row of the batch has a penalty (a host flag): else `seen` is never read
        seen = tl.load(seen_row + offs, mask=in_vocab, other=0) != 0
        penalized = tl.where(z < 0, z * penalty, tl.div_rn(z, penalty))  # div_rn: IEEE, like torch
        penalized = tl.minimum(
            tl.maximum(penalized, -_PENALIZED_MAX), _PENALIZED_MAX
        )  # finite, as in torch
        z = tl.where(seen, penalized, z)
    return z


@triton.jit
def _pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_k_ptr,  # [B] int64; 0 = off
    top_p_ptr,  # [B] float32; 1 = off
    penalty_ptr,  # [B] float32; 1 = off
    seed_ptr,  # [B] int64: the row's Philox seed, stream_seed(seed, offset)
    row_max_ptr,  # [B] float32 state: m = max z / T
    row_sum_ptr,  # [B] float32 state: S
    threshold_ptr,  # [B] float32 state: keep p >= threshold
    prefix_ptr,  # [B] int32 state: the threshold bits decided so far by the running search
    token_ptr,  # [B] int64 state: the greedy token (read by the draw for the debug mask)
    part_f_ptr,  # [B, num_chunks, R] float32: this pass's partials
    part_i_ptr,  # [B, num_chunks, R] int32: this pass's partials
    mask_ptr,  # [B, V] uint8: the allowed set (written by the draw only when WRITE_MASK)
    mask_row_stride,  # elements between two rows of mask
    vocab,  # V
    num_chunks,  # chunks per row
    shift,  # search passes: the bit position of the digit being decided
    PASS: tl.constexpr,  # MAX, SUM, COUNT, KEPT, MASS or DRAW
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    WRITE_MASK: tl.constexpr,  # debug: also store the set of tokens the draw may pick
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per block of a streaming pass
    SEARCH_BLOCK: tl.constexpr,  # tokens per block of a search pass
    RADIX_BITS: tl.constexpr,  # threshold bits decided per search pass
):
    # (the interpreter pays per operation and per program: each pass loads only what it uses)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    first = chunk * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    logits_row = logits_ptr + row * logits_row_stride
    seen_row = seen_ptr + row * seen_row_stride
    part = (row * num_chunks + chunk) * (1 << RADIX_BITS)  # this program's partials
    penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
    temperature = tl.load(temperature_ptr + row) if PASS != MAX else 1.0
    drawn = temperature >= GREEDY  # the row draws at random: it needs p, the filters and the draw

    if PASS == MAX:  # max of the penalized logits and its first index (the greedy token)
        arange = tl.arange(0, BLOCK)
        z_max = float("-inf")
        argmax = first
        for start in range(first, last, BLOCK):
            z = _penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
            block_max = tl.max(z, axis=0)
            block_arg = tl.min(
                tl.where(z == block_max, start + arange, vocab), axis=0
            )  # first index of the max
            argmax = tl.where(
                block_max > z_max, block_arg, argmax
            )  # strict >: an earlier block wins ties
            z_max = tl.maximum(z_max, block_max)
        tl.store(part_f_ptr + part, z_max)
        tl.store(part_i_ptr + part, argmax)
    elif PASS == SUM:  # the chunk's share of the softmax denominator S
        if drawn:
            arange = tl.arange(0, BLOCK)
            m = tl.load(row_max_ptr + row)
            s = 0.0
            for start in range(first, last, BLOCK):
                z = _penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
                s += tl.sum(tl.exp(tl.div_rn(z, temperature) - m), axis=0)
            tl.store(part_f_ptr + part, s)
    elif PASS == COUNT:  # top-k digit: count(p >= t) at 32 candidate thresholds t
        k = tl.load(top_k_ptr + row)
        if drawn & (k > 0) & (k < vocab):
            search_arange = tl.arange(0, SEARCH_BLOCK)
            candidates = tl.arange(0, 1 << RADIX_BITS)  # [R] the values of one digit
            m, s = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
            t = (tl.load(prefix_ptr + row) + (candidates << shift)).to(
                tl.float32, bitcast=True
            )  # [R]
            count = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
            for start in range(first, last, SEARCH_BLOCK):
                offs = start + search_arange
                z = _penalized(logits_row, seen_row, offs, vocab, penalty, PENALTY)
                p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                above = (p[:, None] >= t[None, :]) & (offs < vocab)[:, None]  # [SB, R]
                count += tl.sum(above.to(tl.int32), axis=0)  # [SB, R] -> [R]
            tl.store(part_i_ptr + part + candidates, count)
    elif PASS == KEPT:  # top-p: the mass that survives min_p and top-k
        if drawn & (tl.load(top_p_ptr + row) < 1.0):
            arange = tl.arange(0, BLOCK)
            m, s, threshold = (
                tl.load(row_max_ptr + row),
                tl.load(row_sum_ptr + row),
                tl.load(threshold_ptr + row),
            )
            kept = 0.0
            for start in range(first, last, BLOCK):
                z = _penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
                p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                kept += tl.sum(tl.where(p >= threshold, p, 0.0), axis=0)
            tl.store(part_f_ptr + part, kept)
    elif PASS == MASS:  # top-p digit: mass(p >= max(t, threshold)) at 32 candidate thresholds t
        if drawn & (tl.load(top_p_ptr + row) < 1.0):
            search_arange = tl.arange(0, SEARCH_BLOCK)
            candidates = tl.arange(0, 1 << RADIX_BITS)  # [R] the values of one digit
            m, s, threshold = (
                tl.load(row_max_ptr + row),
                tl.load(row_sum_ptr + row),
                tl.load(threshold_ptr + row),
            )
            t = (tl.load(prefix_ptr + row) + (candidates << shift)).to(tl.float32, bitcast=True)
            t = tl.maximum(t, threshold)  # [R]
            mass = tl.zeros([1 << RADIX_BITS], dtype=tl.float32)
            for start in range(first, last, SEARCH_BLOCK):
                z = _penalized(logits_row, seen_row, start + search_arange, vocab, penalty, PENALTY)
                p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)
                mass += tl.sum(
                    tl.where(p[:, None] >= t[None, :], p[:, None], 0.0), axis=0
                )  # [SB, R] -> [R]
            tl.store(part_f_ptr + part + candidates, mass)
    else:  # DRAW: Gumbel-max over the kept tokens; log p = z / T - m - log S, and the constant drops out
        mask_row = mask_ptr + row * mask_row_stride
        arange = tl.arange(0, BLOCK)
        if drawn:
            m, s, threshold = (
                tl.load(row_max_ptr + row),
                tl.load(row_sum_ptr + row),
                tl.load(threshold_ptr + row),
            )
            seed = tl.load(seed_ptr + row)
            best = float("-inf")
            token = first
            for start in range(first, last, BLOCK):
                offs = start + arange
                z = _penalized(logits_row, seen_row, offs, vocab, penalty, PENALTY)
                x = tl.div_rn(z, temperature) - m  # log p + log S
                p = tl.div_rn(tl.exp(x), s)
                keep = (p >= threshold) & (p > 0.0) & (offs < vocab)
                bits = tl.randint(seed, offs).to(
                    tl.uint32
                )  # Philox: a function of (row seed, token index)
                u = ((bits >> 9).to(tl.float32) + 0.5) * (
                    1.0 / 8388608.0
                )  # 23 bits -> (0, 1), never 0 or 1
                score = tl.where(
                    keep, x - tl.log(-tl.log(u)), float("-inf")
                )  # log p + Gumbel noise, + a constant
                block_max = tl.max(score, axis=0)
                block_arg = tl.min(tl.where(score == block_max, offs, vocab), axis=0)
                token = tl.where(block_max > best, block_arg, token)
                best = tl.maximum(best, block_max)
                if WRITE_MASK:
                    tl.store(mask_row + offs, keep.to(tl.uint8), mask=offs < vocab)
            tl.store(part_f_ptr + part, best)
            tl.store(part_i_ptr + part, token)
        elif WRITE_MASK:  # a greedy row may draw its argmax only
            argmax = tl.load(token_ptr + row)
            for start in range(first, last, BLOCK):
                offs = start + arange
                tl.store(mask_row + offs, (offs == argmax).to(tl.uint8), mask=offs < vocab)


@triton.jit
def _combine_kernel(
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64
    top_p_ptr,  # [B] float32
    min_p_ptr,  # [B] float32
    row_max_ptr,  # [B] float32 state: m
    row_sum_ptr,  # [B] float32 state: S
    threshold_ptr,  # [B] float32 state: the threshold
    kept_ptr,  # [B] float32 state: the survivors' mass (top-p)
    prefix_ptr,  # [B] int32 state: the bits of the running search
    token_ptr,  # [B] int64: the row's token (greedy after MAX, drawn after DRAW)
    part_f_ptr,  # [B, num_chunks, R] float32: the pass's partials
    part_i_ptr,  # [B, num_chunks, R] int32: the pass's partials
    batch,  # B
    vocab,  # V
    num_chunks,  # chunks per row
    shift,  # search passes: the bit position of the digit being decided (0: the last digit)
    PASS: tl.constexpr,  # the pass whose partials to fold
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # threshold bits decided per search pass
):
    """Fold each row's partials of one pass into its state; a row whose filter is off is left as it is."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    chunks = tl.arange(0, CHUNKS_POW2)  # [C]
    row_ok = rows < batch
    ok = row_ok[:, None] & (chunks < num_chunks)[None, :]  # [ROWS, C]
    scalars = (rows.to(tl.int64)[:, None] * num_chunks + chunks[None, :]) * (
        1 << RADIX_BITS
    )  # [ROWS, C]
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    drawn = row_ok & (temperature >= GREEDY)  # greedy rows skip every pass but MAX
    if PASS == MAX:
        z = tl.load(part_f_ptr + scalars, mask=ok, other=float("-inf"))  # [ROWS, C] chunk maxima
        index = tl.load(part_i_ptr + scalars, mask=ok, other=vocab)  # [ROWS, C] their first indices
        z_max = tl.max(z, axis=1)  # [ROWS]
        token = tl.min(
            tl.where(z == z_max[:, None], index, vocab), axis=1
        )  # the first index of the max
        tl.store(token_ptr + rows, token.to(tl.int64), mask=row_ok)
        tl.store(
            row_max_ptr + rows, tl.div_rn(z_max, tl.where(drawn, temperature, 1.0)), mask=row_ok
        )  # max z / T
    elif PASS == SUM:
        s = tl.sum(
            tl.load(part_f_ptr + scalars, mask=ok & drawn[:, None], other=0.0), axis=1
        )  # [ROWS]
        s = tl.where(drawn, s, 1.0)  # greedy rows have no partials
        min_p = tl.load(min_p_ptr + rows, mask=row_ok, other=0.0)
        tl.store(row_sum_ptr + rows, s, mask=drawn)
        tl.store(
            threshold_ptr + rows, min_p * tl.div_rn(1.0, s), mask=drawn
        )  # min_p: p >= min_p * max prob
        tl.store(
            prefix_ptr + rows, tl.zeros([ROWS], dtype=tl.int32), mask=drawn
        )  # the top-k search starts empty
    elif PASS == COUNT:
        k = tl.load(top_k_ptr + rows, mask=row_ok, other=0)
        active = drawn & (k > 0) & (k < vocab)  # [ROWS]
        candidates = tl.arange(0, 1 << RADIX_BITS)  # [R]
        tiles = (
            scalars[:, :, None] + candidates[None, None, :]
        )  # [ROWS, C, R]: each chunk's 32 partials
        count = tl.sum(
            tl.load(part_i_ptr + tiles, mask=(ok & active[:, None])[:, :, None], other=0), axis=1
        )
        digit = tl.max(
            tl.where(count >= k[:, None], candidates[None, :], 0), axis=1
        )  # largest j still holding k
        kth = tl.load(prefix_ptr + rows, mask=active, other=0) + (digit << shift)  # [ROWS]
        if shift == 0:  # the last digit: kth is the k-th largest p itself
            threshold = tl.load(threshold_ptr + rows, mask=active, other=0.0)
            tl.store(
                threshold_ptr + rows,
                tl.maximum(threshold, kth.to(tl.float32, bitcast=True)),
                mask=active,
            )
            tl.store(
                prefix_ptr + rows, tl.zeros([ROWS], dtype=tl.int32), mask=active
            )  # top-p starts empty
        else:
            tl.store(prefix_ptr + rows, kth, mask=active)
    elif PASS == KEPT:
        top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
        active = drawn & (top_p < 1.0)  # [ROWS]
        kept = tl.sum(
            tl.load(part_f_ptr + scalars, mask=ok & active[:, None], other=0.0), axis=1
        )  # [ROWS]
        tl.store(kept_ptr + rows, kept, mask=active)
    elif PASS == MASS:
        top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
        active = drawn & (top_p < 1.0)  # [ROWS]
        candidates = tl.arange(0, 1 << RADIX_BITS)  # [R]
        tiles = (
            scalars[:, :, None] + candidates[None, None, :]
        )  # [ROWS, C, R]: each chunk's 32 partials
        mass = tl.sum(
            tl.load(part_f_ptr + tiles, mask=(ok & active[:, None])[:, :, None], other=0.0), axis=1
        )
        kept = tl.load(kept_ptr + rows, mask=active, other=1.0)
        ratio = mass / kept[:, None]  # [ROWS, R]: the survivors' share at or above each candidate
        digit = tl.max(tl.where(ratio >= top_p[:, None], candidates[None, :], 0), axis=1)
        cut = tl.load(prefix_ptr + rows, mask=active, other=0) + (digit << shift)  # [ROWS]
        tl.store(prefix_ptr + rows, cut, mask=active)
        if shift == 0:  # the last digit: cut is p_cut
            threshold = tl.load(threshold_ptr + rows, mask=active, other=0.0)
            tl.store(
                threshold_ptr + rows,
                tl.maximum(threshold, cut.to(tl.float32, bitcast=True)),
                mask=active,
            )
    else:  # DRAW: the first index of the row's best score
        best = tl.load(
            part_f_ptr + scalars, mask=ok & drawn[:, None], other=float("-inf")
        )  # [ROWS, C]
        index = tl.load(part_i_ptr + scalars, mask=ok & drawn[:, None], other=vocab)
        top = tl.max(best, axis=1)  # [ROWS]
        token = tl.min(tl.where(best == top[:, None], index, vocab), axis=1)
        tl.store(token_ptr + rows, token.to(tl.int64), mask=drawn)


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
        raise KernelInputError(
            f"{name}: logits has shape {list(logits.shape)}; need at least one row and token"
        )
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
    check_same_device(
        name, logits=logits, **{f: getattr(sampling, f) for f in fields}, seen=sampling.seen
    )
    if len(sampling.greedy_rows) != batch:
        raise KernelInputError(
            f"{name}: sampling has {len(sampling.greedy_rows)} host rows for {batch} rows of logits"
        )


def chunk_size(vocab: int) -> int:
    """Tokens per program: CHUNK, or more for a vocab so large that it would need over MAX_CHUNKS chunks."""
    return max(CHUNK, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS)))


@dataclass(frozen=True)
class SamplingTiles:
    """How `_launch` cuts a row of the vocabulary (host values only: the compile gate compiles these)."""

    chunk: int  # tokens per program
    num_chunks: int  # programs per row
    block: int  # tokens per block of a streaming pass
    search_block: int  # tokens per block of a search pass

    @staticmethod
    def pass_warps(which: int) -> int:
        return (
            8 if which in (COUNT, MASS) else 4
        )  # a search's [256, 32] tile: 8 warps hold it without spilling


def sampling_tiles(
    vocab: int, chunk: int | None = None, interpreter: bool = INTERPRETER
) -> SamplingTiles:
    chunk = chunk or chunk_size(vocab)
    if chunk < 16 or chunk & (chunk - 1):
        raise KernelInputError(f"sample: chunk {chunk} must be a power of two >= 16")
    chunk = min(chunk, triton.next_power_of_2(vocab))  # a small vocab is one chunk of its own size
    block = min(
        BLOCK_MAX, chunk, triton.next_power_of_2(vocab)
    )  # divides chunk: blocks never straddle chunks
    search_block = (
        block if interpreter else min(block, SEARCH_BLOCK_GPU)
    )  # the interpreter pays per op
    return SamplingTiles(chunk, triton.cdiv(vocab, chunk), block, search_block)


def _launch(
    logits: Tensor, sampling: SamplingTensors, write_mask: bool, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """The passes a step needs, each a (row, chunk) grid followed by its per-row combine.

    Which passes run comes from host flags of `sampling` (SamplingParams are host objects), never
    from reading its tensors: a read would wait for the GPU (a host-bound step, no CUDA graphs).
    """
    _check(logits, sampling)
    batch, vocab = logits.shape
    tiles = sampling_tiles(vocab, chunk)
    num_chunks = tiles.num_chunks
    radix = 1 << RADIX_BITS
    device = logits.device
    row_max, row_sum, threshold, kept = torch.empty(
        4, batch, dtype=torch.float32, device=device
    )  # row state
    prefix = torch.empty(batch, dtype=torch.int32, device=device)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)  # [B]
    part_f = torch.empty(batch, num_chunks, radix, dtype=torch.float32, device=device)  # partials
    part_i = torch.empty(batch, num_chunks, radix, dtype=torch.int32, device=device)
    mask = torch.empty((batch, vocab) if write_mask else (1, 1), dtype=torch.uint8, device=device)
    seen = sampling.seen.view(torch.uint8)  # [B, V] bool -> uint8, same bytes
    temperature, top_k, top_p = (
        t.contiguous() for t in (sampling.temperature, sampling.top_k, sampling.top_p)
    )
    state = dict(
        row_max_ptr=row_max,
        row_sum_ptr=row_sum,
        threshold_ptr=threshold,
        prefix_ptr=prefix,
        part_f_ptr=part_f,
        part_i_ptr=part_i,
        vocab=vocab,
        num_chunks=num_chunks,
        GREEDY=GREEDY_TEMPERATURE,
        RADIX_BITS=RADIX_BITS,
    )
    pass_args = dict(
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        seen_ptr=seen,
        seen_row_stride=seen.stride(0),
        temperature_ptr=temperature,
        top_k_ptr=top_k,
        top_p_ptr=top_p,
        penalty_ptr=sampling.repetition_penalty.contiguous(),
        seed_ptr=stream_seeds(sampling.seeds, sampling.offsets),  # [B] int64
        token_ptr=tokens,
        mask_ptr=mask,
        mask_row_stride=mask.stride(0),
        PENALTY=sampling.any_penalty,
        WRITE_MASK=write_mask,
        CHUNK=tiles.chunk,
        BLOCK=tiles.block,
        SEARCH_BLOCK=tiles.search_block,
        **state,
    )
    combine_args = dict(
        temperature_ptr=temperature,
        top_k_ptr=top_k,
        top_p_ptr=top_p,
        min_p_ptr=sampling.min_p.contiguous(),
        kept_ptr=kept,
        token_ptr=tokens,
        batch=batch,
        ROWS=min(triton.next_power_of_2(batch), 64)
        if INTERPRETER
        else 1,  # the interpreter pays per program
        CHUNKS_POW2=triton.next_power_of_2(num_chunks),
        **state,
    )

    def run(which, shift: int = 0) -> None:
        warps = SamplingTiles.pass_warps(which)
        _pass_kernel[(batch, num_chunks)](PASS=which, shift=shift, num_warps=warps, **pass_args)
        _combine_kernel[(triton.cdiv(batch, combine_args["ROWS"]),)](
            PASS=which, shift=shift, **combine_args
        )

    run(MAX)  # every row: the greedy token, and m
    random = not sampling.all_greedy
    if random:
        run(SUM)
    if random and sampling.any_top_k:
        for digit in range(NUM_DIGITS):
            run(COUNT, shift=(NUM_DIGITS - 1 - digit) * RADIX_BITS)
    if random and sampling.any_top_p:
        run(KEPT)
        for digit in range(NUM_DIGITS):
            run(MASS, shift=(NUM_DIGITS - 1 - digit) * RADIX_BITS)
    if random or write_mask:
        run(DRAW)
    return tokens, mask.bool()


def sample(logits: Tensor, sampling: SamplingTensors, chunk: int | None = None) -> Tensor:
    """One token per row: logits [B, V] -> token ids [B] int64 (the reference's semantics, Gumbel-max draw).

    `chunk` overrides the tokens per program (a power of two; tests use small ones to split small rows).
    """
    return _launch(logits, sampling, write_mask=False, chunk=chunk)[0]


def sample_with_mask(
    logits: Tensor, sampling: SamplingTensors, chunk: int | None = None
) -> tuple[Tensor, Tensor]:
    """Debug entry: the tokens [B] and the set each row could draw from, [B, V] bool (= processed_probs > 0)."""
    return _launch(logits, sampling, write_mask=True, chunk=chunk)
