"""What one forward pass computes: a flattened token batch and how its attention reads K/V.

`ForwardBatch` packs the tokens scheduled this step for every sequence end to
end — `[num_tokens]`, no padding — with each token's position in its own
sequence and the `cu_seqlens_q` offsets that say where each sequence starts.

`attend(...)` is the part that differs between engine modes: `NoKVCache`
(recompute everything, K/V only of this batch), the contiguous per-request
cache (`engine/contiguous_cache.py`) and the paged cache (`engine/paged_cache.py`).
Each stores the new K/V (or not) and runs the attention stage over what it holds.
"""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the tokens to run, all sequences concatenated
    positions: torch.Tensor  # [T] int64: each token's position within its own sequence
    cu_seqlens_q: torch.Tensor  # [B+1] int32: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    last_token_index: torch.Tensor  # [B] int64: the row whose logits predict each sequence's next token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1

    @staticmethod
    def from_sequences(seqs: list[list[int]], start_positions: list[int], device) -> "ForwardBatch":
        """Pack token lists; sequence b's tokens sit at positions start_positions[b], +1, ..."""
        lens = [len(s) for s in seqs]
        ids = [t for s in seqs for t in s]
        pos = [p0 + i for p0, n in zip(start_positions, lens) for i in range(n)]
        cu = torch.tensor([0] + lens).cumsum(0)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            cu_seqlens_q=cu.to(device=device, dtype=torch.int32),
            last_token_index=(cu[1:] - 1).to(device=device, dtype=torch.long),
        )


class KVAccess(Protocol):
    def attend(self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, d], new k/v [T, Hkv, d] -> attention output [T, H, d]."""
        ...


@dataclass
class NoKVCache:
    """Naive recompute: the batch holds every token of every sequence; K/V are not kept."""

    cu_seqlens: torch.Tensor  # [B+1] int32: the batch's cu_seqlens_q (queries and keys coincide)

    def attend(self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return ops(
            "attention",
            layer=layer,
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_k=self.cu_seqlens,
            scale=scale,
        )
