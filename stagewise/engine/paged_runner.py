"""Mode "paged": continuous batching over the paged KV cache (the seeds' vLLM engine).

One `step()`:

1. the scheduler picks requests and a token count for each (running first,
   then waiting; chunked prefill, preemption, prefix-cache hits);
2. the runner flattens every scheduled token into one batch —
   `input_ids [T]`, `positions [T]`, `slot_mapping [T]`, `cu_seqlens_q [B+1]`,
   `seq_lens [B]`, the requests' `block_table` rows — prefill chunks and
   decode tokens side by side, no padding;
3. one forward pass; each request whose tokens are all computed samples one
   token; finished requests leave and free their blocks at once, so a waiting
   request can join in the very next step.

Speculative decoding (`proposer`, engine/speculative/): before scheduling,
each decoding request may get k guesses; it then runs 1 + k query tokens, the
LM head runs on all of them, and the rejection sampler keeps the guesses the
target agrees with plus one token of its own (`speculative/verify.py`). The
kept tokens are appended one by one (a stop string, a stop id or max_tokens
cuts the run exactly there), then the request rewinds: `num_computed_tokens`
goes back to its new end, the blocks past it (rejected guesses' K/V only) are
freed, and only now are the newly full blocks named for the prefix cache.
Speculative steps run eagerly (a captured CUDA graph covers plain decode
steps of one token per request only).

Reading one step late (`defer_graph_reads`, with CUDA graphs). A greedy
graphed step t is queued, and its ids are not read at once: when
`Scheduler.schedule_ahead` finds the next step certain (same requests, no
arrival, no length stop at t, blocks free), step t + 1 is queued first, its
input ids copied on the device from step t's argmax, and only then does the
host wait for step t's ids, settle them, and return. The GPU computes step
t + 1 meanwhile. An end-of-sequence id or a stop string at step t ends its
request when read: its step t + 1 token is dropped, and that step's K/V write
(the true K/V of its last token, into a block it no longer owns, queued
before anything can reuse the block) harms nobody. Every other step (prefill,
arrivals, preemption, speculation, sampling outside the graph, a tracer)
reads at once, as before.

What goes wrong in a step stays in that step:

- an interrupt (Ctrl-C) in the forward pass undoes the step: every running
  request goes back to waiting and is recomputed (always correct). The
  bookkeeping around it (scheduling, finishing, aborting) runs with SIGINT
  deferred (`engine/interrupts.py`), and `repair()` at the start of the next
  step finishes whatever an interrupt still cut short;
- an exception in the step is pinned on the request that caused it: the
  step's requests run again one at a time (`Scheduler.schedule_alone`), the
  one that fails alone is removed with finish reason "error" (a result with
  no token), and the others continue with exactly the tokens they would have
  had. A failure while finishing one request's token blames that request at once.
"""

import sys
import time
from collections import deque
from collections.abc import Callable, Iterator

from stagewise.config import EngineConfig
from stagewise.engine.cuda_graphs import DecodeGraphs
from stagewise.engine.interrupts import deferred_interrupts
from stagewise.engine.paged_batch import build_batch, trace_step
from stagewise.engine.request import Request
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampler import plain_greedy, read_token_ids, sample_next_tokens
from stagewise.engine.scheduler import Scheduler, SchedulerOutput
from stagewise.engine.snapshot import engine_snapshot
from stagewise.engine.speculative.verify import verify
from stagewise.engine.tracing import end_step, note_verified
from stagewise.errors import StagewiseError
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep, num_blocks_for_budget
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.trace.hooks import active_tracer


class PagedRunner:
    def __init__(
        self,
        model: LlamaModel,
        stop_ids: frozenset[int],
        max_model_len: int,
        ecfg: EngineConfig,
        proposer=None,
        num_speculative_tokens: int = 0,
    ):
        cfg = model.config
        self.model = model
        self.proposer = proposer  # speculative decoding's guesser (engine/speculative/); None: off
        self.num_speculative_tokens = num_speculative_tokens  # k: the most guesses per request
        self.stop_ids = stop_ids  # eos and the other end-of-sequence ids
        self.max_model_len = max_model_len
        num_blocks = num_blocks_for_budget(cfg, ecfg, max_model_len, model.dtype, model.device)
        self.cache = PagedKVCache(
            cfg,
            num_blocks,
            ecfg.block_size,
            ecfg.max_num_seqs,
            max_model_len,
            model.dtype,
            model.device,
            model.batch_device,
            spare_block=ecfg.cuda_graphs,
        )
        self.graphs = None  # captured decode steps (engine/cuda_graphs.py), when asked for
        if ecfg.cuda_graphs and model.ops.backends["paged_attention"] != "triton":
            raise StagewiseError(
                "cuda_graphs needs the triton paged_attention stage: the PyTorch tiers size their "
                "loops from host lengths, which a captured graph would freeze at their first values"
            )
        if ecfg.cuda_graphs and model.device.type != "meta":
            capture = model.device.type == "cuda"  # a CPU runs the same padded path eagerly
            self.graphs = DecodeGraphs(model, self.cache, max_model_len, ecfg.max_num_seqs, capture)
        self.block_manager = BlockManager(num_blocks, ecfg.block_size, ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            ecfg.max_num_seqs,
            ecfg.max_num_batched_tokens,
            ecfg.prefill_cap(model.device.type),
        )
        self.suspects: deque[Request] = deque()  # requests of a failed step, each to run alone
        self.defer_reads = self.graphs is not None and ecfg.defer_graph_reads
        self._behind = None  # (SchedulerOutput, QueuedIds): a greedy step queued, its ids unread
        self._open_step: SchedulerOutput | None = None  # a step begun and not yet settled
        self.reset_stats()

    # ---- requests ----

    def check_fits(self, req: Request) -> None:
        """Reject a request that could never run, instead of letting it wait forever."""
        need = self.block_manager.blocks_needed(req.num_prompt_tokens + req.params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise StagewiseError(
                f"{req.request_id} needs {need} KV blocks for prompt + max_tokens, but the cache "
                f"has {self.block_manager.num_blocks}; raise the KV budget or lower max_tokens"
            )

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.scheduler.add(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, req: Request) -> None:
        """Drop a request before it finishes (its stream was closed); its blocks free at once."""
        with deferred_interrupts():
            self.scheduler.abort(req)
            self.cache.release_row(req.request_id)
            self._drop_proposals(req)

    def undo_step(self) -> None:
        """After a step that raised: running requests go back to waiting and will be recomputed."""
        for req in self.scheduler.recover_interrupted_step():
            self.cache.release_row(req.request_id)
            self._drop_proposals(req)
        self._open_step = None
        self._behind = None  # its requests recompute; nobody reads its ids

    def repair(self) -> None:
        """Finish what an interrupt cut short: a step left open is undone, and block-table rows
        and KV blocks that no running request owns go back to their free lists."""
        if self._open_step is not None:
            self.undo_step()
        if self._behind is not None and all(s.request.finished for s in self._behind[0].scheduled):
            self._behind = None  # its requests were aborted: nobody reads its ids
        live = {r.request_id for r in self.scheduler.running}
        for request_id in [r for r in self.cache.row_of if r not in live]:
            self.cache.release_row(request_id)
        for request_id in [r for r in self.block_manager.req_blocks if r not in live]:
            self.block_manager.free(request_id)
        self.cache.reclaim_lost_rows()

    def run(self, requests: list[Request]) -> Iterator[tuple[Request, int, str]]:
        """Run `requests` (and anything already queued) to completion; fresh stats for this run."""
        for req in requests:
            self.check_fits(req)
        self.reset_stats()
        for req in requests:
            self.scheduler.add(req)
        while self.has_unfinished():
            yield from self.step()

    _freed_after_last_step = 0  # blocks released by requests that finished in the previous step
    last_step: SchedulerOutput | None = None  # the latest settled step (None after a failed one)
    _block_moves = (0, 0)  # (allocated, freed) while scheduling the current step

    def reset_stats(self) -> None:
        self.stats = RunStats(kv_cache_bytes=self.cache.num_bytes())
        self._prefix_base = (
            self.block_manager.stats.queried_tokens,
            self.block_manager.stats.hit_tokens,
        )
        self._preempt_base = self.scheduler.num_preemptions

    # ---- one iteration ----

    def step(self, deliver: Callable[[list], None] | None = None) -> list[tuple]:
        """One iteration -> (request, token id, new text) per sampled token, and
        (request, None, "") per request removed because the step failed for it.

        `deliver(results)`, when given, runs before SIGINT is let through again: an interrupt
        cannot fall between the engine settling a token and its owner receiving it.
        """
        with deferred_interrupts():
            self.repair()
            sched = self._behind[0] if self._behind is not None else self._schedule()
            self._open_step = sched
        try:
            if self._behind is None:
                tokens = self._compute(sched)  # a greedy graphed step may only queue: _behind
            if self._behind is not None:  # its ids are read now, after the next step is queued
                tokens = self._catch_up()
        except Exception as exc:  # a request's failure (or the batch's): find whose, go on
            with deferred_interrupts():
                results = self._step_failed(sched, exc)
                if deliver is not None:
                    deliver(results)
            return results
        except BaseException:  # Ctrl-C, SystemExit: nothing half-done survives
            with deferred_interrupts():
                self.undo_step()
            raise
        with deferred_interrupts():
            results = self._settle(sched, tokens)
            if deliver is not None:
                deliver(results)
        return results

    def _schedule(self) -> SchedulerOutput:
        while self.suspects and self.suspects[0].finished:  # aborted while under suspicion
            self.suspects.popleft()
        bm = self.block_manager
        before = (bm.num_allocated, bm.num_freed)
        if self.suspects:
            sched = self.scheduler.schedule_alone(self.suspects[0])
        else:
            self._propose()
            sched = self.scheduler.schedule()
        self._block_moves = (bm.num_allocated - before[0], bm.num_freed - before[1])  # scheduling
        self.stats.blocks_in_use.append(bm.num_used_blocks)  # what this step runs with
        if not sched.scheduled:
            raise RuntimeError("scheduler made no progress")  # cannot happen: each request fits
        now = time.perf_counter()
        for s in sched.scheduled:
            s.request.first_scheduled_time = s.request.first_scheduled_time or now
        return sched

    def _compute(self, sched: SchedulerOutput) -> list[list[int]]:
        """The forward pass and the sampling: the part of a step that Ctrl-C may cut short.

        -> the tokens of each sampling request: one, or with speculation 1 .. k + 1."""
        if self._replays_graph(sched):
            requests = [s.request for s in sched.scheduled]
            if self.proposer is None and plain_greedy(requests):  # the argmax ran inside the graph
                if self.defer_reads and not self.suspects:
                    self._behind = (sched, self._graph_queue(sched))  # read in _catch_up
                    return []
                return [[t] for t in read_token_ids(self._graph_step(sched, greedy=True))]
            logits = self._graph_step(sched)  # [num requests, vocab]
        else:
            batch, kv = self._build_batch(sched)
            self._trace_begin(sched, batch, kv)
            logits = self.model.forward(batch, kv)  # [sampling rows (1 + k per request), vocab]
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return []
        if self.proposer is not None:  # every draw of a speculating engine: the same stream
            return verify(self.model.ops, logits, sampling)
        return [[t] for t in sample_next_tokens(self.model.ops, logits, sampling)]

    def _settle(self, sched: SchedulerOutput, tokens: list[list[int]]) -> list[tuple]:
        """Record the sampled tokens; finished requests leave and free their blocks."""
        for s in sched.scheduled:
            if not s.request.finished:  # finished: a step read late ran one token past its end
                s.request.num_computed_tokens += s.num_new_tokens
        sampling = [s for s in sched.scheduled if s.samples]
        results, verified = [], {}
        freed_before = self.block_manager.num_freed
        for s, kept in zip(sampling, tokens):
            req = s.request
            if req.finished:  # stopped (or aborted) at the step before: this token is dropped
                if self.graphs is not None:
                    self.graphs.counts["dropped"] += 1
                continue
            try:
                for token in kept:  # one by one: a stop or max_tokens cuts the run exactly there
                    delta = req.append_token(token, self.stop_ids, self.max_model_len)
                    results.append((req, token, delta))
                    if req.finish_reason is not None:
                        break
            except Exception as exc:  # detokenizing this request's token failed: its own fault
                results.append(self._remove_failed(req, exc))
                continue
            if self.proposer is not None:
                if s.num_spec_tokens:
                    verified[req.request_id] = {"accepted": len(kept) - 1, "kept_token_ids": kept}
                self._verified(s, accepted=len(kept) - 1)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                self.cache.release_row(req.request_id)
                self._drop_proposals(req)
            if self.suspects and self.suspects[0] is req:  # it ran alone and sampled: not guilty
                self.suspects.popleft()
        for req in sched.preempted:
            self.cache.release_row(req.request_id)
            self._drop_proposals(req)
        note_verified(verified)
        if self._behind is not None:  # the step queued ahead: its blocks' tokens are known now
            self.scheduler.name_ahead(self._behind[0])
            if all(s.request.finished for s in self._behind[0].scheduled):
                self._behind = None  # every request stopped here: its tokens are all dropped
        self._open_step = None
        self.last_step = sched
        self._freed_after_last_step = self.block_manager.num_freed - freed_before
        self.stats.steps += 1
        self.stats.tokens_computed += sum(s.num_new_tokens for s in sched.scheduled)
        self.stats.preemptions = self.scheduler.num_preemptions - self._preempt_base
        self.stats.prefix_queried_tokens = (
            self.block_manager.stats.queried_tokens - self._prefix_base[0]
        )
        self.stats.prefix_hit_tokens = self.block_manager.stats.hit_tokens - self._prefix_base[1]
        end_step([(r, t) for r, t, _ in results if t is not None], view=self._view_of_step)
        return results

    def _step_failed(self, sched: SchedulerOutput, exc: Exception) -> list[tuple]:
        """Undo the step; a request that ran alone is to blame, else each runs alone next."""
        self.undo_step()
        self.last_step = None
        if _fails_every_request(exc):
            raise exc
        scheduled = [s.request for s in sched.scheduled if not s.request.finished]
        if not scheduled:
            return []
        if len(scheduled) == 1:
            req = scheduled[0]
            if self.suspects and self.suspects[0] is req:
                self.suspects.popleft()
            return [self._remove_failed(req, exc)]
        self.suspects.extend(r for r in scheduled if r not in self.suspects)
        return []

    def _remove_failed(self, req: Request, exc: Exception) -> tuple:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        self.scheduler.fail(req, f"{req.request_id} failed in an engine step ({reason})")
        self.cache.release_row(req.request_id)
        self._drop_proposals(req)
        return (req, None, "")

    def _view_of_step(self) -> dict:
        """The engine after the step just settled, as the trace stores it for replay."""
        now = time.perf_counter()
        return engine_snapshot(self, step_index=self.stats.steps - 1, step_stats=None, now=now)

    # ---- speculative decoding ----

    def _propose(self) -> None:
        """Ask the proposer for each decoding request's guesses (before scheduling: the scheduler
        gives a request 1 + k' query tokens). Never more than max_tokens and max_model_len allow:
        a step keeps at most k' + 1 tokens."""
        if self.proposer is None:
            return
        k = self.num_speculative_tokens
        asking, limits = [], []
        for req in self.scheduler.running:
            req.spec_token_ids, req.spec_probs = [], None
            if not req.output_token_ids or req.num_tokens - req.num_computed_tokens != 1:
                continue  # still prefilling: its first token comes from the prompt's pass
            left = min(
                req.params.max_tokens - len(req.output_token_ids),
                self.max_model_len - req.num_tokens,
            )
            if min(k, left - 1) >= 1:
                asking.append(req)
                limits.append(min(k, left - 1))
        if not asking:
            return
        for req, limit, proposal in zip(asking, limits, self.proposer.propose(asking, limits)):
            req.spec_token_ids = list(proposal.token_ids[:limit])
            if proposal.probs is not None:
                req.spec_probs = proposal.probs[: len(req.spec_token_ids)]

    def _verified(self, s, accepted: int) -> None:
        """After a verify step: count, rewind past rejected guesses, name the verified blocks."""
        req, stats = s.request, self.stats
        if s.num_spec_tokens:
            req.num_spec_steps += 1
            req.num_draft_tokens += s.num_spec_tokens
            req.num_accepted_tokens += accepted
            stats.spec_verify_steps += 1
            stats.spec_draft_tokens += s.num_spec_tokens
            stats.spec_accepted_tokens += accepted
        req.last_num_accepted = accepted
        if req.finish_reason is None:
            bm = self.block_manager
            req.num_computed_tokens = req.num_tokens - 1  # K/V up to the last kept token's input
            bm.truncate(req.request_id, req.num_tokens)  # blocks of rejected guesses only
            bm.register_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            self.proposer.on_verified(req)
        req.spec_token_ids, req.spec_probs = [], None

    def _drop_proposals(self, req: Request) -> None:
        """The request left the running set: its guesses and the proposer's state for it go."""
        req.spec_token_ids, req.spec_probs = [], None
        if self.proposer is not None:
            self.proposer.on_removed(req)

    def _replays_graph(self, sched: SchedulerOutput) -> bool:
        """A pure-decode step (one new token per request, each sampling) that a graph covers."""
        if (
            self.graphs is None or active_tracer() is not None
        ):  # the tracer wants to see every stage run
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
                ahead = self.scheduler.schedule_ahead(sched, self.max_model_len)
            if ahead is not None:
                self.stats.blocks_in_use.append(self.block_manager.num_used_blocks)
        ahead_queued = self._graph_queue(ahead, ids_from=queued.ids) if ahead is not None else None
        tokens = self.graphs.read(queued)  # waits for step t only, not for the step ahead
        self._behind = (ahead, ahead_queued) if ahead is not None else None
        return [[t] for t in tokens]

    def _graph_queue(self, sched: SchedulerOutput, ids_from=None):
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

    def _build_batch(self, sched: SchedulerOutput) -> tuple[ForwardBatch, PagedKVStep]:
        return build_batch(sched, self.cache, self.block_manager, self.model.batch_device)

    def _trace_begin(self, sched: SchedulerOutput, batch: ForwardBatch, kv: PagedKVStep) -> None:
        moves = (*self._block_moves, self._freed_after_last_step)
        trace_step(self.stats.steps, sched, batch, kv, self.scheduler, self.block_manager, moves)


def _fails_every_request(exc: Exception) -> bool:
    """A failure of the model itself (a tensor-parallel rank is gone): no request is to blame."""
    driver = sys.modules.get("stagewise.parallel.driver")  # loaded whenever a TP model exists
    return driver is not None and isinstance(exc, driver.TensorParallelError)
