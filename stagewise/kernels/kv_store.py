"""KV store: scatter each new token's K and V into its cache slot.

    k, v [T, Hkv, d], slot_mapping [T] -> k_cache, v_cache [num_slots, Hkv, d]   (in place)

    k_cache[slot_mapping[t]] = k[t];  v_cache[slot_mapping[t]] = v[t];  slot -1: skip token t

Tiling: program (i, b) stores tokens [i * BLOCK_T, (i + 1) * BLOCK_T) and a
block of BLOCK_HEADS heads of each, one [BLOCK_T, BLOCK_HEADS, d] tile of k
and one of v, to `cache + slot * Hkv * d`, cast to the cache's dtype; a -1
slot (padding) is masked off at the store. A paged cache [num_blocks,
block_size, Hkv, d] arrives viewed as [num_slots, Hkv, d] (slot = block_id *
block_size + offset), a contiguous cache as [rows * capacity, Hkv, d]: the
kernel cannot tell them apart, the point of slot addressing. k and v may be
strided views of the fused QKV output, never copied first.

A copy, 0 FLOPs: one launch stores K and V, and the data loads do not wait for
the slot (it only says where to write); on a GPU BLOCK_T and num_warps are
autotuned (row_tiles.py; measurements: benchmarks/README.md, "Kernel notes").
Out-of-range slots would overwrite other memory; checking them is a host sync,
so the launcher does it only with debug checks on (`STAGEWISE_DEBUG_CHECKS=1`).
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
    check_last_dim_contiguous,
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

NAME = "kv_store"
SLOT_DTYPES = (torch.int32, torch.int64)
# elements of one token's [BLOCK_HEADS, BLOCK_D] tile: beyond it, heads split over programs
MAX_TILE = 4096
# elements of one tensor's [BLOCK_T, BLOCK_HEADS, BLOCK_D] tile (interpreter; GPU: around it)
TOKEN_TILE = 4096


@triton.jit(do_not_specialize=["num_tokens", "tokens_bucket"])  # one compiled variant for every T
def _kv_store_kernel(
    k_ptr,  # [T, Hkv, d] new keys, last dim contiguous
    k_token_stride,  # elements between tokens of k
    k_head_stride,  # elements between heads of k
    v_ptr,  # [T, Hkv, d] new values, last dim contiguous
    v_token_stride,  # elements between tokens of v
    v_head_stride,  # elements between heads of v
    k_cache_ptr,  # [num_slots, Hkv, d] key cache, contiguous (slot stride = Hkv * d)
    v_cache_ptr,  # [num_slots, Hkv, d] value cache, contiguous
    slot_mapping_ptr,  # [T] int32/int64: destination slot of each token, -1 = skip
    num_tokens,  # T: rows of the last token tile beyond it are masked off
    num_kv_heads,  # Hkv
    tokens_bucket,  # next power of 2 >= T: only the GPU autotuner's key, unused here
    HEAD_DIM: tl.constexpr,  # d
    BLOCK_D: tl.constexpr,  # next power of 2 >= d
    BLOCK_HEADS: tl.constexpr,  # heads per program, a power of 2
    BLOCK_T: tl.constexpr,  # tokens per program, a power of 2
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    token_ok = tokens < num_tokens
    mask = (
        token_ok[:, None, None]
        & (heads < num_kv_heads)[None, :, None]
        & (dims < HEAD_DIM)[None, None, :]
    )
    rows = tokens.to(tl.int64)[:, None, None]  # int64: T * token_stride may pass 2^31

    # Issue all three loads before waiting on any: K, V and the slots are independent.
    k_src = (
        k_ptr + rows * k_token_stride + heads[None, :, None] * k_head_stride + dims[None, None, :]
    )
    k = tl.load(k_src, mask=mask, other=0.0)  # [BLOCK_T, BLOCK_HEADS, BLOCK_D]
    v_src = (
        v_ptr + rows * v_token_stride + heads[None, :, None] * v_head_stride + dims[None, None, :]
    )
    v = tl.load(v_src, mask=mask, other=0.0)
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)  # [BLOCK_T]

    keep = mask & (slots >= 0)[:, None, None]  # -1: padding, not stored
    # [1, BLOCK_HEADS, BLOCK_D]: offset inside a slot
    within = heads[None, :, None] * HEAD_DIM + dims[None, None, :]
    # [BLOCK_T, BLOCK_HEADS, BLOCK_D]
    dst = slots[:, None, None] * (num_kv_heads * HEAD_DIM) + within
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=keep)


def kv_store_tiles(
    num_tokens: int, num_kv_heads: int, head_dim: int, interpreter: bool = INTERPRETER
) -> tuple[dict, tuple[TileConfig, ...]]:
    """-> (head tiling constexprs, token tile candidates): one candidate under the interpreter, a
    few on a GPU.

    Head tile: all of a token's heads when Hkv * d fits MAX_TILE, else blocks of heads (a second
    grid axis). Token tile: BLOCK_T tokens so that one tensor's tile is about TOKEN_TILE elements (2
    x 8 KB for bf16).
    """
    block_d = triton.next_power_of_2(head_dim)
    block_heads = min(triton.next_power_of_2(num_kv_heads), max(1, MAX_TILE // block_d))
    per_token = block_heads * block_d
    block_t = tokens_per_program(num_tokens, per_token, TOKEN_TILE)
    best = TileConfig(block_t, warps_for(block_t * per_token))
    heads = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_HEADS": block_heads}
    return heads, ((best,) if interpreter else gpu_candidates(best))


@plan_cache
def kv_store_launch(
    num_tokens: int, num_kv_heads: int, head_dim: int
) -> tuple[dict, tuple[TileConfig, ...], int]:
    """`kv_store_tiles` and the number of head blocks, kept per shape: SmolLM2 (3 KV heads of 64)
    stores a token's 3 x 64 in one head block."""
    heads, candidates = kv_store_tiles(num_tokens, num_kv_heads, head_dim)
    return heads, candidates, cdiv(num_kv_heads, heads["BLOCK_HEADS"])


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [T, Hkv, d] (strided along tokens allowed); caches [num_slots, Hkv, d] contiguous;
    slot_mapping [T].

    Never reads slot_mapping on the host: the grid comes from shapes, so the launch queues without
    waiting for the GPU (no host-bound step, capturable in a CUDA graph). That slots lie in the
    cache is checked only with debug checks on (`stagewise.runtime.debug_checks`).
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dim(NAME, name, t, 3)
        check_dtype(NAME, name, t, FLOAT_DTYPES)
    check_dim(NAME, "slot_mapping", slot_mapping, 1)
    check_dtype(NAME, "slot_mapping", slot_mapping, SLOT_DTYPES)
    check_last_dim_contiguous(NAME, "k", k)
    check_last_dim_contiguous(NAME, "v", v)
    check_contiguous(NAME, "k_cache", k_cache)
    check_contiguous(NAME, "v_cache", v_cache)
    check_same_device(NAME, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or slot_mapping.shape[0] != num_tokens:
        raise KernelInputError(
            f"{NAME}: k {list(k.shape)}, v {list(v.shape)} and "
            f"slot_mapping {list(slot_mapping.shape)} "
            "must agree: k and v [T, Hkv, d], slot_mapping [T]"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise KernelInputError(
            f"{NAME}: k_cache {list(k_cache.shape)} {k_cache.dtype} and "
            f"v_cache {list(v_cache.shape)} "
            f"{v_cache.dtype} must have the same shape and dtype"
        )
    num_slots = k_cache.shape[0]
    if tuple(k_cache.shape[1:]) != (num_kv_heads, head_dim):
        raise KernelInputError(
            f"{NAME}: cache slots are [{k_cache.shape[1]}, {k_cache.shape[2]}] but k/v tokens are "
            f"[{num_kv_heads}, {head_dim}] (Hkv, d); they must match"
        )
    if num_tokens == 0 or num_kv_heads == 0 or head_dim == 0:
        return
    if debug_checks():  # a value check reads slot_mapping on the host: a sync, so only on request
        lo, hi = torch.stack(list(torch.aminmax(slot_mapping))).tolist()
        if lo < -1 or hi >= num_slots:
            raise KernelInputError(
                f"{NAME}: slot_mapping must lie in [0, {num_slots}) (cache slots) or be -1 (skip); "
                f"got min {lo}, max {hi}"
            )
    slot_mapping = slot_mapping.contiguous()  # [T]
    checked_target(NAME, k_cache)  # the pre-Ampere policy (targets.py)

    heads, candidates, num_head_blocks = kv_store_launch(num_tokens, num_kv_heads, head_dim)
    launch(
        _kv_store_kernel,
        candidates,
        key=("tokens_bucket", "num_kv_heads", "HEAD_DIM"),
        grid=lambda meta: (cdiv(num_tokens, meta["BLOCK_T"]), num_head_blocks),  # (tokens, heads)
        k_ptr=k,
        k_token_stride=k.stride(0),
        k_head_stride=k.stride(1),
        v_ptr=v,
        v_token_stride=v.stride(0),
        v_head_stride=v.stride(1),
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        num_tokens=num_tokens,
        num_kv_heads=num_kv_heads,
        tokens_bucket=token_bucket(num_tokens),
        **heads,
    )
