"""Sampling, passes 1 and 2: the row's max (and greedy token), then the softmax denominator.

Every pass of the sampler (kernels/sampling.py) runs one program per (row,
chunk of the vocabulary), re-reads the chunk's logits and recomputes, per
block of tokens,

    z = penalized logit      (a seen token: z / penalty if z > 0, else z * penalty)
    p = exp(z / T - m) / S   (m = max z / T, S = sum exp(z / T - m)): the softmax prob

so nothing [B, V] is ever written. The two passes here find m and S: each
program writes one partial for its chunk, and the pass's combine kernel, one
program per row (per block of rows in the interpreter), folds a row's
partials into its state. The chunks split the row in index order, so "the
first index of the max" combines exactly: the smallest index among the
chunks that reach the row's best. Sums are added chunk by chunk in a fixed
order (the chunk size depends on V only), never depending on the batch.

`penalized` is the load every pass shares (the interpreter pays ~1 ms per helper
call and program, so the rest of each kernel is written out inline). fp32
throughout (bf16/fp16 logits are converted at the load), IEEE division
(`tl.div_rn`) as in torch.
"""

import triton
import triton.language as tl

from stagewise.sampling_params import PENALIZED_LOGIT_MAX

# penalized logits are clamped to +-this (sampling_params), as the reference does
_PENALIZED_MAX = tl.constexpr(PENALIZED_LOGIT_MAX)


@triton.jit
def penalized(
    logits_row,  # pointer to the row's logits
    seen_row,  # pointer to the row's seen flags (read only when PENALTY)
    offs,  # [BLOCK] token indices
    vocab,  # V: indices at or past it read -inf
    penalty,  # the row's repetition penalty
    PENALTY: tl.constexpr,  # some row of the batch has a penalty (a host flag)
):
    """One block of penalized logits z, float32; -inf outside the vocab."""
    in_vocab = offs < vocab
    z = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
    if PENALTY:  # else `seen` is never read
        seen = tl.load(seen_row + offs, mask=in_vocab, other=0) != 0
        scaled = tl.where(z < 0, z * penalty, tl.div_rn(z, penalty))  # div_rn: IEEE, like torch
        scaled = tl.minimum(tl.maximum(scaled, -_PENALIZED_MAX), _PENALIZED_MAX)  # finite
        z = tl.where(seen, scaled, z)
    return z


@triton.jit
def rows_of_combine(
    batch,  # B
    num_chunks,  # chunks per row
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS
):
    """A combine program's rows [ROWS], which exist, and the [ROWS, C] offsets of their partials."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    chunks = tl.arange(0, CHUNKS_POW2)  # [C]
    row_ok = rows < batch
    ok = row_ok[:, None] & (chunks < num_chunks)[None, :]  # [ROWS, C]
    parts = rows.to(tl.int64)[:, None] * num_chunks + chunks[None, :]  # [ROWS, C]
    return rows, row_ok, ok, parts * (1 << RADIX_BITS)


@triton.jit
def _max_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    part_f_ptr,  # [B, num_chunks, R] float32 partials: the chunk's max z
    part_i_ptr,  # [B, num_chunks, R] int32 partials: its first index
    vocab,  # V
    num_chunks,  # chunks per row
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS (this pass writes the first)
):
    """Pass 1, per (row, chunk): the largest penalized logit and its first index."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    logits_row = logits_ptr + row * logits_row_stride
    seen_row = seen_ptr + row * seen_row_stride
    penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
    arange = tl.arange(0, BLOCK)
    z_max = float("-inf")
    argmax = first
    for start in range(first, last, BLOCK):
        z = penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)  # [BLOCK]
        block_max = tl.max(z, axis=0)
        block_arg = tl.min(tl.where(z == block_max, start + arange, vocab), axis=0)  # first index
        argmax = tl.where(block_max > z_max, block_arg, argmax)  # strict >: earlier blocks win ties
        z_max = tl.maximum(z_max, block_max)
    tl.store(part_f_ptr + part, z_max)
    tl.store(part_i_ptr + part, argmax)


@triton.jit
def _max_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    row_max_ptr,  # [B] float32 state, written: m = max z / T
    token_ptr,  # [B] int64, written: the greedy token
    part_f_ptr,  # [B, num_chunks, R] float32: the chunks' max z
    part_i_ptr,  # [B, num_chunks, R] int32: their first indices
    batch,  # B
    vocab,  # V
    num_chunks,  # chunks per row
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS
):
    """Combine 1, per row: the greedy token (first index of the max) and m = max z / T."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    drawn = temperature >= GREEDY
    z = tl.load(part_f_ptr + parts, mask=ok, other=float("-inf"))  # [ROWS, C] chunk maxima
    index = tl.load(part_i_ptr + parts, mask=ok, other=vocab)  # [ROWS, C] their first indices
    z_max = tl.max(z, axis=1)  # [ROWS]
    token = tl.min(tl.where(z == z_max[:, None], index, vocab), axis=1)  # first index of the max
    tl.store(token_ptr + rows, token.to(tl.int64), mask=row_ok)
    m = tl.div_rn(z_max, tl.where(drawn, temperature, 1.0))  # [ROWS] max z / T
    tl.store(row_max_ptr + rows, m, mask=row_ok)


@triton.jit
def _sum_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    row_max_ptr,  # [B] float32 state: m = max z / T
    part_f_ptr,  # [B, num_chunks, R] float32 partials, written: the chunk's share of S
    vocab,  # V
    num_chunks,  # chunks per row
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS (this pass writes the first)
):
    """Pass 2, per (row, chunk): the chunk's share of S = sum exp(z / T - m)."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    temperature = tl.load(temperature_ptr + row)
    if temperature >= GREEDY:  # a greedy row needs no probabilities
        logits_row = logits_ptr + row * logits_row_stride
        seen_row = seen_ptr + row * seen_row_stride
        penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
        arange = tl.arange(0, BLOCK)
        m = tl.load(row_max_ptr + row)
        s = 0.0
        for start in range(first, last, BLOCK):
            z = penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
            s += tl.sum(tl.exp(tl.div_rn(z, temperature) - m), axis=0)
        tl.store(part_f_ptr + part, s)


@triton.jit
def _sum_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    min_p_ptr,  # [B] float32; 0 = off
    row_sum_ptr,  # [B] float32 state, written: S
    threshold_ptr,  # [B] float32 state, written: keep p >= min_p / S
    prefix_ptr,  # [B] int32 state, written: 0, the empty start of the top-k search
    part_f_ptr,  # [B, num_chunks, R] float32: the chunks' shares of S
    batch,  # B
    num_chunks,  # chunks per row
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS
):
    """Combine 2, per row: S, and min_p's threshold (max prob = exp(0) / S, so min_p / S)."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    drawn = row_ok & (temperature >= GREEDY)  # greedy rows have no partials
    s = tl.sum(tl.load(part_f_ptr + parts, mask=ok & drawn[:, None], other=0.0), axis=1)  # [ROWS]
    s = tl.where(drawn, s, 1.0)
    min_p = tl.load(min_p_ptr + rows, mask=row_ok, other=0.0)
    tl.store(row_sum_ptr + rows, s, mask=drawn)
    tl.store(threshold_ptr + rows, min_p * tl.div_rn(1.0, s), mask=drawn)
    tl.store(prefix_ptr + rows, tl.zeros([ROWS], dtype=tl.int32), mask=drawn)
