"""Embedding gather: copy one row of the embedding table per token.

    ids [T] (int32/int64), weight [vocab, hidden] -> out [T, hidden]   (out[t] = weight[ids[t]])

What it does: program (t, b) reads token id `ids[t]` and copies columns
[b * BLOCK, (b + 1) * BLOCK) of that table row into row t of the output,
with one wide, masked load and one store. A row is split over several
programs only when it is wider than BLOCK (1024 elements), so a GPU gets
enough programs in flight even for a decode step with a handful of tokens.

Why it is memory-bound: there is no arithmetic at all. Per token it reads
`hidden * bytes` and writes the same amount (plus 4-8 bytes of id), 0 FLOPs,
so the only thing that matters is how close the copy runs to the memory
bandwidth: contiguous rows, wide loads, enough programs. The table itself is
large (vocab x hidden: 49152 x 576 for SmolLM2, 128256 x 4096 for Llama 3 8B)
but only the T rows asked for are touched.

Out-of-range ids: a kernel does not bounds-check, and on a GPU an id >= vocab
reads someone else's memory (silently wrong rows), so the launcher checks
`0 <= ids < vocab` first. That needs the ids' min and max on the host — one
device synchronisation per call (a tiny `aminmax` reduction). It runs once per
forward pass, which is cheap next to the model.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_same_device,
)

NAME = "embedding"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
MAX_BLOCK = 1024  # columns per program: 2-4 KiB per load, wide enough to saturate a GPU's memory system


@triton.jit
def _embedding_kernel(
    ids_ptr,  # [T] int32/int64: the token ids
    weight_ptr,  # [vocab, hidden] the embedding table, contiguous (row stride = hidden)
    out_ptr,  # [T, hidden] output, contiguous (row stride = hidden)
    hidden,  # row width, in elements
    BLOCK_SIZE: tl.constexpr,  # columns per program, a power of 2
):
    token = tl.program_id(0).to(tl.int64)  # int64: T * hidden may exceed 2^31 for long prefills
    col_block = tl.program_id(1)
    row = tl.load(ids_ptr + token).to(tl.int64)  # which table row this token reads
    cols = col_block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE]
    mask = cols < hidden  # the last block of a row may stick out
    values = tl.load(weight_ptr + row * hidden + cols, mask=mask, other=0.0)  # [BLOCK_SIZE], no arithmetic
    tl.store(out_ptr + token * hidden + cols, values, mask=mask)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] int32/int64, weight [vocab, hidden] contiguous -> [T, hidden] in weight's dtype."""
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
    lo, hi = torch.stack(list(torch.aminmax(ids))).tolist()  # one host sync for both bounds
    if lo < 0 or hi >= vocab:
        raise KernelInputError(f"{NAME}: ids must lie in [0, {vocab}) (the vocab size); got min {lo}, max {hi}")
    ids = ids.contiguous()  # [T]: a strided id vector is copied (T ints, negligible)

    block_size = min(triton.next_power_of_2(hidden), MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(hidden, block_size))  # one program per (token, column block)
    _embedding_kernel[grid](
        ids_ptr=ids,
        weight_ptr=weight,
        out_ptr=out,
        hidden=hidden,
        BLOCK_SIZE=block_size,
        num_warps=4,
    )
    return out
