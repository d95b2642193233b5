"""RoPE in place on q and k, rotate-half convention.

    positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d] float32
        -> q, k rotated in place (the same tensor objects are returned)

    for each head, with i in [0, d/2):  (x_i, x_{i+d/2}) <- (x_i cos - x_{i+d/2} sin,  x_{i+d/2} cos + x_i sin)
    where cos, sin = cos_sin_cache[position, i], cos_sin_cache[position, d/2 + i]

What it does: program (t, b) loads token t's position, gathers its cos/sin row
(d/2 + d/2 floats) once, and rotates a block of heads of q *and* the same block
of heads of k with it, as [BLOCK_HEADS, d/2] tiles (first halves and second
halves), in float32, storing back in the tensors' dtype. q and k may be strided
views of the fused QKV output (token stride (H + 2*Hkv) * d, as `split_qkv`
returns them): the kernel takes both strides, so nothing is copied.

Why it is memory-bound: per element, ~3 FLOPs (two multiplies, one add) for
2 * bytes of traffic (read, write back); the cos/sin row is read once per token
and reused by all H + Hkv heads. Working in place moves the minimum:
q and k are read once and written once, no new tensors are allocated, and no
torch.cat of the two halves is needed as in the naive version (which also
materialises x1, x2, x1*cos, x2*sin... as separate passes over memory).

Partial rotary (rotary_dim < head_dim, as in some non-Llama models) is not
supported: the launcher says so.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)

NAME = "rope"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POSITION_DTYPES = (torch.int32, torch.int64)
MAX_TILE = 2048  # elements of one half-tile [BLOCK_HEADS, d/2]: bounds registers per program


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head of q or k
    head_stride,  # elements between consecutive heads (d for split_qkv views)
    num_heads,  # heads in this tensor (H or Hkv); rows of the tile beyond it are masked off
    heads,  # [BLOCK_HEADS] head indices handled by this program
    offs,  # [BLOCK_HALF] feature index i within the first half
    offs_mask,  # [BLOCK_HALF] i < d/2
    cos,  # [1, BLOCK_HALF] float32
    sin,  # [1, BLOCK_HALF] float32
    HALF: tl.constexpr,  # d / 2: distance between the two features of a pair
):
    mask = (heads[:, None] < num_heads) & offs_mask[None, :]  # [BLOCK_HEADS, BLOCK_HALF]
    first = x_ptr + heads[:, None] * head_stride + offs[None, :]  # pointers to x_i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_HALF]
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)  # x_{i + d/2}
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr,  # [T] int32/int64: position of each token
    q_ptr,  # [T, H, d] queries, rotated in place, last dim contiguous
    q_token_stride,  # elements between tokens of q ((H + 2*Hkv) * d for a split_qkv view)
    q_head_stride,  # elements between heads of q
    k_ptr,  # [T, Hkv, d] keys, rotated in place, last dim contiguous
    k_token_stride,  # elements between tokens of k
    k_head_stride,  # elements between heads of k
    cos_sin_ptr,  # [max_position, d] float32: cos in the first half of a row, sin in the second
    cos_sin_row_stride,  # elements between rows of cos_sin_cache
    num_heads,  # H
    num_kv_heads,  # Hkv
    HALF: tl.constexpr,  # d / 2
    BLOCK_HALF: tl.constexpr,  # next power of 2 >= d / 2
    BLOCK_HEADS: tl.constexpr,  # heads per program, a power of 2
):
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    offs_mask = offs < HALF
    row = cos_sin_ptr + position * cos_sin_row_stride
    cos = tl.load(row + offs, mask=offs_mask, other=0.0)[None, :]  # [1, BLOCK_HALF], float32
    sin = tl.load(row + HALF + offs, mask=offs_mask, other=0.0)[None, :]
    heads = head_block * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    # The same angles rotate q and k: one cos/sin gather serves both.
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, num_heads, heads, offs, offs_mask, cos, sin, HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, num_kv_heads, heads, offs, offs_mask, cos, sin, HALF)


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d] -> (q, k), rotated in place.

    q and k may be strided along tokens and heads; their last dimension must be contiguous.
    Checking that positions lie inside the cache costs one host sync (min/max of T ints).
    """
    check_dim(NAME, "positions", positions, 1)
    check_dim(NAME, "q", q, 3)
    check_dim(NAME, "k", k, 3)
    check_dim(NAME, "cos_sin_cache", cos_sin_cache, 2)
    check_dtype(NAME, "positions", positions, POSITION_DTYPES)
    check_dtype(NAME, "q", q, FLOAT_DTYPES)
    check_dtype(NAME, "k", k, FLOAT_DTYPES)
    check_dtype(NAME, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_last_dim_contiguous(NAME, "q", q)
    check_last_dim_contiguous(NAME, "k", k)
    check_contiguous(NAME, "cos_sin_cache", cos_sin_cache)
    check_same_device(NAME, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _ = k.shape
    max_position, rotary_dim = cos_sin_cache.shape
    if k.shape[0] != num_tokens or positions.shape[0] != num_tokens:
        raise KernelInputError(
            f"{NAME}: positions {list(positions.shape)}, q {list(q.shape)} and k {list(k.shape)} "
            "must have the same number of tokens"
        )
    if k.shape[2] != head_dim:
        raise KernelInputError(f"{NAME}: q has head_dim {head_dim} but k has {k.shape[2]}")
    if head_dim % 2 != 0:
        raise KernelInputError(f"{NAME}: head_dim {head_dim} is odd; rotate-half pairs need an even head_dim")
    if rotary_dim != head_dim:
        raise KernelInputError(
            f"{NAME}: cos_sin_cache rotary_dim {rotary_dim} != head_dim {head_dim}; "
            "partial rotary (rotating only part of each head) is not supported by this kernel"
        )
    if num_tokens == 0:
        return q, k
    lo, hi = torch.stack(list(torch.aminmax(positions))).tolist()  # one host sync for both bounds
    if lo < 0 or hi >= max_position:
        raise KernelInputError(
            f"{NAME}: positions must lie in [0, {max_position}) (rows of cos_sin_cache); got min {lo}, max {hi}"
        )
    positions = positions.contiguous()  # [T]

    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_heads, num_kv_heads)
    block_heads = min(triton.next_power_of_2(max_heads), max(1, MAX_TILE // block_half))
    grid = (num_tokens, triton.cdiv(max_heads, block_heads))  # one program per (token, block of heads)
    _rope_kernel[grid](
        positions_ptr=positions,
        q_ptr=q,
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        k_ptr=k,
        k_token_stride=k.stride(0),
        k_head_stride=k.stride(1),
        cos_sin_ptr=cos_sin_cache,
        cos_sin_row_stride=cos_sin_cache.stride(0),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_HEADS=block_heads,
        num_warps=4,
    )
    return q, k
