"""RoPE and the KV store in one kernel: rotate q in place, rotate k on its way into the cache.

    positions [T], q [T, H, d], k, v [T, Hkv, d], cos_sin_cache [max_position, d] float32,
    slot_mapping [T]  ->  q rotated in place;  k_cache[slot] = rope(k),  v_cache[slot] = v

Run separately (kernels/rope.py, then kernels/kv_store.py), k makes a round
trip: the rope kernel reads it, rotates it and writes it back into the QKV
buffer, the store kernel reads it again and writes it to the cache. In the
paged mode nothing else ever reads k from the buffer (attention reads keys
from the cache), so here the rotated k goes straight to its slot: per token
and layer one launch fewer, and Hkv * d elements fewer written and read
(Llama-3-8B, 8 x 128 bf16: 2 x 2 KB per token per layer). **k in the buffer is
left unrotated**: callers that read it afterwards must use the separate kernels.

Tiling is kernels/rope.py's (`rope_tiles`): program (i, b) takes tokens
[i * BLOCK_T, (i + 1) * BLOCK_T) and a block of BLOCK_HQ q heads and BLOCK_HK
k/v heads of them. Every data load (q, k and v halves) is issued first, then
the positions and slots, then cos/sin (row_tiles.py's rules). Rotation in
float32, stored in the destination's dtype. A slot of -1 (padding) stores no
K/V, but the token's q is still rotated, as the two separate stages would.
Partial rotary (rotary_dim < head_dim) is refused, as by the rope kernel.
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
from stagewise.kernels.rope import _load_halves, _rotate_store, rope_tiles
from stagewise.kernels.targets import checked_target
from stagewise.runtime import debug_checks

NAME = "rope_kv_store"
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit(do_not_specialize=["num_tokens"])  # one compiled variant for every T
def _rope_kv_store_kernel(
    positions_ptr,  # [T] int32/int64: position of each token
    slot_mapping_ptr,  # [T] int32/int64: cache slot of each token, -1 = do not store
    q_ptr,  # [T, H, d] queries, rotated in place, last dim contiguous
    q_token_stride,  # elements between tokens of q
    q_head_stride,  # elements between heads of q
    k_ptr,  # [T, Hkv, d] new keys (read only), last dim contiguous
    k_token_stride,  # elements between tokens of k
    k_head_stride,  # elements between heads of k
    v_ptr,  # [T, Hkv, d] new values (read only), last dim contiguous
    v_token_stride,  # elements between tokens of v
    v_head_stride,  # elements between heads of v
    k_cache_ptr,  # [num_slots, Hkv, d] key cache, contiguous
    v_cache_ptr,  # [num_slots, Hkv, d] value cache, contiguous
    cos_sin_ptr,  # [max_position, d] float32: cos in the first half of a row, sin in the second
    cos_sin_row_stride,  # elements between rows of cos_sin_cache
    num_tokens,  # T
    num_heads,  # H
    num_kv_heads,  # Hkv
    HALF: tl.constexpr,  # d / 2
    BLOCK_HALF: tl.constexpr,  # next power of 2 >= d / 2
    BLOCK_HQ: tl.constexpr,  # q heads per program
    BLOCK_HK: tl.constexpr,  # k/v heads per program
    BLOCK_T: tl.constexpr,  # tokens per program
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    token_ok = tokens < num_tokens
    rows = tokens.to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF]
    q_heads = tl.program_id(1) * BLOCK_HQ + tl.arange(0, BLOCK_HQ)  # [BLOCK_HQ]
    k_heads = tl.program_id(1) * BLOCK_HK + tl.arange(0, BLOCK_HK)  # [BLOCK_HK]
    # 1. Every data load first: q, k and v halves, [BLOCK_T, heads, BLOCK_HALF] each.
    q_first, q_mask, q1, q2 = _load_halves(
        q_ptr, rows, token_ok, q_token_stride, q_head_stride, q_heads, num_heads, offs, HALF
    )
    _, kv_mask, k1, k2 = _load_halves(
        k_ptr, rows, token_ok, k_token_stride, k_head_stride, k_heads, num_kv_heads, offs, HALF
    )
    _, _, v1, v2 = _load_halves(
        v_ptr, rows, token_ok, v_token_stride, v_head_stride, k_heads, num_kv_heads, offs, HALF
    )
    # 2. The indices: each token's position (its angles) and slot (where K/V go).
    position = tl.load(positions_ptr + tokens, mask=token_ok, other=0).to(tl.int64)  # [BLOCK_T]
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)  # [BLOCK_T]
    angle = cos_sin_ptr + position[:, None] * cos_sin_row_stride + offs[None, :]
    angle_mask = token_ok[:, None] & (offs < HALF)[None, :]
    cos = tl.load(angle, mask=angle_mask, other=0.0)[:, None, :]  # [BLOCK_T, 1, BLOCK_HALF]
    sin = tl.load(angle + HALF, mask=angle_mask, other=0.0)[:, None, :]
    # 3. q back in place; rotated k and plain v into the token's slot (-1: not stored).
    _rotate_store(q_first, q_mask, q1, q2, cos, sin, HALF)
    keep = kv_mask & (slots >= 0)[:, None, None]
    dst = (
        slots[:, None, None] * (num_kv_heads * 2 * HALF)
        + k_heads[None, :, None] * (2 * HALF)
        + offs[None, None, :]
    )  # [BLOCK_T, BLOCK_HK, BLOCK_HALF]: feature i of each head in each slot
    dtype = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + dst, (k1 * cos - k2 * sin).to(dtype), mask=keep)
    tl.store(k_cache_ptr + dst + HALF, (k2 * cos + k1 * sin).to(dtype), mask=keep)
    tl.store(v_cache_ptr + dst, v1.to(dtype), mask=keep)
    tl.store(v_cache_ptr + dst + HALF, v2.to(dtype), mask=keep)


def rope_kv_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, d] rotated in place and returned; rope(k) and v stored at slot_mapping [T] into
    k_cache, v_cache [num_slots, Hkv, d]. k itself is not modified.

    q, k, v may be strided along tokens and heads (split_qkv's views). Never reads positions or
    slots on the host (they are range-checked only with debug checks on).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dim(NAME, name, t, 3)
        check_dtype(NAME, name, t, FLOAT_DTYPES)
        check_last_dim_contiguous(NAME, name, t)
    check_dim(NAME, "positions", positions, 1)
    check_dim(NAME, "slot_mapping", slot_mapping, 1)
    check_dim(NAME, "cos_sin_cache", cos_sin_cache, 2)
    check_dtype(NAME, "positions", positions, INDEX_DTYPES)
    check_dtype(NAME, "slot_mapping", slot_mapping, INDEX_DTYPES)
    check_dtype(NAME, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_contiguous(NAME, "cos_sin_cache", cos_sin_cache)
    check_contiguous(NAME, "k_cache", k_cache)
    check_contiguous(NAME, "v_cache", v_cache)
    check_same_device(NAME, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, positions=positions,
                      slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache)  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _ = k.shape
    max_position, rotary_dim = cos_sin_cache.shape
    if v.shape != k.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise KernelInputError(
            f"{NAME}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be [T, H, d], "
            "[T, Hkv, d], [T, Hkv, d]"
        )
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise KernelInputError(
            f"{NAME}: positions {list(positions.shape)} and slot_mapping "
            f"{list(slot_mapping.shape)} must have one entry per token ({num_tokens})"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise KernelInputError(
            f"{NAME}: k_cache {list(k_cache.shape)} {k_cache.dtype} and v_cache "
            f"{list(v_cache.shape)} {v_cache.dtype} must have the same shape and dtype"
        )
    if tuple(k_cache.shape[1:]) != (num_kv_heads, head_dim):
        raise KernelInputError(
            f"{NAME}: cache slots are {list(k_cache.shape[1:])} but k/v tokens are "
            f"[{num_kv_heads}, {head_dim}] (Hkv, d); they must match"
        )
    if head_dim % 2 != 0 or rotary_dim != head_dim:
        raise KernelInputError(
            f"{NAME}: head_dim {head_dim} must be even and equal cos_sin_cache's rotary_dim "
            f"{rotary_dim} (partial rotary is not supported)"
        )
    if num_tokens == 0:
        return q
    if debug_checks():  # reads positions and slots on the host: a sync, so only on request
        lo, hi = torch.stack(list(torch.aminmax(positions))).tolist()
        s_lo, s_hi = torch.stack(list(torch.aminmax(slot_mapping))).tolist()
        if lo < 0 or hi >= max_position or s_lo < -1 or s_hi >= k_cache.shape[0]:
            raise KernelInputError(
                f"{NAME}: positions span [{lo}, {hi}] (cache rows: {max_position}), slots "
                f"[{s_lo}, {s_hi}] (cache slots: {k_cache.shape[0]}, -1 = skip)"
            )
    checked_target(NAME, q)
    grid, options = rope_kv_store_launch(num_tokens, num_heads, num_kv_heads, head_dim)
    _rope_kv_store_kernel[grid](  # grid: (token tile, head block)
        positions_ptr=positions.contiguous(),
        slot_mapping_ptr=slot_mapping.contiguous(),
        q_ptr=q,
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        k_ptr=k,
        k_token_stride=k.stride(0),
        k_head_stride=k.stride(1),
        v_ptr=v,
        v_token_stride=v.stride(0),
        v_head_stride=v.stride(1),
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        cos_sin_ptr=cos_sin_cache,
        cos_sin_row_stride=cos_sin_cache.stride(0),
        num_tokens=num_tokens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        **options,
    )
    return q


@plan_cache
def rope_kv_store_launch(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple, dict]:
    """(grid, launch kwargs): rope's tiling (`rope_tiles`; v rides with k's heads). The tile holds
    q, k and v halves, so it asks for ~1.5x rope's registers: still a fixed, small tile."""
    heads, tile = rope_tiles(num_tokens, num_heads, num_kv_heads, head_dim)
    grid = (cdiv(num_tokens, tile.block_t), cdiv(num_heads, heads["BLOCK_HQ"]))
    return grid, {**heads, **tile.meta(), "num_warps": tile.num_warps}
