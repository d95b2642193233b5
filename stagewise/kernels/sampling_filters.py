"""Sampling, the top-k and top-p passes: their thresholds on p, found without a sort.

top-k keeps p >= the k-th largest p, the largest t with count(p >= t) >= k.
count is a step function of t, so a search over t finds it, and searching
over the float's bits makes it exact: a non-negative float32 and its int32
bits sort alike, and p in [0, 1] has its bits below 2^30. Deciding those 30
bits from the top lands on the k-th largest value itself, so ties at it are
all kept, as in the reference. A COUNT pass decides RADIX_BITS = 5 bits: it
counts at 32 candidate thresholds at once (prefix + j * 2^shift, a [block,
32] comparison), and its combine keeps the largest j whose count is >= k;
6 passes decide the 30 bits.

top-p keeps p >= p_cut among the survivors of min_p and top-k, renormalized:
p_cut is the largest t with mass(p >= t) / mass(survivors) >= top_p. KEPT
sums the survivors' mass once, then 6 MASS passes run the same search,
summing the mass above the 32 candidates instead of counting.

min_p and top-k both keep a top set, so the kept set is p >= the larger of
their thresholds, and top-p searches above it. A row whose filter is off does
nothing here. A GPU walks SEARCH_BLOCK tokens at a time, so a search's
[block, 32] tile stays in registers; the interpreter takes whole blocks (it
pays per operation). p is written out inline: a helper costs the interpreter
~1 ms per call. A threshold can differ from the reference's when a prob lies
within an ulp of it (exp and the sums round differently).
"""

import triton
import triton.language as tl

from stagewise.kernels.sampling_softmax import penalized, rows_of_combine


@triton.jit
def _count_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_k_ptr,  # [B] int64; 0 = off
    row_max_ptr,  # [B] float32 state: m
    row_sum_ptr,  # [B] float32 state: S
    prefix_ptr,  # [B] int32 state: the bits of the k-th largest p decided so far
    part_i_ptr,  # [B, num_chunks, R] int32 partials, written: count(p >= t_j), j < R
    vocab,  # V
    num_chunks,  # chunks per row
    shift,  # the bit position of the digit being decided
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of SEARCH_BLOCK)
    SEARCH_BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # threshold bits decided per pass: R = 2^RADIX_BITS candidates
):
    """Top-k, per (row, chunk): how many tokens have p >= each of 32 candidate thresholds."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    temperature = tl.load(temperature_ptr + row)
    k = tl.load(top_k_ptr + row)
    if (temperature >= GREEDY) & (k > 0) & (k < vocab):
        logits_row = logits_ptr + row * logits_row_stride
        seen_row = seen_ptr + row * seen_row_stride
        penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
        arange = tl.arange(0, SEARCH_BLOCK)
        candidates = tl.arange(0, 1 << RADIX_BITS)  # [R] the values of one digit
        m, s = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
        t = tl.load(prefix_ptr + row) + (candidates << shift)  # [R] threshold bits
        t = t.to(tl.float32, bitcast=True)  # [R] thresholds
        count = tl.zeros([1 << RADIX_BITS], dtype=tl.int32)
        for start in range(first, last, SEARCH_BLOCK):
            offs = start + arange
            z = penalized(logits_row, seen_row, offs, vocab, penalty, PENALTY)
            p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)  # [SB]
            above = (p[:, None] >= t[None, :]) & (offs < vocab)[:, None]  # [SB, R]
            count += tl.sum(above.to(tl.int32), axis=0)  # [SB, R] -> [R]
        tl.store(part_i_ptr + part + candidates, count)


@triton.jit
def _count_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_k_ptr,  # [B] int64; 0 = off
    threshold_ptr,  # [B] float32 state: keep p >= threshold (raised after the last digit)
    prefix_ptr,  # [B] int32 state: the bits decided so far (reset after the last digit)
    part_i_ptr,  # [B, num_chunks, R] int32: the chunks' counts
    batch,  # B
    vocab,  # V
    num_chunks,  # chunks per row
    shift,  # the bit position of the digit being decided (0: the last digit)
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # threshold bits decided per pass
):
    """Top-k, per row: the next 5 bits of the k-th largest p (the largest j still counting k)."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    k = tl.load(top_k_ptr + rows, mask=row_ok, other=0)
    active = row_ok & (temperature >= GREEDY) & (k > 0) & (k < vocab)  # [ROWS]
    candidates = tl.arange(0, 1 << RADIX_BITS)  # [R]
    tiles = parts[:, :, None] + candidates[None, None, :]  # [ROWS, C, R]: each chunk's counts
    tile_ok = (ok & active[:, None])[:, :, None]
    count = tl.sum(tl.load(part_i_ptr + tiles, mask=tile_ok, other=0), axis=1)  # [ROWS, R]
    digit = tl.max(tl.where(count >= k[:, None], candidates[None, :], 0), axis=1)  # [ROWS]
    kth = tl.load(prefix_ptr + rows, mask=active, other=0) + (digit << shift)  # [ROWS]
    if shift == 0:  # the last digit: kth is the k-th largest p itself
        threshold = tl.load(threshold_ptr + rows, mask=active, other=0.0)
        threshold = tl.maximum(threshold, kth.to(tl.float32, bitcast=True))
        tl.store(threshold_ptr + rows, threshold, mask=active)
        tl.store(prefix_ptr + rows, tl.zeros([ROWS], dtype=tl.int32), mask=active)  # for top-p
    else:
        tl.store(prefix_ptr + rows, kth, mask=active)


@triton.jit
def _kept_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_p_ptr,  # [B] float32; 1 = off
    row_max_ptr,  # [B] float32 state: m
    row_sum_ptr,  # [B] float32 state: S
    threshold_ptr,  # [B] float32 state: keep p >= threshold (min_p and top-k)
    part_f_ptr,  # [B, num_chunks, R] float32 partials, written: the chunk's kept mass
    vocab,  # V
    num_chunks,  # chunks per row
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS (this pass writes the first)
):
    """Top-p, per (row, chunk): the mass of the tokens that survive min_p and top-k."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    temperature = tl.load(temperature_ptr + row)
    if (temperature >= GREEDY) & (tl.load(top_p_ptr + row) < 1.0):
        logits_row = logits_ptr + row * logits_row_stride
        seen_row = seen_ptr + row * seen_row_stride
        penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
        arange = tl.arange(0, BLOCK)
        m, s = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
        threshold = tl.load(threshold_ptr + row)
        kept = 0.0
        for start in range(first, last, BLOCK):
            z = penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
            p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)  # [BLOCK]
            kept += tl.sum(tl.where(p >= threshold, p, 0.0), axis=0)
        tl.store(part_f_ptr + part, kept)


@triton.jit
def _kept_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_p_ptr,  # [B] float32; 1 = off
    kept_ptr,  # [B] float32 state, written: the survivors' mass
    part_f_ptr,  # [B, num_chunks, R] float32: the chunks' kept mass
    batch,  # B
    num_chunks,  # chunks per row
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS
):
    """Top-p, per row: the survivors' mass, which the search divides by."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
    active = row_ok & (temperature >= GREEDY) & (top_p < 1.0)  # [ROWS]
    kept = tl.sum(tl.load(part_f_ptr + parts, mask=ok & active[:, None], other=0.0), axis=1)
    tl.store(kept_ptr + rows, kept, mask=active)


@triton.jit
def _mass_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_p_ptr,  # [B] float32; 1 = off
    row_max_ptr,  # [B] float32 state: m
    row_sum_ptr,  # [B] float32 state: S
    threshold_ptr,  # [B] float32 state: keep p >= threshold (min_p and top-k)
    prefix_ptr,  # [B] int32 state: the bits of p_cut decided so far
    part_f_ptr,  # [B, num_chunks, R] float32 partials, written: mass(p >= t_j), j < R
    vocab,  # V
    num_chunks,  # chunks per row
    shift,  # the bit position of the digit being decided
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of SEARCH_BLOCK)
    SEARCH_BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # threshold bits decided per pass: R = 2^RADIX_BITS candidates
):
    """Top-p, per (row, chunk): the kept mass at or above each of 32 candidate thresholds."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    temperature = tl.load(temperature_ptr + row)
    if (temperature >= GREEDY) & (tl.load(top_p_ptr + row) < 1.0):
        logits_row = logits_ptr + row * logits_row_stride
        seen_row = seen_ptr + row * seen_row_stride
        penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
        arange = tl.arange(0, SEARCH_BLOCK)
        candidates = tl.arange(0, 1 << RADIX_BITS)  # [R] the values of one digit
        m, s = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
        t = tl.load(prefix_ptr + row) + (candidates << shift)  # [R] threshold bits
        t = tl.maximum(t.to(tl.float32, bitcast=True), tl.load(threshold_ptr + row))  # [R]
        mass = tl.zeros([1 << RADIX_BITS], dtype=tl.float32)
        for start in range(first, last, SEARCH_BLOCK):
            z = penalized(logits_row, seen_row, start + arange, vocab, penalty, PENALTY)
            p = tl.div_rn(tl.exp(tl.div_rn(z, temperature) - m), s)  # [SB]
            mass += tl.sum(tl.where(p[:, None] >= t[None, :], p[:, None], 0.0), axis=0)  # [R]
        tl.store(part_f_ptr + part + candidates, mass)


@triton.jit
def _mass_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    top_p_ptr,  # [B] float32; 1 = off
    threshold_ptr,  # [B] float32 state: keep p >= threshold (raised after the last digit)
    kept_ptr,  # [B] float32 state: the survivors' mass
    prefix_ptr,  # [B] int32 state: the bits of p_cut decided so far
    part_f_ptr,  # [B, num_chunks, R] float32: the chunks' masses
    batch,  # B
    num_chunks,  # chunks per row
    shift,  # the bit position of the digit being decided (0: the last digit)
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # threshold bits decided per pass
):
    """Top-p, per row: the next 5 bits of p_cut (the largest j whose share still reaches top_p)."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    top_p = tl.load(top_p_ptr + rows, mask=row_ok, other=1.0)
    active = row_ok & (temperature >= GREEDY) & (top_p < 1.0)  # [ROWS]
    candidates = tl.arange(0, 1 << RADIX_BITS)  # [R]
    tiles = parts[:, :, None] + candidates[None, None, :]  # [ROWS, C, R]: each chunk's masses
    tile_ok = (ok & active[:, None])[:, :, None]
    mass = tl.sum(tl.load(part_f_ptr + tiles, mask=tile_ok, other=0.0), axis=1)  # [ROWS, R]
    kept = tl.load(kept_ptr + rows, mask=active, other=1.0)
    ratio = mass / kept[:, None]  # [ROWS, R]: the survivors' share at or above each candidate
    digit = tl.max(tl.where(ratio >= top_p[:, None], candidates[None, :], 0), axis=1)
    cut = tl.load(prefix_ptr + rows, mask=active, other=0) + (digit << shift)  # [ROWS]
    tl.store(prefix_ptr + rows, cut, mask=active)
    if shift == 0:  # the last digit: cut is p_cut
        threshold = tl.load(threshold_ptr + rows, mask=active, other=0.0)
        threshold = tl.maximum(threshold, cut.to(tl.float32, bitcast=True))
        tl.store(threshold_ptr + rows, threshold, mask=active)
