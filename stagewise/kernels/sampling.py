"""Fused sampling: penalty, temperature, min_p, top-k, top-p and the draw, without a sort.

    logits [B, V], SamplingTensors of B rows -> one token per row, [B] int64

Semantics are the sampling stage's (stages/sampling.py). A row's vocabulary is
cut into chunks of CHUNK tokens and every pass runs one program per (row,
chunk), so a few rows still fill a GPU; each pass writes one partial per chunk
and its combine kernel folds a row's partials into the row's state, which the
next pass reads (the launch boundary is the only synchronisation):

    pass        partial of a chunk               combine: row state          module
    max         max z and its first index        m; the greedy token         sampling_softmax
    sum         sum exp(z / T - m)               S; threshold = min_p / S    sampling_softmax
    count x 6   count(p >= t_j), 32 candidates   5 bits of the k-th p        sampling_filters
    kept        sum of p >= threshold            the survivors' mass         sampling_filters
    mass x 6    mass(p >= t_j), 32 candidates    5 bits of p_cut             sampling_filters
    draw        best Gumbel score, its index     the token                   here

The draw is Gumbel-max: the argmax over the kept tokens of log p + g, g =
-log(-log u), picks token i with probability p_i / sum(kept p), so the
renormalization is free. u comes from Philox keyed by the row's
`stream_seed(seed, offset)` and the token index: batch-independent and the
same on CPU and GPU; the reference's distribution, another stream. Which
passes run comes from SamplingTensors' host flags, never from a device read.
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
from stagewise.kernels.sampling_filters import (
    _count_combine_kernel,
    _count_pass_kernel,
    _kept_combine_kernel,
    _kept_pass_kernel,
    _mass_combine_kernel,
    _mass_pass_kernel,
)
from stagewise.kernels.sampling_softmax import (
    _max_combine_kernel,
    _max_pass_kernel,
    _sum_combine_kernel,
    _sum_pass_kernel,
    penalized,
    rows_of_combine,
)
from stagewise.sampling_params import GREEDY_TEMPERATURE, SamplingTensors

CHUNK = 2048  # tokens of a row per program: a constant, so results never depend on the batch
MAX_CHUNKS = 128  # a larger vocab gets larger chunks: the combine's [chunks, 32] tile stays small
BLOCK_MAX = 1024  # tokens per block of a streaming pass over a chunk
SEARCH_BLOCK_GPU = 256  # tokens per block of a search pass on a GPU: [256, 32] in registers
RADIX_BITS = 5  # threshold bits decided per search pass: 2^5 = 32 candidates at once
NUM_DIGITS = 6  # 6 * 5 = 30 bits: every float32 in [0, 1] has its bits below 2^30


@triton.jit
def _draw_pass_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, last dim contiguous
    logits_row_stride,  # elements between two rows of logits
    seen_ptr,  # [B, V] uint8: 1 = token already seen (penalized)
    seen_row_stride,  # elements between two rows of seen
    penalty_ptr,  # [B] float32 repetition penalty; 1 = off
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    seed_ptr,  # [B] int64: the row's Philox seed, stream_seed(seed, offset)
    row_max_ptr,  # [B] float32 state: m
    row_sum_ptr,  # [B] float32 state: S
    threshold_ptr,  # [B] float32 state: keep p >= threshold (min_p, top-k, top-p)
    token_ptr,  # [B] int64: the greedy token (read for the debug mask of greedy rows)
    part_f_ptr,  # [B, num_chunks, R] float32 partials, written: the chunk's best score
    part_i_ptr,  # [B, num_chunks, R] int32 partials, written: its first index
    mask_ptr,  # [B, V] uint8, written when WRITE_MASK: the tokens the row may draw
    mask_row_stride,  # elements between two rows of mask
    vocab,  # V
    num_chunks,  # chunks per row
    PENALTY: tl.constexpr,  # some row has a repetition penalty: read `seen`
    GREEDY: tl.constexpr,  # temperatures below this are greedy
    WRITE_MASK: tl.constexpr,  # debug: also store the set of tokens the draw may pick
    CHUNK: tl.constexpr,  # tokens per chunk (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # tokens per block of the chunk's loop
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS (this pass writes the first)
):
    """The draw, per (row, chunk): the best log p + Gumbel noise over the kept tokens."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK  # this program's tokens: first .. last - 1
    last = tl.minimum(first + CHUNK, vocab)
    part = (row * num_chunks + tl.program_id(1)) * (1 << RADIX_BITS)  # this program's partials
    temperature = tl.load(temperature_ptr + row)
    mask_row = mask_ptr + row * mask_row_stride
    arange = tl.arange(0, BLOCK)
    if temperature >= GREEDY:
        logits_row = logits_ptr + row * logits_row_stride
        seen_row = seen_ptr + row * seen_row_stride
        penalty = tl.load(penalty_ptr + row) if PENALTY else 1.0
        m, s = tl.load(row_max_ptr + row), tl.load(row_sum_ptr + row)
        threshold = tl.load(threshold_ptr + row)
        seed = tl.load(seed_ptr + row)
        best = float("-inf")
        token = first
        for start in range(first, last, BLOCK):
            offs = start + arange
            z = penalized(logits_row, seen_row, offs, vocab, penalty, PENALTY)  # [BLOCK]
            x = tl.div_rn(z, temperature) - m  # log p + log S: the constant drops out of argmax
            p = tl.div_rn(tl.exp(x), s)
            keep = (p >= threshold) & (p > 0.0) & (offs < vocab)
            bits = tl.randint(seed, offs).to(tl.uint32)  # Philox: (row seed, token index)
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits -> (0, 1)
            score = tl.where(keep, x - tl.log(-tl.log(u)), float("-inf"))  # + Gumbel noise
            block_max = tl.max(score, axis=0)
            block_arg = tl.min(tl.where(score == block_max, offs, vocab), axis=0)
            token = tl.where(block_max > best, block_arg, token)  # earlier blocks win ties
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
def _draw_combine_kernel(
    temperature_ptr,  # [B] float32; < GREEDY = argmax
    token_ptr,  # [B] int64, written for drawn rows: the token
    part_f_ptr,  # [B, num_chunks, R] float32: the chunks' best scores
    part_i_ptr,  # [B, num_chunks, R] int32: their first indices
    batch,  # B
    vocab,  # V
    num_chunks,  # chunks per row
    GREEDY: tl.constexpr,  # temperatures below this are greedy (they keep the max's token)
    ROWS: tl.constexpr,  # rows per program
    CHUNKS_POW2: tl.constexpr,  # num_chunks rounded up to a power of two
    RADIX_BITS: tl.constexpr,  # partials per chunk: 2^RADIX_BITS
):
    """The draw, per row: the first index of the row's best score."""
    rows, row_ok, ok, parts = rows_of_combine(batch, num_chunks, ROWS, CHUNKS_POW2, RADIX_BITS)
    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=1.0)  # [ROWS]
    drawn = row_ok & (temperature >= GREEDY)
    best = tl.load(part_f_ptr + parts, mask=ok & drawn[:, None], other=float("-inf"))  # [ROWS, C]
    index = tl.load(part_i_ptr + parts, mask=ok & drawn[:, None], other=vocab)
    top = tl.max(best, axis=1)  # [ROWS]
    token = tl.min(tl.where(best == top[:, None], index, vocab), axis=1)
    tl.store(token_ptr + rows, token.to(tl.int64), mask=drawn)


# the passes by name, in launch order: (the pass over every (row, chunk), its per-row combine)
PASSES = {
    "max": (_max_pass_kernel, _max_combine_kernel),
    "sum": (_sum_pass_kernel, _sum_combine_kernel),
    "count": (_count_pass_kernel, _count_combine_kernel),
    "kept": (_kept_pass_kernel, _kept_combine_kernel),
    "mass": (_mass_pass_kernel, _mass_combine_kernel),
    "draw": (_draw_pass_kernel, _draw_combine_kernel),
}


def sample(logits: Tensor, sampling: SamplingTensors, chunk: int | None = None) -> Tensor:
    """One token per row: logits [B, V] -> token ids [B] int64 (the reference's semantics).

    `chunk` overrides the tokens per program (a power of two; tests use small ones to split rows).
    """
    return _launch(logits, sampling, write_mask=False, chunk=chunk)[0]


def sample_with_mask(
    logits: Tensor, sampling: SamplingTensors, chunk: int | None = None
) -> tuple[Tensor, Tensor]:
    """Debug entry: the tokens [B] and the set each row could draw from, [B, V] bool.

    The set is the reference's `processed_probs > 0`.
    """
    return _launch(logits, sampling, write_mask=True, chunk=chunk)


def _launch(
    logits: Tensor, sampling: SamplingTensors, write_mask: bool, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """The passes a step needs, in order, each a (row, chunk) grid and then its per-row combine.

    Which passes run comes from host flags of `sampling` (SamplingParams are host objects), never
    from reading its tensors: a read would wait for the GPU (a host-bound step, no CUDA graphs).
    """
    _check(logits, sampling)
    batch, vocab = logits.shape
    tiles = sampling_tiles(vocab, chunk)
    device = logits.device
    radix = 1 << RADIX_BITS
    row_max, row_sum, threshold, kept = torch.empty(4, batch, dtype=torch.float32, device=device)
    mask = torch.empty((batch, vocab) if write_mask else (1, 1), dtype=torch.uint8, device=device)
    seen = sampling.seen.view(torch.uint8)  # [B, V] bool -> uint8, the same bytes
    args = dict(  # every kernel takes the part of this set that its signature names
        logits_ptr=logits,
        logits_row_stride=logits.stride(0),
        seen_ptr=seen,
        seen_row_stride=seen.stride(0),
        penalty_ptr=sampling.repetition_penalty.contiguous(),
        temperature_ptr=sampling.temperature.contiguous(),
        top_k_ptr=sampling.top_k.contiguous(),
        top_p_ptr=sampling.top_p.contiguous(),
        min_p_ptr=sampling.min_p.contiguous(),
        seed_ptr=stream_seeds(sampling.seeds, sampling.offsets),  # [B] int64
        row_max_ptr=row_max,  # [B] the row state the passes hand on
        row_sum_ptr=row_sum,
        threshold_ptr=threshold,
        kept_ptr=kept,
        prefix_ptr=torch.empty(batch, dtype=torch.int32, device=device),
        token_ptr=torch.empty(batch, dtype=torch.int64, device=device),  # [B] the result
        part_f_ptr=torch.empty(batch, tiles.num_chunks, radix, dtype=torch.float32, device=device),
        part_i_ptr=torch.empty(batch, tiles.num_chunks, radix, dtype=torch.int32, device=device),
        mask_ptr=mask,
        mask_row_stride=mask.stride(0),
        batch=batch,
        vocab=vocab,
        num_chunks=tiles.num_chunks,
        PENALTY=sampling.any_penalty,
        GREEDY=GREEDY_TEMPERATURE,
        WRITE_MASK=write_mask,
        CHUNK=tiles.chunk,
        BLOCK=tiles.block,
        SEARCH_BLOCK=tiles.search_block,
        RADIX_BITS=RADIX_BITS,
        ROWS=tiles.combine_rows(batch),
        CHUNKS_POW2=triton.next_power_of_2(tiles.num_chunks),
    )

    def run(name: str, shift: int = 0) -> None:
        pass_kernel, combine_kernel = PASSES[name]
        warps = tiles.pass_warps(name)
        pass_kernel[(batch, tiles.num_chunks)](
            **kernel_args(pass_kernel, {**args, "shift": shift}), num_warps=warps
        )
        combine_grid = (triton.cdiv(batch, args["ROWS"]),)
        combine_kernel[combine_grid](**kernel_args(combine_kernel, {**args, "shift": shift}))

    run("max")  # every row: the greedy token, and m
    random = not sampling.all_greedy
    if random:
        run("sum")
    shifts = [(NUM_DIGITS - 1 - digit) * RADIX_BITS for digit in range(NUM_DIGITS)]  # top first
    if random and sampling.any_top_k:
        for shift in shifts:
            run("count", shift)
    if random and sampling.any_top_p:
        run("kept")
        for shift in shifts:
            run("mass", shift)
    if random or write_mask:
        run("draw")
    return args["token_ptr"], mask.bool()


def kernel_args(kernel, args: dict) -> dict:
    """The arguments `kernel` takes, picked by name from the step's set (KeyError if one lacks)."""
    return {name: args[name] for name in kernel.arg_names}


_U64 = 2**64


def _signed(c: int) -> int:
    """The int64 with the same bits as the uint64 `c`."""
    return c - _U64 if c >= 2**63 else c


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 bits: torch's >> is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: Tensor) -> Tensor:
    """`stages.sampling._splitmix64` on int64 tensors: wrapping int64 arithmetic is uint64's."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def stream_seeds(seeds: Tensor, offsets: Tensor) -> Tensor:
    """Per-row Philox seeds [B] int64: `stream_seed(seed, offset)` on the device (no host sync)."""
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


@dataclass(frozen=True)
class SamplingTiles:
    """How `_launch` cuts a row of the vocabulary (host values: the compile gate compiles them)."""

    chunk: int  # tokens per program
    num_chunks: int  # programs per row
    block: int  # tokens per block of a streaming pass
    search_block: int  # tokens per block of a search pass
    interpreter: bool  # the CPU interpreter: one combine program for up to 64 rows

    @staticmethod
    def pass_warps(name: str) -> int:
        """Warps of a pass: a search's [256, 32] tile needs 8 to stay in registers, others 4."""
        return 8 if name in ("count", "mass") else 4

    def combine_rows(self, batch: int) -> int:
        """Rows per combine program: 1 on a GPU, up to 64 in the interpreter (it pays per call)."""
        return min(triton.next_power_of_2(batch), 64) if self.interpreter else 1


def chunk_size(vocab: int) -> int:
    """Tokens per program: CHUNK, or more for a vocab that would need over MAX_CHUNKS chunks."""
    return max(CHUNK, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS)))


def sampling_tiles(
    vocab: int, chunk: int | None = None, interpreter: bool = INTERPRETER
) -> SamplingTiles:
    """The chunk and block sizes for a vocab (blocks divide the chunk: none straddles two)."""
    chunk = chunk or chunk_size(vocab)
    if chunk < 16 or chunk & (chunk - 1):
        raise KernelInputError(f"sample: chunk {chunk} must be a power of two >= 16")
    chunk = min(chunk, triton.next_power_of_2(vocab))  # a small vocab is one chunk of its own size
    block = min(BLOCK_MAX, chunk, triton.next_power_of_2(vocab))
    search_block = block if interpreter else min(block, SEARCH_BLOCK_GPU)  # interpreter: per op
    return SamplingTiles(chunk, triton.cdiv(vocab, chunk), block, search_block, interpreter)
