"""One rank's view of the tensor-parallel group: its slices and its (traced) collectives.

Two process groups, both from torch.distributed:

- the *data* group (`gloo` on CPU, `nccl` on CUDA) carries the activations:
  the all-reduces (2 per block plus 1 for the embedding) and the gather of
  the LM head's vocabulary slices. Its timeout is short (`timeout_s`): a rank
  that died or hangs makes the others' next collective fail, not wait forever.
- the *control* group (always `gloo`, on the CPU, as vLLM's "cpu group")
  carries rank 0's step messages (`parallel/messages.py`) and the traced
  records back. Workers wait on it between steps — possibly for as long as
  the user is idle — so its timeout is long; a dead rank 0 still ends the
  wait at once (its connections close).

Every collective is recorded by the active tracer (op, tensor shape, bytes,
wall time), next to the stages, with this process's rank.
"""

import time

import torch
import torch.distributed as dist

from stagewise.parallel.shard import ShardPlan
from stagewise.stages import embedding
from stagewise.trace.hooks import active_tracer


class TensorParallelGroup:
    """What `LlamaModel.forward` calls on a rank (the protocol of `models/parallel.py`)."""

    def __init__(self, plan: ShardPlan, backend: str, control_group):
        self.rank = plan.rank  # r
        self.world_size = plan.world_size  # N
        self.plan = plan  # the slices this rank holds
        self.backend = backend  # "gloo" or "nccl": the data group's backend
        self.control_group = control_group  # gloo group for step messages (long timeout)

    # ---- the three calls of the forward pass ----

    def embed(self, ops, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: ids [T], this rank's table [V/N, hidden] -> [T, hidden] on every rank."""
        local = ids - self.plan.vocab.start  # [T]: ids of this rank's slice become rows 0..V/N-1
        outside = (local < 0) | (local >= len(self.plan.vocab))  # [T] bool: ids another rank holds
        rows = ops(embedding, ids=local.masked_fill(outside, 0), weight=weight)  # [T] -> [T, hidden]
        rows = rows.masked_fill(outside.unsqueeze(1), 0.0)  # another rank's ids contribute zero rows
        return self.all_reduce(rows)  # the sum over ranks: each token's one real row

    def all_reduce(self, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """x [T, hidden] partial sums -> their sum over the N ranks, on every rank (in place)."""
        return self._traced("all_reduce", layer, x, x, lambda: dist.all_reduce(x))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """logits [B, V/N] per rank -> [B, V] on rank 0 (None elsewhere: only rank 0 samples)."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        self._traced("gather", None, logits, logits, lambda: dist.gather(logits, parts, dst=0))
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.plan.vocab_size]  # N x [B, V/N] -> [B, V] (padding cut)

    # ---- tracing ----

    def _traced(self, op: str, layer: int | None, tensor: torch.Tensor, result, run):
        tracer = active_tracer()
        if tracer is None:
            run()
            return result
        if tensor.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if tensor.is_cuda:
            torch.cuda.synchronize()
        dur_us = (time.perf_counter() - start) * 1e6
        tracer.record_collective(
            op, layer, self.backend, tensor, world_size=self.world_size, dur_s=dur_us / 1e6, rank=self.rank
        )
        return result
