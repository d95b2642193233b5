"""KV store — write each new token's K and V into its cache slot.

    k, v [T, Hkv, d] --slot_mapping [T]--> k_cache, v_cache [num_slots, Hkv, d]   (in place)

The cache is addressed by *slot*: one slot holds one token's K (or V) for all
KV heads of one layer. A paged cache [num_blocks, block_size, Hkv, d] is the
same memory seen as [num_blocks * block_size, Hkv, d], with
`slot = block_id * block_size + offset_in_block`; a contiguous per-request
cache uses `slot = request_row * capacity + position`. Slot -1 means "do not
store" (e.g. padding), and is skipped.

The Triton kernel (`kernels/kv_store.py`) runs one program per tile of tokens:
it loads their K and V rows (read straight from the strided views of the fused
QKV output) together with their slots, and stores each token whose slot is not
-1 into that slot, casting to the cache dtype at the store. One launch, one read and one
write per element, instead of the reference's mask, compaction and two
`index_copy_` calls.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.stages.base import Stage


def naive(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    all_slots_valid: bool | None = None,
) -> None:
    """k, v [T, Hkv, d]; k_cache, v_cache [num_slots, Hkv, d]; slot_mapping [T] (-1 = skip).

    `all_slots_valid`: the caller knows no slot is -1 (a host bool); else the mask is read (a host sync).
    """
    if all_slots_valid is None:
        all_slots_valid = bool((slot_mapping >= 0).all())  # reads the slots back: a host sync
    if not all_slots_valid:  # drop the padding tokens
        keep = slot_mapping >= 0  # [T] bool
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    slots = slot_mapping.long().to(k_cache.device)  # [T_kept]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))  # cache[slots[i]] = k[i]
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def optimized(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    all_slots_valid: bool | None = None,
) -> None:
    """Triton scatter: one program per token copies its K and V into cache[slot] (slot -1: skipped).

    The kernel skips -1 slots itself, so `all_slots_valid` is not needed here.
    """
    from stagewise.kernels.kv_store import (
        kv_store,
    )  # lazily: importing kernels picks GPU or interpreter

    kv_store(k, v, k_cache, v_cache, slot_mapping)  # writes k_cache, v_cache in place


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    num_slots = 4 * num_tokens + 16
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[num_tokens // 2] = -1  # one padding token that must not be written
    shape = (num_tokens, config.num_kv_heads, config.head_dim)
    return {
        "k": torch.randn(shape, generator=gen).to(device, dtype),
        "v": torch.randn(shape, generator=gen).to(device, dtype),
        "k_cache": torch.zeros(
            num_slots, config.num_kv_heads, config.head_dim, device=device, dtype=dtype
        ),
        "v_cache": torch.zeros(
            num_slots, config.num_kv_heads, config.head_dim, device=device, dtype=dtype
        ),
        "slot_mapping": slots.to(device),
    }


STAGE = Stage(
    name="kv_store",
    summary="scatter the new tokens' K and V into their cache slots (slot -1 = skip)",
    shapes="k, v [T, Hkv, d] -> cache [num_slots, Hkv, d] (in place)",
    naive=naive,
    triton=optimized,
    triton_kind="triton: slot scatter, a tile of tokens per program",
    example_inputs=example_inputs,
    outputs=(),
    axes={
        "k": "num_tokens kv_heads head_dim",
        "v": "num_tokens kv_heads head_dim",
        "k_cache": "num_slots kv_heads head_dim",
        "v_cache": "num_slots kv_heads head_dim",
        "slot_mapping": "num_tokens",
    },
)
