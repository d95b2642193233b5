"""The torch tier of the KV store: the reference's two `index_copy_` calls, nothing around them.

    k, v [T, Hkv, d] --slot_mapping [T]--> k_cache, v_cache [num_slots, Hkv, d]   (in place)

`kv_store.naive` casts before it writes: the slots to int64 on the cache's
device, k and v to the cache's dtype. In a decode step every one of those is
already so, and each `.to` that changes nothing still costs a PyTorch call:
with the mask check, six calls per layer for two that move data, 180 per
step of SmolLM2-135M's 30 layers. This tier asks first (a comparison of
Python attributes, no call into PyTorch) and casts only what differs. The
copies are the reference's, so the cache holds the same bits.
"""

import torch

from stagewise.stages.attention_metadata import AttentionMetadata


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """k, v [T, Hkv, d] -> k_cache, v_cache [num_slots, Hkv, d] at metadata.slot_mapping [T]."""
    slots = metadata.slot_mapping  # [T], -1 = skip
    if not metadata.all_slots_valid:  # drop the padding tokens, as the reference does
        keep = slots >= 0  # [T] bool
        slots, k, v = slots[keep], k[keep], v[keep]
    if slots.dtype != torch.long or slots.device != k_cache.device:
        slots = slots.to(k_cache.device, torch.long)  # [T_kept] int64 on the cache's device
    if k.dtype != k_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.index_copy_(0, slots, k)  # cache[slots[i]] = k[i]
    v_cache.index_copy_(0, slots, v)
