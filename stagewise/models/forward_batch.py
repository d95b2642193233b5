"""What one forward pass computes: a flattened token batch and how its attention reads K/V.

`ForwardBatch` packs the tokens scheduled this step for every sequence end to
end — `[num_tokens]`, no padding — with each token's position in its own
sequence and the `cu_seqlens_q` offsets that say where each sequence starts.
The scheduler knows every length as a Python int, so the batch carries them on
the host too (`cu_seqlens_q_host`, `max_q_len`): launchers size their grids
from those and never read a device tensor back (on a GPU such a read waits for
every queued kernel — a host-bound step that no CUDA graph could capture).

How attention reads K/V is the `kv` argument of the forward pass (`kv/access.py`):
`NoKVCache` (recompute everything, K/V only of this batch, `kv/none.py`), the
contiguous per-request cache (`kv/contiguous.py`) and the paged cache
(`kv/paged.py`).
"""

import itertools
from dataclasses import dataclass

import torch

from stagewise.runtime import to_device


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the tokens to run, all sequences concatenated
    positions: torch.Tensor  # [T] int64: each token's position within its own sequence
    # [B+1] int32: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    cu_seqlens_q: torch.Tensor
    # [B] int64: the row whose logits predict each sequence's next token
    last_token_index: torch.Tensor
    # [B+1] the same offsets as host ints: kernels size grids without a device read
    cu_seqlens_q_host: list[int]
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
