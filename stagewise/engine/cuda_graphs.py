"""Decode steps replayed from CUDA graphs: the GPU runs the whole forward pass from one launch.

Why. A decode step of SmolLM2 or Llama-3-8B at batch 1 is ~350 kernel launches
from Python. Each launch costs the host some microseconds (argument checks,
Triton's launcher, the CUDA driver) while the kernel itself may run for only a
few: the GPU waits for the host. A CUDA graph records the launches once — the
kernels, their grids and their pointer arguments — and `replay()` submits the
whole recording in one call. The host cost of a step drops from hundreds of
launches to a few copies and one replay.

What it demands. A graph replays *the same kernels on the same memory with the
same grids*. So:

- inputs live in **static buffers** (`input_ids`, `positions`, `slot_mapping`,
  `seq_lens`, `block_table`, ...) that every replay reads; a step copies its
  values into them first;
- the batch is **padded** to the captured size (1, 2, 4, 8, ...): padding rows
  write their K/V to a spare cache block nobody owns and attend to zero keys;
- grids are sized for the **worst case** the graph will meet: one query row per
  sequence, `max_model_len` keys (the kernels read the real lengths from
  `seq_lens` on the device and skip the rest);
- nothing in the captured forward may synchronise with the host or allocate by
  data-dependent sizes — the reason the launchers take host lengths from the
  scheduler instead of reading device tensors (see `runtime.debug_checks`);
- Triton's autotuner must have chosen every configuration before capture: each
  graph is captured after two eager warm-up passes of the same shape.

Only pure-decode steps (every scheduled request computes exactly one new token)
of at most `max_batch` requests replay a graph; prefill and mixed steps run
eagerly as before. Sampling stays outside the graph (its settings change every
step). On a CPU there is nothing to capture: the same static-buffer path runs
eagerly, which is how the tests check that padding and the buffers give the
eager step's tokens.
"""

import torch

from stagewise.kv.paged import PagedKVCache, PagedKVStep
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.runtime import to_device
from stagewise.stages.attention_metadata import AttentionMetadata


def graph_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes that get a graph: powers of two up to max_batch, and max_batch itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    """Captured decode forward passes, one per padded batch size, over shared static buffers."""

    def __init__(
        self,
        model: LlamaModel,
        cache: PagedKVCache,
        max_model_len: int,
        max_batch: int,
        capture: bool,
    ):
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.sizes = graph_sizes(max_batch)
        self.capture = (
            capture  # False on a CPU (and in tests): replay = the same forward, run eagerly
        )
        device, n = model.device, self.sizes[-1]
        self.meta = torch.zeros(
            5, n, dtype=torch.long, device=device
        )  # ids, positions, slots, seq_lens, rows
        self.seq_lens = torch.zeros(
            n, dtype=torch.int32, device=device
        )  # [n] the kernels' int32 copy
        self.block_table = torch.zeros(
            n, cache.max_blocks_per_req, dtype=torch.int32, device=device
        )
        self.cu_seqlens = torch.arange(
            n + 1, dtype=torch.int32, device=device
        )  # one query row per sequence
        self.last_token_index = torch.arange(n, dtype=torch.long, device=device)
        self.pad_slot = (
            cache.spare_slot
        )  # padding rows store their K/V here: a block no request owns
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [size, vocab] output buffer of each graph
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None  # why capture was given up, if it was

    def covers(self, num_seqs: int) -> bool:
        return self.failed is None and num_seqs <= self.sizes[-1]

    def _size_for(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def _inputs(self, size: int) -> tuple[ForwardBatch, PagedKVStep]:
        """The forward's inputs as views of the static buffers, with worst-case host lengths."""
        ids, positions, slots = self.meta[0, :size], self.meta[1, :size], self.meta[2, :size]
        cu_host = list(range(size + 1))
        batch = ForwardBatch(
            input_ids=ids,
            positions=positions,
            cu_seqlens_q=self.cu_seqlens[: size + 1],
            last_token_index=self.last_token_index[:size],
            cu_seqlens_q_host=cu_host,
            max_q_len=1,
        )
        metadata = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: size + 1],
            cu_seqlens_q_host=cu_host,
            max_q_len=1,
            seq_lens=self.seq_lens[:size],
            seq_lens_host=[self.max_model_len] * size,  # worst case: grids and split-K sized for it
            max_seq_len=self.max_model_len,
            block_table=self.block_table[:size],
            slot_mapping=slots,  # padding rows store into the spare block: every slot is valid
        )
        kv = PagedKVStep(cache=self.cache, metadata=metadata)
        return batch, kv

    def _fill(self, size: int, ids, positions, slots, seq_lens, rows) -> None:
        """Copy one step's host values into the static buffers (padding: spare slot, no keys)."""
        pad = size - len(ids)
        host = [
            list(ids) + [0] * pad,
            list(positions) + [0] * pad,
            list(slots) + [self.pad_slot] * pad,
            list(seq_lens) + [0] * pad,
            list(rows) + [rows[0]] * pad,
        ]
        self.meta[:, :size].copy_(to_device(host, torch.long, self.meta.device), non_blocking=True)
        self.seq_lens[:size].copy_(self.meta[3, :size])  # int64 -> int32, on the device
        torch.index_select(
            self.cache.block_table, 0, self.meta[4, :size], out=self.block_table[:size]
        )

    def _capture(self, size: int) -> None:
        batch, kv = self._inputs(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles and autotunes here, never during capture
                self.model.forward(batch, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[size] = self.model.forward(batch, kv)  # [size, vocab]
        self.graphs[size] = graph

    def run(self, ids, positions, slots, seq_lens, rows) -> torch.Tensor:
        """One decode step of len(ids) sequences -> logits [num_seqs, vocab], a static buffer."""
        num_seqs = len(ids)
        size = self._size_for(num_seqs)
        self._fill(size, ids, positions, slots, seq_lens, rows)
        if not self.capture:
            batch, kv = self._inputs(size)
            return self.model.forward(batch, kv)[:num_seqs]
        if size not in self.graphs:
            self._capture(
                size
            )  # the buffers already hold this step's values: the warm-up is harmless
        self.graphs[size].replay()
        return self.logits[size][:num_seqs]
