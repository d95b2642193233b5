"""KV store — write each new token's K and V into its cache slot.

    k, v [T, Hkv, d] --slot_mapping [T]--> k_cache, v_cache [num_slots, Hkv, d]   (in place)

The cache is addressed by *slot*: one slot holds one token's K (or V) for all
KV heads of one layer. A paged cache [num_blocks, block_size, Hkv, d] is the
same memory seen as [num_blocks * block_size, Hkv, d], with
`slot = block_id * block_size + offset_in_block`; a contiguous per-request
cache uses `slot = request_row * capacity + position`. Slot -1 means "do not
store" (e.g. padding), and is skipped. The slots come with the step's
`AttentionMetadata` (`slot_mapping`, and `all_slots_valid`, a host flag that
spares the reference a read of the mask when no token is padding).

The Triton kernel (`kernels/kv_store.py`) runs one program per tile of tokens:
it loads their K and V rows (read straight from the strided views of the fused
QKV output) together with their slots, and stores each token whose slot is not
-1 into that slot, casting to the cache dtype at the store. One launch, one read and
one write per element, instead of the reference's mask, compaction and two
`index_copy_` calls.

The torch tier (`stages/kv_store_torch.py`) is the reference's two copies
without the casts that change nothing (fewer PyTorch calls per layer).
"""

import torch

from stagewise.config import ModelConfig
from stagewise.stages import kv_store_torch
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.base import Stage


def naive(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """k, v [T, Hkv, d] -> k_cache, v_cache [num_slots, Hkv, d] at metadata.slot_mapping [T]."""
    slot_mapping = metadata.slot_mapping  # [T] int64, -1 = skip
    if not metadata.all_slots_valid:  # drop the padding tokens
        keep = slot_mapping >= 0  # [T] bool
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    slots = slot_mapping.long().to(k_cache.device)  # [T_kept]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))  # cache[slots[i]] = k[i]
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Triton scatter: one program per tile of tokens copies K and V into cache[slot].

    The kernel skips -1 slots itself, so `all_slots_valid` is not needed here.
    """
    # lazily: importing kernels picks GPU or interpreter
    from stagewise.kernels.kv_store import kv_store

    kv_store(k, v, k_cache, v_cache, metadata.slot_mapping)  # writes k_cache, v_cache in place


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    """One sequence of `num_tokens` new tokens at shuffled slots, one of them padding (-1)."""
    gen = torch.Generator().manual_seed(0)
    num_slots = 4 * num_tokens + 16
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[num_tokens // 2] = -1  # one padding token that must not be written
    shape = (num_tokens, config.num_kv_heads, config.head_dim)
    cache_shape = (num_slots, config.num_kv_heads, config.head_dim)
    metadata = AttentionMetadata.build(
        [num_tokens], [num_tokens], device, slot_mapping=slots.tolist()
    )
    return {
        "k": torch.randn(shape, generator=gen).to(device, dtype),
        "v": torch.randn(shape, generator=gen).to(device, dtype),
        "k_cache": torch.zeros(cache_shape, device=device, dtype=dtype),
        "v_cache": torch.zeros(cache_shape, device=device, dtype=dtype),
        "metadata": metadata,
    }


STAGE = Stage(
    name="kv_store",
    summary="scatter the new tokens' K and V into their cache slots (slot -1 = skip)",
    shapes="k, v [T, Hkv, d] -> cache [num_slots, Hkv, d] (in place)",
    naive=naive,
    triton=triton,
    triton_kind="triton: slot scatter, a tile of tokens per program",
    torch=kv_store_torch.kv_store,
    torch_kind="torch: the reference's two index_copy_ calls, casts only where dtypes differ",
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
