"""A contiguous KV cache: each request of a static batch owns one fixed-size region.

    k, v: [num_layers, num_rows * capacity, Hkv, d]
    row b owns slots [b * capacity, (b + 1) * capacity); token t of row b is slot b * capacity + t

Capacity is reserved up front for the longest possible sequence of the batch,
whether or not a request uses it: the waste paged attention removes. Reads
need no gather: the attention stage reads row b's keys starting at
`cu_seqlens_k[b]`, `seqused_k[b]` of them.
"""

from dataclasses import dataclass

import torch

from stagewise.kv.access import KVAccess
from stagewise.stages import attention, kv_store
from stagewise.stages.attention_metadata import AttentionMetadata


class ContiguousKVCache:
    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        device,
    ):
        shape = (num_layers, num_rows * capacity, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows * capacity, Hkv, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity  # slots per row
        self.num_rows = num_rows

    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class ContiguousKVStep(KVAccess):
    """How one step's tokens store and read K/V in a `ContiguousKVCache`.

    `metadata` (built once per step by the runner) holds the contiguous layout: sequence b's keys
    are slots `cu_seqlens_k[b] : cu_seqlens_k[b] + seq_lens[b]`, its new tokens go to
    `slot_mapping` (-1 for the padding rows of a static batch).
    """

    cache: ContiguousKVCache  # the batch's cache (None in a tensor-parallel step message)
    metadata: AttentionMetadata  # the step's lengths, key offsets and slots

    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [rows * capacity, Hkv, d]
        ops(
            kv_store,
            layer=layer,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            metadata=self.metadata,
        )
        return ops(
            attention, layer=layer, q=q, k=k_cache, v=v_cache, metadata=self.metadata, scale=scale
        )  # [T, H, d]
