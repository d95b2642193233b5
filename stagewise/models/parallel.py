"""What the forward pass asks of tensor parallelism: three calls, each a no-op on one device.

Under tensor parallelism (`stagewise/parallel/`) every rank holds a slice of
every matrix, and the forward pass needs exactly three things from its group:

- `embed`: the vocabulary is split by rows, so a rank looks up only the ids
  it owns (the rest become zero rows) and an all-reduce sums the ranks' rows
  into every token's full embedding [T, hidden];
- `all_reduce`: after the row-parallel o_proj and down projections each rank
  holds a partial sum [T, hidden]; the all-reduce adds them up (2 per block);
- `gather_vocab`: each rank's LM head gives logits for its slice of the
  vocabulary [B, vocab/N]; rank 0 gathers them into [B, vocab] to sample.

`SingleDevice` is the one-device version: the lookup itself, the identity and
the identity. The model calls it unconditionally, so the TP=1 path runs the
same stages with no collective and no process.
"""

import torch

from stagewise.stages import embedding


class SingleDevice:
    """No tensor parallelism: every rank-related call is the plain computation."""

    rank = 0  # this process's rank
    world_size = 1  # ranks in the group

    def embed(self, ops, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return ops(embedding, ids=ids, weight=weight)  # [T] -> [T, hidden]

    def all_reduce(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        return x  # one rank holds the whole sum already

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return logits  # [B, vocab]: the whole vocabulary is here


SINGLE_DEVICE = SingleDevice()
