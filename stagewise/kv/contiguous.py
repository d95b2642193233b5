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
class ContiguousKVStep:
    """How one step's tokens store and read K/V in a `ContiguousKVCache`."""

    cache: ContiguousKVCache
    slot_mapping: (
        torch.Tensor
    )  # [T] int64: where each new token's K/V go (-1 = padding, not stored)
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query rows of each sequence
    cu_seqlens_k: torch.Tensor  # [B+1] int32: first cache slot of each sequence's keys
    seqused_k: torch.Tensor  # [B] int32: keys each sequence reads (its length, this step included)
    # the same values as host ints and flags, so no stage or launcher reads a device tensor back:
    cu_seqlens_q_host: list[int]  # [B+1]
    cu_seqlens_k_host: list[int]  # [B+1]
    seqused_k_host: list[int]  # [B]
    max_q_len: int  # the most query rows of one sequence (sizes the attention grid)
    all_slots_valid: bool  # no token is padding (no slot is -1)

    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [rows * capacity, Hkv, d]
        ops(
            "kv_store",
            layer=layer,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            slot_mapping=self.slot_mapping,
            all_slots_valid=self.all_slots_valid,
        )
        return ops(
            "attention",
            layer=layer,
            q=q,
            k=k_cache,
            v=v_cache,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            scale=scale,
            seqused_k=self.seqused_k,
            max_q_len=self.max_q_len,
            cu_seqlens_q_host=self.cu_seqlens_q_host,
            cu_seqlens_k_host=self.cu_seqlens_k_host,
            seqused_k_host=self.seqused_k_host,
        )
