"""RoPE in place on q and k, rotate-half convention.

    positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d] float32
        -> q, k rotated in place (the same tensor objects are returned)

    per head, i in [0, d/2), cos, sin = cos_sin_cache[pos, i], cos_sin_cache[pos, d/2 + i]:

        (x_i, x_{i+d/2}) <- (x_i cos - x_{i+d/2} sin,  x_{i+d/2} cos + x_i sin)

Tiling: program (i, b) rotates tokens [i * BLOCK_T, (i + 1) * BLOCK_T): a
block of BLOCK_HQ heads of q and BLOCK_HK heads of k of each, as [BLOCK_T,
heads, d/2] tiles of first and second halves, in float32, stored back in the
tensors' dtype. Each token's cos/sin row is gathered once and broadcast over
its heads of q *and* k. q and k may be strided views of the fused QKV output
(token stride (H + 2*Hkv) * d, as `split_qkv` returns them): nothing is copied.

Memory-bound: ~3 FLOPs per element against 2 * bytes (read, write back), so a
program issues its q and k loads first (they do not depend on the position),
then the position and cos/sin, and stores last (row_tiles.py's rules; the
measurements: benchmarks/README.md, "Kernel notes"). In place, q and k are
read and written once, where the naive version materialises the halves.

RoPE is not autotuned: each trial run would first have to restore q and k.
Partial rotary (rotary_dim < head_dim) is not supported: the launcher says so.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from stagewise.kernels.plan_cache import cdiv, plan_cache
from stagewise.kernels.row_tiles import TileConfig, tokens_per_program, warps_for
from stagewise.kernels.targets import checked_target
from stagewise.runtime import debug_checks

NAME = "rope"
POSITION_DTYPES = (torch.int32, torch.int64)
# elements of one token's q half-tile [BLOCK_HQ, d/2]: beyond it, heads split over programs
MAX_TILE = 2048
# elements of a program's half-tiles of q and k together, [BLOCK_T, BLOCK_HQ + BLOCK_HK, d/2]
TOKEN_TILE = 4096


@triton.jit
def _load_halves(
    x_ptr,  # q or k: [T, heads, d], last dim contiguous
    rows,  # [BLOCK_T] int64 token indices of this program
    token_ok,  # [BLOCK_T] token < T
    token_stride,  # elements between tokens of x
    head_stride,  # elements between heads of x (d for split_qkv views)
    heads,  # [BLOCK_H] head indices handled by this program
    num_heads,  # heads in x (H or Hkv): rows of the tile beyond it are masked off
    offs,  # [BLOCK_HALF] feature index i within the first half
    HALF: tl.constexpr,  # d / 2: distance between the two features of a pair
):
    """-> (pointers to x_i, mask, x_i, x_{i+d/2}): [BLOCK_T, BLOCK_H, BLOCK_HALF] tiles, values in
    float32."""
    first = (
        x_ptr
        + rows[:, None, None] * token_stride
        + heads[None, :, None] * head_stride
        + offs[None, None, :]
    )
    mask = (
        token_ok[:, None, None] & (heads < num_heads)[None, :, None] & (offs < HALF)[None, None, :]
    )
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    return first, mask, x1, x2


@triton.jit
def _rotate_store(
    first,  # [BLOCK_T, BLOCK_H, BLOCK_HALF] pointers to x_i
    mask,  # [BLOCK_T, BLOCK_H, BLOCK_HALF]
    x1,  # x_i, float32
    x2,  # x_{i + d/2}, float32
    cos,  # [BLOCK_T, 1, BLOCK_HALF] float32
    sin,  # [BLOCK_T, 1, BLOCK_HALF] float32
    HALF: tl.constexpr,  # d / 2
):
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    tl.store(first, out1.to(first.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(first.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])  # one compiled variant for every T
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
    num_tokens,  # T: rows of the last token tile beyond it are masked off
    num_heads,  # H
    num_kv_heads,  # Hkv
    HALF: tl.constexpr,  # d / 2
    BLOCK_HALF: tl.constexpr,  # next power of 2 >= d / 2
    BLOCK_HQ: tl.constexpr,  # q heads per program, a power of 2
    BLOCK_HK: tl.constexpr,  # k heads per program, a power of 2
    BLOCK_T: tl.constexpr,  # tokens per program, a power of 2
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    token_ok = tokens < num_tokens
    rows = tokens.to(tl.int64)  # int64: T * token_stride may pass 2^31
    offs = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    q_heads = tl.program_id(1) * BLOCK_HQ + tl.arange(0, BLOCK_HQ)  # [BLOCK_HQ]
    k_heads = tl.program_id(1) * BLOCK_HK + tl.arange(0, BLOCK_HK)  # [BLOCK_HK]
    # 1. q and k: every data load goes out first; none depends on the position.
    q_first, q_mask, q1, q2 = _load_halves(
        q_ptr, rows, token_ok, q_token_stride, q_head_stride, q_heads, num_heads, offs, HALF
    )
    k_first, k_mask, k1, k2 = _load_halves(
        k_ptr, rows, token_ok, k_token_stride, k_head_stride, k_heads, num_kv_heads, offs, HALF
    )
    # 2. The angles: one cos/sin row per token, shared by all its heads of q and k.
    position = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)  # [BLOCK_T]
    # [BLOCK_T, BLOCK_HALF]
    angle = cos_sin_ptr + position[:, None] * cos_sin_row_stride + offs[None, :]
    angle_mask = token_ok[:, None] & (offs < HALF)[None, :]
    # [BLOCK_T, 1, BLOCK_HALF], float32
    cos = tl.load(angle, mask=angle_mask, other=0.0)[:, None, :]
    sin = tl.load(angle + HALF, mask=angle_mask, other=0.0)[:, None, :]
    # 3. Rotate and store.
    _rotate_store(q_first, q_mask, q1, q2, cos, sin, HALF)
    _rotate_store(k_first, k_mask, k1, k2, cos, sin, HALF)


def rope_tiles(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[dict, TileConfig]:
    """-> (head tiling constexprs, token tile): a fixed choice, on a GPU too (RoPE is in place: not
    autotuned).

    q heads: all of them when [H, d/2] fits MAX_TILE, else blocks (a second grid axis); k heads
    spread over the same number of blocks. Tokens: BLOCK_T so a program's half-tiles hold about
    TOKEN_TILE elements.
    """
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_hq = min(triton.next_power_of_2(num_heads), max(1, MAX_TILE // block_half))
    head_blocks = triton.cdiv(num_heads, block_hq)
    # head_blocks * block_hk >= Hkv
    block_hk = triton.next_power_of_2(triton.cdiv(num_kv_heads, head_blocks))
    per_token = (block_hq + block_hk) * block_half  # elements of one token's half-tiles of q and k
    block_t = tokens_per_program(num_tokens, per_token, TOKEN_TILE)
    heads = {"HALF": half, "BLOCK_HALF": block_half, "BLOCK_HQ": block_hq, "BLOCK_HK": block_hk}
    return heads, TileConfig(block_t, warps_for(block_t * per_token))


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d] -> (q, k), rotated
    in place.

    q and k may be strided along tokens and heads; their last dimension must be contiguous.
    Never reads positions on the host: the grid comes from shapes, so the launch queues without
    waiting for the GPU (no host-bound step, capturable in a CUDA graph). That positions lie
    inside the cache is checked only with debug checks on (`stagewise.runtime.debug_checks`).
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
        raise KernelInputError(
            f"{NAME}: head_dim {head_dim} is odd; rotate-half pairs need an even head_dim"
        )
    if rotary_dim != head_dim:
        raise KernelInputError(
            f"{NAME}: cos_sin_cache rotary_dim {rotary_dim} != head_dim {head_dim}; "
            "partial rotary (rotating only part of each head) is not supported by this kernel"
        )
    if num_tokens == 0:
        return q, k
    if debug_checks():  # a value check reads positions on the host: a sync, so only on request
        lo, hi = torch.stack(list(torch.aminmax(positions))).tolist()
        if lo < 0 or hi >= max_position:
            raise KernelInputError(
                f"{NAME}: positions must lie in [0, {max_position}) (rows of cos_sin_cache); "
                f"got min {lo}, max {hi}"
            )
    positions = positions.contiguous()  # [T]
    checked_target(NAME, q)  # the pre-Ampere policy (targets.py)

    grid, options = rope_launch(num_tokens, num_heads, num_kv_heads, head_dim)
    _rope_kernel[grid](  # grid: (token tile, head block)
        positions_ptr=positions,
        q_ptr=q,
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        k_ptr=k,
        k_token_stride=k.stride(0),
        k_head_stride=k.stride(1),
        cos_sin_ptr=cos_sin_cache,
        cos_sin_row_stride=cos_sin_cache.stride(0),
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        **options,
    )
    return q, k


@plan_cache
def rope_launch(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple, dict]:
    """(grid, launch kwargs) from `rope_tiles`, kept per shape: SmolLM2's decode token (9 + 3
    heads of 64) is one program, grid (1, 1): [1, 16 + 4, 32] half-tiles of q and k."""
    heads, tile = rope_tiles(num_tokens, num_heads, num_kv_heads, head_dim)
    grid = (cdiv(num_tokens, tile.block_t), cdiv(num_heads, heads["BLOCK_HQ"]))
    return grid, {**heads, **tile.meta(), "num_warps": tile.num_warps}
