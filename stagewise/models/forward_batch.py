"""What one forward pass computes: a flattened token batch and how its attention reads K/V.

`ForwardBatch` packs the tokens scheduled this step for every sequence end to
end — `[num_tokens]`, no padding — with each token's position in its own
sequence and the `cu_seqlens_q` offsets that say where each sequence starts.
The scheduler knows every length as a Python int, so the batch carries them on
the host too (`cu_seqlens_q_host`, `max_q_len`): launchers size their grids
from those and never read a device tensor back (on a GPU such a read waits for
every queued kernel — a host-bound step that no CUDA graph could capture).

`attend(...)` is the part that differs between engine modes: `NoKVCache`
(recompute everything, K/V only of this batch), the contiguous per-request
cache (`engine/contiguous_cache.py`) and the paged cache (`engine/paged_cache.py`).
Each stores the new K/V (or not) and runs the attention stage over what it holds.
"""

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from stagewise.runtime import to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the tokens to run, all sequences concatenated
    positions: torch.Tensor  # [T] int64: each token's position within its own sequence
    cu_seqlens_q: (
        torch.Tensor
    )  # [B+1] int32: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    last_token_index: (
        torch.Tensor
    )  # [B] int64: the row whose logits predict each sequence's next token
    cu_seqlens_q_host: list[
        int
    ]  # [B+1] the same offsets as host ints: kernels size grids without a device read
    max_q_len: int  # the most rows any one sequence has this step (host int)

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
        cu = list(itertools.accumulate(lens, initial=0))  # [B+1]
        return ForwardBatch(
            input_ids=to_device(ids, torch.long, device),
            positions=to_device(pos, torch.long, device),
            cu_seqlens_q=to_device(cu, torch.int32, device),
            last_token_index=to_device([c - 1 for c in cu[1:]], torch.long, device),
            cu_seqlens_q_host=cu,
            max_q_len=max(lens, default=0),
        )


class KVAccess(Protocol):
    def attend(
        self, ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, H, d], new k/v [T, Hkv, d] -> attention output [T, H, d]."""
        ...


@dataclass
class NoKVCache:
    """Naive recompute: the batch holds every token of every sequence; K/V are not kept."""

    cu_seqlens: torch.Tensor  # [B+1] int32: the batch's cu_seqlens_q (queries and keys coincide)
    cu_seqlens_host: list[int] | None = (
        None  # [B+1] the same on the host (None: the stages read the tensor)
    )
    max_len: int | None = None  # the longest sequence (host int; None: the kernel reads the tensor)

    @classmethod
    def of(cls, batch: ForwardBatch) -> "NoKVCache":
        """Attention over the batch itself, with its host lengths (no device reads)."""
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
