"""`NoKVCache`: mode "naive" keeps no K/V; attention runs over this batch's own keys.

The batch holds every token of every sequence, so queries and keys coincide: sequence b's
queries and keys are rows `cu_seqlens[b] : cu_seqlens[b+1]` of the same q, k, v.
"""

from dataclasses import dataclass

import torch


@dataclass
class NoKVCache:
    """Naive recompute: the batch holds every token of every sequence; K/V are not kept."""

    cu_seqlens: torch.Tensor  # [B+1] int32: the batch's cu_seqlens_q (queries and keys coincide)
    # [B+1] the same on the host (None: the stages read the tensor)
    cu_seqlens_host: list[int] | None = None
    max_len: int | None = None  # the longest sequence (host int; None: the kernel reads the tensor)

    @classmethod
    def of(cls, batch) -> "NoKVCache":
        """Attention over a `ForwardBatch` itself, with its host lengths (no device reads)."""
        return cls(batch.cu_seqlens_q, batch.cu_seqlens_q_host, batch.max_q_len)

    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return ops(
            "attention",
            layer=layer,
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_k=self.cu_seqlens,
            scale=scale,
            max_q_len=self.max_len,
            cu_seqlens_q_host=self.cu_seqlens_host,
            cu_seqlens_k_host=self.cu_seqlens_host,
        )
