"""The paged engine with CUDA graphs: decode steps replayed, greedy ids read one step late.

`GraphRunner` is the plain `PagedRunner` (engine/paged_runner.py) with two
changes to its step, both for a GPU whose host would otherwise wait:

- a pure-decode step (one new token per request, each sampling, at most
  `max_num_seqs` requests) replays a captured graph (`DecodeGraphs`,
  engine/cuda_graphs.py) instead of the eager forward pass; when every request
  is greedy without a repetition penalty, the argmax runs inside the graph
  too. Prefill, mixed and speculative steps with guesses run the plain step;
- reading one step late (`EngineConfig.defer_graph_reads`, on by default). A
  greedy graphed step t is queued, and its ids are not read at once: when
  `schedule_ahead` finds the next step certain (same requests, no arrival, no
  length stop at t, blocks free), step t + 1 is queued first, its input ids
  copied on the device from step t's argmax, and only then does the host wait
  for step t's ids, settle them, and return. The GPU computes step t + 1
  meanwhile. An end-of-sequence id or a stop string at step t ends its request
  when read: its step t + 1 token is dropped, and that step's K/V write (the
  true K/V of its last token, into a block it no longer owns, queued before
  anything can reuse the block) harms nobody. Every other step (prefill,
  arrivals, preemption, speculation, sampling outside the graph, a tracer)
  reads at once, as the plain step does.

On a CPU nothing is captured: the same padded static-buffer path runs eagerly,
with the GPU's bookkeeping, which is how the tests check it.
"""

from stagewise.config import EngineConfig
from stagewise.engine.cuda_graphs import DecodeGraphs, QueuedIds
from stagewise.engine.interrupts import deferred_interrupts
from stagewise.engine.paged_runner import PagedRunner
from stagewise.engine.sampler import plain_greedy, read_token_ids
from stagewise.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from stagewise.errors import StagewiseError
from stagewise.models.llama import LlamaModel
from stagewise.trace.hooks import active_tracer


class GraphRunner(PagedRunner):
    spare_block = True  # padding rows of a graphed batch store their K/V there

    def __init__(
        self,
        model: LlamaModel,
        stop_ids: frozenset[int],
        max_model_len: int,
        ecfg: EngineConfig,
        proposer=None,
        num_speculative_tokens: int = 0,
    ):
        if model.ops.backends["paged_attention"] != "triton":
            raise StagewiseError(
                "cuda_graphs needs the triton paged_attention stage: the PyTorch tiers size their "
                "loops from host lengths, which a captured graph would freeze at their first values"
            )
        super().__init__(model, stop_ids, max_model_len, ecfg, proposer, num_speculative_tokens)
        self.graphs = None  # captured decode steps (engine/cuda_graphs.py); None: shape only
        if model.device.type != "meta":
            capture = model.device.type == "cuda"  # a CPU runs the same padded path eagerly
            self.graphs = DecodeGraphs(model, self.cache, max_model_len, ecfg.max_num_seqs, capture)
        self.defer_reads = self.graphs is not None and ecfg.defer_graph_reads
        self._behind: tuple[SchedulerOutput, QueuedIds] | None = None  # queued, its ids unread

    # ---- the plain step's parts, with graphs ----

    def _schedule(self) -> SchedulerOutput:
        if self._behind is not None:  # queued by the call before, its ids unread: settled now
            return self._behind[0]
        return super()._schedule()

    def _compute(self, sched: SchedulerOutput) -> list[list[int]]:
        if self._behind is None:
            if not self._replays_graph(sched):
                return super()._compute(sched)  # prefill, mixed, speculative, traced: eager
            requests = [s.request for s in sched.scheduled]
            if self.proposer is not None or not plain_greedy(requests):
                return self._sample(sched, self._graph_step(sched))  # logits [requests, vocab]
            if not self.defer_reads or self.suspects:  # the argmax ran inside the graph
                return [[t] for t in read_token_ids(self._graph_step(sched, greedy=True))]
            self._behind = (sched, self._graph_queue(sched))  # read in _catch_up, just below
        return self._catch_up()

    def _settle(self, sched: SchedulerOutput, tokens: list[list[int]]) -> list[tuple]:
        """The plain settle, less the requests that stopped (or were aborted) at the step before:
        a step read late ran one token past their end, which is dropped. Then the step queued
        ahead names its blocks, whose tokens are known now."""
        sampling = [s for s in sched.scheduled if s.samples]
        if any(s.request.finished for s in sched.scheduled):
            dropped = sum(s.request.finished for s in sampling)
            self.graphs.counts["dropped"] += dropped
            self.stats.tokens_computed += dropped  # their rows ran all the same
            tokens = [t for s, t in zip(sampling, tokens) if not s.request.finished]
            live = [s for s in sched.scheduled if not s.request.finished]
            sched = SchedulerOutput(live, sched.preempted, sched.admitted)
        results = super()._settle(sched, tokens)
        if self._behind is not None:
            name_ahead(self.scheduler, self._behind[0])
            if all(s.request.finished for s in self._behind[0].scheduled):
                self._behind = None  # every request stopped here: its tokens are all dropped
        return results

    def undo_step(self) -> None:
        super().undo_step()
        self._behind = None  # its requests recompute; nobody reads its ids

    def repair(self) -> None:
        super().repair()
        if self._behind is not None and all(s.request.finished for s in self._behind[0].scheduled):
            self._behind = None  # its requests were aborted: nobody reads its ids

    # ---- graphs ----

    def _replays_graph(self, sched: SchedulerOutput) -> bool:
        """A pure-decode step (one new token per request, each sampling) that a graph covers."""
        if self.graphs is None or active_tracer() is not None:  # a tracer sees every stage run
            return False
        decode = all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled)
        return decode and self.graphs.covers(len(sched.scheduled))

    def _catch_up(self) -> list[list[int]]:
        """Step t is queued, its ids unread: queue step t + 1 first when nothing read from step t
        could change it (its input ids: step t's output, on the device); then read step t."""
        sched, queued = self._behind
        ahead = None
        if self._replays_graph(sched) and not self.suspects:
            with deferred_interrupts():
                ahead = schedule_ahead(self.scheduler, sched, self.max_model_len)
            if ahead is not None:
                self.stats.blocks_in_use.append(self.block_manager.num_used_blocks)
        ahead_queued = self._graph_queue(ahead, ids_from=queued.ids) if ahead is not None else None
        tokens = self.graphs.read(queued)  # waits for step t only, not for the step ahead
        self._behind = (ahead, ahead_queued) if ahead is not None else None
        return [[t] for t in tokens]

    def _graph_queue(self, sched: SchedulerOutput, ids_from=None) -> QueuedIds:
        """Queue a greedy graphed step; with `ids_from` (the step before's ids, on the device) it
        is scheduled ahead: each request's new token is the unread one, at position num_tokens."""
        return self.graphs.queue(*self._graph_inputs(sched, ahead=ids_from is not None), ids_from)

    def _graph_step(self, sched: SchedulerOutput, greedy: bool = False):
        """The step's inputs as host lists, copied into the graphs' static buffers; one replay.

        -> logits [num requests, vocab], or with `greedy` the argmax ids [num requests]. The block
        lists go to the graphs' own table, which uploads only the rows that changed."""
        return self.graphs.run(*self._graph_inputs(sched), greedy=greedy)

    def _graph_inputs(self, sched: SchedulerOutput, ahead: bool = False) -> tuple[list, ...]:
        bs = self.cache.block_size
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for s in sched.scheduled:
            req = s.request
            pos = req.num_tokens if ahead else req.num_computed_tokens  # the new token's position
            blocks = self.block_manager.block_ids(req.request_id)
            ids.append(0 if ahead else req.all_token_ids[pos])  # ahead: taken on the device
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            tables.append(blocks)
        return ids, positions, slots, seq_lens, tables


# ---- scheduling one step ahead ----


def schedule_ahead(
    scheduler: Scheduler, prev: SchedulerOutput, max_model_len: int
) -> SchedulerOutput | None:
    """The next decode step of `prev`'s requests, scheduled before `prev`'s tokens are read;
    None when `scheduler.schedule()` after reading them could schedule anything else.

    Only when nothing else could change that step: no waiting request, no guesses, no request
    ending by length at the token being read (max_tokens and max_model_len are known on the
    host), and free blocks for every request. Each request's new token sits at position
    `num_tokens` (its token from `prev`, still on the device). Its block is allocated now; its
    name in the prefix cache waits for the token (`name_ahead`)."""
    reqs = [s.request for s in prev.scheduled]
    waiting, running = scheduler.waiting, scheduler.running
    if waiting or reqs != running or len(reqs) > scheduler.max_num_batched_tokens:
        return None  # an arrival or a preempted request would join: the batch changes
    if any(s.num_new_tokens != 1 or not s.samples or s.num_spec_tokens for s in prev.scheduled):
        return None
    for req in reqs:  # the token being read ends it by length: nothing runs after it
        if len(req.output_token_ids) + 1 >= req.params.max_tokens:
            return None
        if req.num_tokens + 1 >= max_model_len:
            return None
    bm = scheduler.block_manager
    need = sum(bm.blocks_needed(r.num_tokens + 1) - len(bm.block_ids(r.request_id)) for r in reqs)
    if need > bm.num_free_blocks:
        return None  # schedule() would preempt: let it, after the read
    bm.begin_step()
    out = SchedulerOutput()
    for req in reqs:
        if not bm.allocate(req.request_id, req.num_tokens, 1):
            raise RuntimeError(f"{req.request_id}: a counted free block was missing")
        out.scheduled.append(ScheduledRequest(req, 1, 0, True))
    return out


def name_ahead(scheduler: Scheduler, ahead: SchedulerOutput) -> None:
    """After the tokens behind are appended: name the blocks the step ahead fills."""
    for s in ahead.scheduled:
        req = s.request
        if not req.finished:
            scheduler.block_manager.register_full_blocks(
                req.request_id, req.all_token_ids, req.num_tokens
            )
