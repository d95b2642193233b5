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
eagerly as before. On a CPU there is nothing to capture: the same static-buffer
path runs eagerly, which is how the tests check that padding and the buffers
give the eager step's tokens.

The host's work between two replays is kept small:

- **one upload** of the step's changing values (ids, positions, slots, lengths):
  the host writes them into one staging buffer, pinned when CUDA exists (a
  copy from pinned memory is a DMA the host need not wait for), and one copy
  moves all of it;
- **block-table rows only where they changed**: the graph's table keeps what
  each batch slot held last step, so a row is uploaded only when its request
  crossed into a new block or another request took the slot;
- **greedy batches sample inside the graph**: when every request of the step is
  greedy without a repetition penalty, the argmax is part of the recording and
  the step's one read is the token ids themselves. Other sampling settings
  change every step (temperatures, seeds, penalties' seen tokens) and run after
  the replay as in an eager step.

- **greedy ids read one step late** (`queue` / `read`): a greedy step's ids are
  copied into pinned host memory behind the replay, and the engine queues the
  next step before it waits for them; that step's input ids are copied on the
  device from this step's output (`ids_from`). The GPU runs step t + 1 while
  the host reads step t's ids, settles them and builds step t + 2.

`counts` records each upload, each greedy step and each read, and `timeline`
the order of the latest queues and reads, so a test can count them.
"""

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from stagewise.kv.paged import PagedKVCache, PagedKVStep
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.stages.attention_metadata import AttentionMetadata


def graph_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes that get a graph: powers of two up to max_batch, and max_batch itself."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


@dataclass
class QueuedIds:
    """A greedy step's sampled ids on their way to the host (`DecodeGraphs.queue`)."""

    step: int  # the graph runner's step number
    ids: torch.Tensor  # [num_seqs] on the device: the next step may take its input ids from here
    host: np.ndarray  # [num_seqs] view of a pinned host buffer the ids are copied into
    copied: torch.cuda.Event | None  # recorded after that copy (None on a CPU: already done)


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
        # False on a CPU (and in tests): replay = the same forward, run eagerly
        self.capture = capture
        device, n = model.device, self.sizes[-1]
        # [4, n]: ids, positions, slots, seq_lens; written into `staging`, then one upload
        self.meta = torch.zeros(4, n, dtype=torch.long, device=device)
        pinned = torch.cuda.is_available()  # page-locked host memory needs the CUDA driver
        self.staging = torch.zeros(4, n, dtype=torch.long, pin_memory=pinned)
        self.table_staging = torch.zeros(
            n, cache.max_blocks_per_req, dtype=torch.int32, pin_memory=pinned
        )
        self._staging_np, self._table_np = self.staging.numpy(), self.table_staging.numpy()
        self._uploaded = None  # CUDA event after the last step's copies (then staging is free)
        self._slot_blocks: list[tuple | None] = [None] * n  # each slot's table row on the device
        # [2, n]: greedy ids of two queued steps (step t's are read after step t + 1 is queued)
        self.host_ids = torch.zeros(2, n, dtype=torch.long, pin_memory=pinned)
        self._host_ids_np = self.host_ids.numpy()
        self.counts = {"steps": 0, "uploads": 0, "table_rows": 0, "greedy_in_graph": 0, "reads": 0}
        self.counts["dropped"] = 0  # tokens of a step read late, past its request's stop
        self.timeline: deque[tuple[str, int]] = deque(maxlen=64)  # ("queue" | "read", step)
        # [n] the kernels' int32 copy
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            n, cache.max_blocks_per_req, dtype=torch.int32, device=device
        )
        # one query row per sequence
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.last_token_index = torch.arange(n, dtype=torch.long, device=device)
        # padding rows store their K/V here: a block no request owns
        self.pad_slot = cache.spare_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [size, vocab] output buffer of each graph
        self.greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same, argmax included
        self.greedy_ids: dict[int, torch.Tensor] = {}  # [size] int64 output of each greedy graph
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

    def _fill(self, size: int, ids, positions, slots, seq_lens, blocks) -> None:
        """Copy one step's host values into the static buffers (padding: spare slot, no keys).

        One copy for the four per-token rows; one per block-table row whose blocks changed."""
        if self._uploaded is not None and not self._uploaded.query():  # query: no wait
            # the last step's copies out of staging have not run yet (a step queued one ahead of
            # the read: the GPU may still be on the step before): wait for them, not the forward
            self._uploaded.synchronize()
        num = len(ids)
        host = self._staging_np
        rows = ((0, ids, 0), (1, positions, 0), (2, slots, self.pad_slot), (3, seq_lens, 0))
        for r, values, fill in rows:
            host[r, :num] = values
            host[r, num:size] = fill
        # the whole buffer: contiguous on both sides, so a DMA from pinned memory with no host copy
        # (the columns past `size` are never read by the size-`size` graph)
        self.meta.copy_(self.staging, non_blocking=True)
        self.counts["uploads"] += 1
        for b, row in enumerate(blocks):  # padding slots keep any table row: they read no keys
            row = tuple(row)
            if self._slot_blocks[b] != row:
                self._table_np[b, : len(row)] = row
                self.block_table[b, : len(row)].copy_(
                    self.table_staging[b, : len(row)], non_blocking=True
                )
                self._slot_blocks[b] = row
                self.counts["uploads"] += 1
                self.counts["table_rows"] += 1
        self.seq_lens[:size].copy_(self.meta[3, :size])  # int64 -> int32, on the device
        if self.meta.is_cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def _capture(self, size: int, greedy: bool) -> None:
        batch, kv = self._inputs(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles and autotunes here, never during capture
                self.model.forward(batch, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.forward(batch, kv)  # [size, vocab]
            if greedy:
                self.greedy_ids[size] = logits.argmax(dim=-1)  # [size]: first index on ties
            else:
                self.logits[size] = logits
        (self.greedy_graphs if greedy else self.graphs)[size] = graph

    def run(
        self, ids, positions, slots, seq_lens, blocks, greedy: bool = False, ids_from=None
    ) -> torch.Tensor:
        """One decode step of len(ids) sequences (blocks[b]: sequence b's block ids) -> logits
        [num_seqs, vocab], or with `greedy` the argmax token ids [num_seqs]; a static buffer.

        `ids_from`: a [num_seqs] device tensor holding the input ids instead of `ids` (then
        placeholders): the previous step's output, copied on the device, never via the host."""
        num_seqs = len(ids)
        size = self._size_for(num_seqs)
        self._fill(size, ids, positions, slots, seq_lens, blocks)
        if ids_from is not None:
            self.meta[0, :num_seqs].copy_(ids_from)  # after the upload, before the forward
        self.counts["steps"] += 1
        self.counts["greedy_in_graph"] += int(greedy)
        if not self.capture:
            batch, kv = self._inputs(size)
            logits = self.model.forward(batch, kv)[:num_seqs]  # [num_seqs, vocab]
            return logits.argmax(dim=-1) if greedy else logits
        graphs = self.greedy_graphs if greedy else self.graphs
        if size not in graphs:
            # the buffers already hold this step's values: the warm-up is harmless
            self._capture(size, greedy)
        graphs[size].replay()
        return (self.greedy_ids if greedy else self.logits)[size][:num_seqs]

    def queue(self, ids, positions, slots, seq_lens, blocks, ids_from=None) -> QueuedIds:
        """Queue one greedy step (as `run`) and the copy of its ids to the host; wait for nothing.

        On a GPU the call returns while the step runs; `read` waits for its ids alone (the copy's
        event), not for anything queued after it, such as the next step."""
        ids_dev = self.run(ids, positions, slots, seq_lens, blocks, greedy=True, ids_from=ids_from)
        step = self.counts["steps"]
        host = self.host_ids[step % 2, : len(ids)]  # the other row may hold the step before's ids
        host.copy_(ids_dev, non_blocking=True)  # from pinned memory: a DMA behind the replay
        copied = None
        if ids_dev.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self.timeline.append(("queue", step))
        return QueuedIds(step, ids_dev, self._host_ids_np[step % 2, : len(ids)], copied)

    def read(self, queued: QueuedIds) -> list[int]:
        """The queued step's sampled ids on the host: the step's one device -> host wait."""
        if queued.copied is not None:
            queued.copied.synchronize()
        self.counts["reads"] += 1
        self.timeline.append(("read", queued.step))
        return queued.host.tolist()  # numpy: host memory, already copied
