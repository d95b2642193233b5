"""Embedding gather: copy one row of the embedding table per token.

    ids [T] (int32/int64), weight [vocab, hidden] -> out [T, hidden]   (out[t] = weight[ids[t]])

Tiling: program (i, j) copies tokens [i * BLOCK_T, (i + 1) * BLOCK_T) and
columns [j * BLOCK_C, (j + 1) * BLOCK_C) of their table rows: it loads the
BLOCK_T ids, then one [BLOCK_T, BLOCK_C] tile gathered from the table (row
ids[t] for tile row t), and stores it into rows of the output.

Memory-bound: no arithmetic at all, so the copy should run at the memory's
bandwidth: contiguous rows (whole rows up to MAX_BLOCK columns), one id load
for BLOCK_T rows whose loads are all in flight at once, 16-byte vectors
(`hidden` is a multiple of 16 for every real model). With few tokens (decode)
rows are split over more programs; on a GPU BLOCK_T and num_warps are
autotuned (row_tiles.py; measurements: benchmarks/README.md, "Kernel notes").

Out-of-range ids would read other memory (silently wrong rows). Checking
`0 <= ids < vocab` reads them on the host, a sync that makes the step
host-bound, so the launcher checks only with debug checks on
(`STAGEWISE_DEBUG_CHECKS=1`, as in the test suite).
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_same_device,
)
from stagewise.kernels.plan_cache import cdiv, plan_cache
from stagewise.kernels.row_tiles import (
    TileConfig,
    gpu_candidates,
    launch,
    token_bucket,
    tokens_per_program,
    warps_for,
)
from stagewise.kernels.targets import checked_target
from stagewise.runtime import debug_checks

NAME = "embedding"
ID_DTYPES = (torch.int32, torch.int64)
MAX_BLOCK = 4096  # columns per program: a whole Llama-3-8B row
MIN_BLOCK = 256  # narrowest column block when a short batch splits its rows
# elements of one [BLOCK_T, BLOCK_C] tile: 16 KB in bf16 (interpreter; GPU: around it)
TOKEN_TILE = 8192
# a short batch splits its rows until it has this many programs (about one per SM)
MIN_PROGRAMS = 128


@triton.jit(do_not_specialize=["num_tokens", "tokens_bucket"])  # one compiled variant for every T
def _embedding_kernel(
    ids_ptr,  # [T] int32/int64: the token ids
    weight_ptr,  # [vocab, hidden] the embedding table, contiguous (row stride = hidden)
    out_ptr,  # [T, hidden] output, contiguous (row stride = hidden)
    num_tokens,  # T: rows of the last token tile beyond it are masked off
    hidden,  # row width, in elements
    tokens_bucket,  # next power of 2 >= T: only the GPU autotuner's key, unused here
    BLOCK_T: tl.constexpr,  # tokens per program, a power of 2
    BLOCK_C: tl.constexpr,  # columns per program, a power of 2
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    token_ok = tokens < num_tokens
    # [BLOCK_T] which table rows
    rows = tl.load(ids_ptr + tokens, mask=token_ok, other=0).to(tl.int64)
    # [BLOCK_T, BLOCK_C]: ragged last tile, last columns
    mask = token_ok[:, None] & (cols < hidden)[None, :]
    src = weight_ptr + rows[:, None] * hidden + cols[None, :]  # int64: vocab * hidden may pass 2^31
    values = tl.load(src, mask=mask, other=0.0)  # [BLOCK_T, BLOCK_C], no arithmetic
    dst = out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(dst, values, mask=mask)


@plan_cache
def embedding_tiles(
    num_tokens: int, hidden: int, interpreter: bool = INTERPRETER
) -> tuple[TileConfig, ...]:
    """Tile candidates: one under the interpreter, a few around it on a GPU (kept per shape).

    Whole rows up to MAX_BLOCK columns, and BLOCK_T tokens so the tile is about TOKEN_TILE elements;
    a short batch (fewer than MIN_PROGRAMS programs) gets one token per program and narrower column
    blocks.
    """
    block_c = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    block_t = tokens_per_program(num_tokens, block_c, TOKEN_TILE)
    while (
        block_t > 1
        and triton.cdiv(num_tokens, block_t) * triton.cdiv(hidden, block_c) < MIN_PROGRAMS
    ):
        block_t //= 2
    while block_c > MIN_BLOCK and num_tokens * triton.cdiv(hidden, block_c) < MIN_PROGRAMS:
        block_c //= 2
    best = TileConfig(block_t, warps_for(block_t * block_c), block_c)
    return (best,) if interpreter else gpu_candidates(best)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] int32/int64, weight [vocab, hidden] contiguous -> [T, hidden] in weight's dtype.

    Never reads ids on the host: the grid comes from shapes, so the launch queues without waiting
    for the GPU (no host-bound step, capturable in a CUDA graph). That ids lie in [0, vocab) is
    checked only with debug checks on (`stagewise.runtime.debug_checks`).
    """
    check_dim(NAME, "ids", ids, 1)
    check_dim(NAME, "weight", weight, 2)
    check_dtype(NAME, "ids", ids, ID_DTYPES)
    check_dtype(NAME, "weight", weight, FLOAT_DTYPES)
    check_contiguous(NAME, "weight", weight)
    check_same_device(NAME, ids=ids, weight=weight)
    vocab, hidden = weight.shape
    num_tokens = ids.shape[0]
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0 or hidden == 0:
        return out
    if debug_checks():  # a value check reads ids on the host: a sync, so only on request
        lo, hi = torch.stack(list(torch.aminmax(ids))).tolist()
        if lo < 0 or hi >= vocab:
            raise KernelInputError(
                f"{NAME}: ids must lie in [0, {vocab}) (the vocab size); got min {lo}, max {hi}"
            )
    ids = ids.contiguous()  # [T]: a strided id vector is copied (T ints, negligible)
    checked_target(NAME, weight)  # the pre-Ampere policy (targets.py)

    launch(
        _embedding_kernel,
        embedding_tiles(num_tokens, hidden),
        key=("tokens_bucket", "hidden"),
        grid=lambda meta: (cdiv(num_tokens, meta["BLOCK_T"]), cdiv(hidden, meta["BLOCK_C"])),
        ids_ptr=ids,
        weight_ptr=weight,
        out_ptr=out,
        num_tokens=num_tokens,
        hidden=hidden,
        tokens_bucket=token_bucket(num_tokens),
    )
    return out
