"""Mode "paged": continuous batching over the paged KV cache (the seeds' vLLM engine).

One `step()`:

1. schedule: the scheduler picks requests and a token count for each (running
   first, then waiting; chunked prefill, preemption, prefix-cache hits);
2. build batch: every scheduled token flattened into one batch —
   `input_ids [T]`, `positions [T]`, `slot_mapping [T]`, `cu_seqlens_q [B+1]`,
   `seq_lens [B]`, the requests' `block_table` rows — prefill chunks and
   decode tokens side by side, no padding (`paged_batch.py`);
3. forward: one pass of the model -> logits of each sequence's last token;
4. sample: one token for each request whose tokens are all computed;
5. settle: the tokens are appended; finished requests leave and free their
   blocks at once, so a waiting request can join in the very next step.

Speculative decoding (`proposer`, engine/speculative/) adds to three of them:
before scheduling, each decoding request may get k guesses and then runs
1 + k query tokens; the LM head runs on all of them and the verify step keeps
the guesses the target agrees with plus one token of its own; settling
rewinds the request past the rejected ones (`speculative/steps.py`).

CUDA graphs (`EngineConfig.cuda_graphs`) wrap this step from outside:
`GraphRunner` (engine/graph_runner.py) is a subclass that replays decode steps
from captured graphs and may read their token ids one step late. This module
never imports it; a CPU run without graphs never loads it.

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
from stagewise.cpu import build
from stagewise.engine.interrupts import deferred_interrupts
from stagewise.engine.paged_batch import build_batch, trace_step
from stagewise.engine.request import Request
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampler import sample_next_tokens
from stagewise.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from stagewise.engine.snapshot import engine_snapshot
from stagewise.engine.speculative.steps import after_verify, drop_proposals, propose
from stagewise.engine.speculative.verify import verify
from stagewise.engine.tracing import end_step
from stagewise.errors import StagewiseError
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep, num_blocks_for_budget
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel


class PagedRunner:
    spare_block = False  # one more cache block that no request owns (GraphRunner's padding rows)

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
            spare_block=self.spare_block,
        )
        self.block_manager = BlockManager(
            num_blocks, ecfg.block_size, prefix_cache=ecfg.prefix_cache_kind
        )
        self.scheduler = Scheduler(
            self.block_manager,
            ecfg.max_num_seqs,
            ecfg.max_num_batched_tokens,
            ecfg.prefill_cap(model.device.type, compiled_cpu_kernels=build.enabled()),
        )
        self.suspects: deque[Request] = deque()  # requests of a failed step, each to run alone
        self._open_step: SchedulerOutput | None = None  # a step begun and not yet settled
        self.reset_stats()

    # ---- one iteration: schedule -> build batch -> forward -> sample -> settle ----

    def step(self, deliver: Callable[[list], None] | None = None) -> list[tuple]:
        """One iteration -> (request, token id, new text) per sampled token, and
        (request, None, "") per request removed because the step failed for it.

        `deliver(results)`, when given, runs before SIGINT is let through again: an interrupt
        cannot fall between the engine settling a token and its owner receiving it.
        """
        with deferred_interrupts():
            self.repair()
            sched = self._open_step = self._schedule()  # 1. schedule
        try:
            tokens = self._compute(sched)  # 2.-4. build batch -> forward -> sample
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
            results = self._settle(sched, tokens)  # 5. settle
            if deliver is not None:
                deliver(results)
        return results

    def _compute(self, sched: SchedulerOutput) -> list[list[int]]:
        """Build the batch, run the forward pass, sample: the part of a step Ctrl-C may cut short.
        -> the tokens of each sampling request: one, or with speculation 1 .. k + 1."""
        batch, kv = build_batch(sched, self.cache, self.block_manager, self.model.batch_device)
        self._trace_begin(sched, batch, kv)
        logits = self.model.forward(batch, kv)  # [sampling rows (1 + k per request), vocab]
        return self._sample(sched, logits)

    def _schedule(self) -> SchedulerOutput:
        while self.suspects and self.suspects[0].finished:  # aborted while under suspicion
            self.suspects.popleft()
        bm = self.block_manager
        before = (bm.num_allocated, bm.num_freed)
        if self.suspects:  # a failed step's requests run alone, one by one, to find the culprit
            sched = self.scheduler.schedule_alone(self.suspects[0])
        else:
            if self.proposer is not None:  # speculative decoding: guesses first, then the budget
                k = self.num_speculative_tokens
                propose(self.proposer, self.scheduler.running, k, self.max_model_len)
            sched = self.scheduler.schedule()
        self._block_moves = (bm.num_allocated - before[0], bm.num_freed - before[1])  # scheduling
        self.stats.blocks_in_use.append(bm.num_used_blocks)  # what this step runs with
        if not sched.scheduled:
            raise RuntimeError("scheduler made no progress")  # cannot happen: each request fits
        now = time.perf_counter()
        for s in sched.scheduled:
            s.request.first_scheduled_time = s.request.first_scheduled_time or now
        return sched

    def _sample(self, sched: SchedulerOutput, logits) -> list[list[int]]:
        """logits [sampling rows, vocab] -> the kept tokens of each request that samples."""
        sampling = [s.request for s in sched.scheduled if s.samples]
        if not sampling:
            return []
        if self.proposer is not None:  # every draw of a speculating engine: the same stream
            return verify(self.model.ops, logits, sampling)
        return [[t] for t in sample_next_tokens(self.model.ops, logits, sampling)]

    def _settle(self, sched: SchedulerOutput, tokens: list[list[int]]) -> list[tuple]:
        """Record the sampled tokens; finished requests leave and free their blocks."""
        freed_before = self.block_manager.num_freed
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        results = []
        for s, kept in zip([s for s in sched.scheduled if s.samples], tokens):
            results += self._append(s, kept)
        for req in sched.preempted:
            self._release(req)
        self._open_step, self.last_step = None, sched
        self._count(sched, freed=self.block_manager.num_freed - freed_before)
        end_step([(r, t) for r, t, _ in results if t is not None], view=self._view_of_step)
        return results

    def _append(self, s: ScheduledRequest, kept: list[int]) -> list[tuple]:
        """One request's new tokens -> its results; if it finished, it leaves the engine."""
        req, results = s.request, []
        try:
            for token in kept:  # one by one: a stop or max_tokens cuts the run exactly there
                delta = req.append_token(token, self.stop_ids, self.max_model_len)
                results.append((req, token, delta))
                if req.finish_reason is not None:
                    break
        except Exception as exc:  # detokenizing this request's token failed: its own fault
            return [*results, self._remove_failed(req, exc)]
        if self.proposer is not None:  # rewind past the rejected guesses
            after_verify(s, kept, self.proposer, self.block_manager, self.stats)
        if req.finish_reason is not None:
            self.scheduler.finish(req)
            self._release(req)
        if self.suspects and self.suspects[0] is req:  # it ran alone and sampled: not guilty
            self.suspects.popleft()
        return results

    def _release(self, req: Request) -> None:
        """The request left the running set: its block-table row and its guesses go."""
        self.cache.release_row(req.request_id)
        drop_proposals(req, self.proposer)

    # ---- requests ----

    def check_fits(self, req: Request) -> None:
        """Reject a request that could never run, instead of letting it wait forever."""
        need = self.block_manager.blocks_needed(req.num_prompt_tokens + req.params.max_tokens)
        have, n = self.block_manager.num_blocks, req.params.n
        if need > have:
            raise StagewiseError(
                f"{req.request_id} needs {need} KV blocks for prompt + max_tokens, but the cache "
                f"has {have}; raise the KV budget or lower max_tokens"
            )
        if n * need > have:  # parallel samples: each may come to hold all of its own
            raise StagewiseError(
                f"n={n} samples of {req.num_prompt_tokens} prompt + {req.params.max_tokens} "
                f"max_tokens need {n} x {need} KV blocks, but the cache has {have}; lower n or "
                "max_tokens, or raise the KV budget"
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
            self._release(req)

    def run(self, requests: list[Request]) -> Iterator[tuple[Request, int, str]]:
        """Run `requests` (and anything already queued) to completion; fresh stats for this run."""
        for req in requests:
            self.check_fits(req)
        self.reset_stats()
        for req in requests:
            self.scheduler.add(req)
        while self.has_unfinished():
            yield from self.step()

    # ---- when a step fails ----

    def undo_step(self) -> None:
        """After a step that raised: running requests go back to waiting and will be recomputed."""
        for req in self.scheduler.recover_interrupted_step():
            self._release(req)
        self._open_step = None

    def repair(self) -> None:
        """Finish what an interrupt cut short: a step left open is undone, and block-table rows
        and KV blocks that no running request owns go back to their free lists."""
        if self._open_step is not None:
            self.undo_step()
        live = {r.request_id for r in self.scheduler.running}
        for request_id in [r for r in self.cache.row_of if r not in live]:
            self.cache.release_row(request_id)
        for request_id in [r for r in self.block_manager.req_blocks if r not in live]:
            self.block_manager.free(request_id)
        self.cache.reclaim_lost_rows()

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
        self._release(req)
        return (req, None, "")

    # ---- counters and the tracer ----

    _freed_after_last_step = 0  # blocks released by requests that finished in the previous step
    last_step: SchedulerOutput | None = None  # the latest settled step (None after a failed one)
    _block_moves = (0, 0)  # (allocated, freed) while scheduling the current step

    def reset_stats(self) -> None:
        self.stats = RunStats(kv_cache_bytes=self.cache.num_bytes())
        bm_stats = self.block_manager.stats
        self._prefix_base = (bm_stats.queried_tokens, bm_stats.hit_tokens, bm_stats.forked_tokens)
        self._preempt_base = self.scheduler.num_preemptions

    def _count(self, sched: SchedulerOutput, freed: int) -> None:
        """The run's counters after a settled step; `freed`: blocks its finished requests freed."""
        stats, bm_stats = self.stats, self.block_manager.stats
        self._freed_after_last_step = freed
        stats.steps += 1
        stats.tokens_computed += sched.num_tokens
        stats.preemptions = self.scheduler.num_preemptions - self._preempt_base
        stats.prefix_queried_tokens = bm_stats.queried_tokens - self._prefix_base[0]
        stats.prefix_hit_tokens = bm_stats.hit_tokens - self._prefix_base[1]
        stats.forked_tokens = bm_stats.forked_tokens - self._prefix_base[2]

    def _trace_begin(self, sched: SchedulerOutput, batch: ForwardBatch, kv: PagedKVStep) -> None:
        moves = (*self._block_moves, self._freed_after_last_step)
        trace_step(self.stats.steps, sched, batch, kv, self.scheduler, self.block_manager, moves)

    def _view_of_step(self) -> dict:
        """The engine after the step just settled, as the trace stores it for replay."""
        now = time.perf_counter()
        return engine_snapshot(self, step_index=self.stats.steps - 1, step_stats=None, now=now)


def _fails_every_request(exc: Exception) -> bool:
    """A failure of the model itself (a tensor-parallel rank is gone): no request is to blame."""
    driver = sys.modules.get("stagewise.parallel.driver")  # loaded whenever a TP model exists
    return driver is not None and isinstance(exc, driver.TensorParallelError)
