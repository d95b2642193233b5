"""`NoKVCache`: mode "naive" keeps no K/V; attention runs over this batch's own keys.

The batch holds every token of every sequence, so queries and keys coincide: sequence b's
queries and keys are rows `cu_seqlens[b] : cu_seqlens[b+1]` of the same q, k, v
(`AttentionMetadata.over_batch`).
"""

import torch

from stagewise.kv.access import KVAccess
from stagewise.stages import attention
from stagewise.stages.attention_metadata import AttentionMetadata


class NoKVCache(KVAccess):
    """Naive recompute: the batch holds every token of every sequence; K/V are not kept."""

    def __init__(
        self,
        cu_seqlens: torch.Tensor,
        cu_seqlens_host: list[int] | None = None,
        max_len: int | None = None,
    ):
        """cu_seqlens [B+1] int32: the batch's offsets; cu_seqlens_host: the same as host ints
        (None: read back from the device once, here). `max_len` is kept for older callers: the
        metadata derives it from the host offsets."""
        self.metadata = AttentionMetadata.over_batch(cu_seqlens, cu_seqlens_host)

    @classmethod
    def of(cls, batch) -> "NoKVCache":
        """Attention over a `ForwardBatch` itself, with its host lengths (no device reads)."""
        return cls(batch.cu_seqlens_q, batch.cu_seqlens_q_host)

    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return ops(attention, layer=layer, q=q, k=k, v=v, metadata=self.metadata, scale=scale)
