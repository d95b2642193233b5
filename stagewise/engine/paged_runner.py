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
"""

import itertools
import time
from collections.abc import Iterator

import torch

from stagewise.config import EngineConfig
from stagewise.engine.cuda_graphs import DecodeGraphs
from stagewise.engine.request import Request
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampler import sample_next_tokens
from stagewise.engine.scheduler import Scheduler, SchedulerOutput
from stagewise.engine.tracing import begin_step, end_step, request_info
from stagewise.errors import StagewiseError
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep, num_blocks_for_budget
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.runtime import to_device
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.trace.hooks import active_tracer


class PagedRunner:
    def __init__(
        self, model: LlamaModel, stop_ids: frozenset[int], max_model_len: int, ecfg: EngineConfig
    ):
        cfg = model.config
        self.model = model
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
        self.scheduler.abort(req)
        self.cache.release_row(req.request_id)

    def recover_interrupted_step(self) -> None:
        """After a step that raised: running requests go back to waiting and will be recomputed."""
        for req in self.scheduler.recover_interrupted_step():
            self.cache.release_row(req.request_id)

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
    _block_moves = (0, 0)  # (allocated, freed) while scheduling the current step

    def reset_stats(self) -> None:
        self.stats = RunStats(kv_cache_bytes=self.cache.num_bytes())
        self._prefix_base = (
            self.block_manager.stats.queried_tokens,
            self.block_manager.stats.hit_tokens,
        )
        self._preempt_base = self.scheduler.num_preemptions

    # ---- one iteration ----

    def step(self) -> list[tuple[Request, int, str]]:
        bm = self.block_manager
        before = (bm.num_allocated, bm.num_freed)
        sched = self.scheduler.schedule()
        self._block_moves = (
            bm.num_allocated - before[0],
            bm.num_freed - before[1],
        )  # during scheduling
        self.stats.blocks_in_use.append(bm.num_used_blocks)  # what this step runs with
        if not sched.scheduled:
            raise RuntimeError(
                "scheduler made no progress"
            )  # cannot happen: every request fits alone
        now = time.perf_counter()
        for s in sched.scheduled:
            s.request.first_scheduled_time = s.request.first_scheduled_time or now
        if self._replays_graph(sched):
            logits = self._graph_step(sched)  # [num requests, vocab]
        else:
            batch, kv = self._build_batch(sched)
            self._trace_begin(sched, batch, kv)
            logits = self.model.forward(batch, kv)  # [num sampling requests, vocab]
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        sampling = [s.request for s in sched.scheduled if s.samples]
        tokens = sample_next_tokens(self.model.ops, logits, sampling) if sampling else []
        results = []
        freed_before = self.block_manager.num_freed
        for req, token in zip(sampling, tokens):
            delta = req.append_token(token, self.stop_ids, self.max_model_len)
            if req.finish_reason is not None:
                self.scheduler.finish(req)
                self.cache.release_row(req.request_id)
            results.append((req, token, delta))
        for req in sched.preempted:
            self.cache.release_row(req.request_id)
        self._freed_after_last_step = self.block_manager.num_freed - freed_before
        self.stats.steps += 1
        self.stats.tokens_computed += sum(s.num_new_tokens for s in sched.scheduled)
        self.stats.preemptions = self.scheduler.num_preemptions - self._preempt_base
        self.stats.prefix_queried_tokens = (
            self.block_manager.stats.queried_tokens - self._prefix_base[0]
        )
        self.stats.prefix_hit_tokens = self.block_manager.stats.hit_tokens - self._prefix_base[1]
        end_step([(r, t) for r, t, _ in results])
        return results

    def _replays_graph(self, sched: SchedulerOutput) -> bool:
        """A pure-decode step (one new token per request, each sampling) that a graph covers."""
        if (
            self.graphs is None or active_tracer() is not None
        ):  # the tracer wants to see every stage run
            return False
        decode = all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled)
        return decode and self.graphs.covers(len(sched.scheduled))

    def _graph_step(self, sched: SchedulerOutput):
        """The step's inputs as host lists, copied into the graphs' static buffers; one replay."""
        bs = self.cache.block_size
        ids, positions, slots, seq_lens, rows = [], [], [], [], []
        for s in sched.scheduled:
            req, pos = s.request, s.request.num_computed_tokens  # the one new token's position
            blocks = self.block_manager.block_ids(req.request_id)
            ids.append(req.all_token_ids[pos])
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            seq_lens.append(pos + 1)
            rows.append(self.cache.write_row(req.request_id, blocks))
        return self.graphs.run(ids, positions, slots, seq_lens, rows)

    def _build_batch(self, sched: SchedulerOutput) -> tuple[ForwardBatch, PagedKVStep]:
        bs, device = self.cache.block_size, self.model.batch_device
        ids, positions, slots, q_lens, seq_lens, rows, last = [], [], [], [], [], [], []
        for s in sched.scheduled:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            blocks = self.block_manager.block_ids(req.request_id)
            ids += req.all_token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [
                blocks[p // bs] * bs + p % bs for p in range(start, start + n)
            ]  # slot of each new token
            rows.append(self.cache.write_row(req.request_id, blocks))
            q_lens.append(n)
            seq_lens.append(start + n)
            if s.samples:
                last.append(len(ids) - 1)
        cu = list(itertools.accumulate(q_lens, initial=0))  # [B+1] on the host
        max_blocks = max(-(-n // bs) for n in seq_lens)
        batch = ForwardBatch(
            input_ids=to_device(ids, torch.long, device),
            positions=to_device(positions, torch.long, device),
            cu_seqlens_q=to_device(cu, torch.int32, device),
            last_token_index=to_device(last, torch.long, device),
            cu_seqlens_q_host=cu,
            max_q_len=max(q_lens),
        )
        block_table = self.cache.block_table[to_device(rows, torch.long, device), :max_blocks]
        metadata = AttentionMetadata.build(  # once per step, read by every layer
            q_lens,
            seq_lens,
            device,
            block_table=block_table.contiguous(),  # [B, max_blocks]: this step's rows
            slot_mapping=slots,
            cu_seqlens_q=batch.cu_seqlens_q,
        )
        kv = PagedKVStep(cache=self.cache, metadata=metadata)
        return batch, kv

    def _trace_begin(self, sched: SchedulerOutput, batch: ForwardBatch, kv: PagedKVStep) -> None:
        infos = []
        for s in sched.scheduled:
            r = s.request
            phase = (
                "decode"
                if r.output_token_ids and r.num_tokens - r.num_computed_tokens == 1
                else "prefill"
            )
            if phase == "prefill" and not s.samples:
                phase = "prefill chunk"
            extra = {"blocks": self.block_manager.block_ids(r.request_id)}
            if s.num_cached_tokens:
                extra["prefix_cache_hit_tokens"] = s.num_cached_tokens
            infos.append(request_info(r, s.num_new_tokens, phase, **extra))
        scheduler = {
            "waiting": [r.request_id for r in self.scheduler.waiting],
            "preempted": [r.request_id for r in sched.preempted],
            "admitted": [r.request_id for r in sched.admitted],
            "kv_blocks_in_use": self.block_manager.num_used_blocks,
            "kv_blocks_total": self.block_manager.num_blocks,
            "blocks_allocated": self._block_moves[0],
            "blocks_freed_by_preemption": self._block_moves[1],
            "blocks_freed_by_finished_last_step": self._freed_after_last_step,
        }
        begin_step(
            self.stats.steps,
            "paged",
            infos,
            {
                "positions": batch.positions,
                "slot_mapping": kv.metadata.slot_mapping,
                "cu_seqlens_q": kv.metadata.cu_seqlens_q,
                "seq_lens": kv.metadata.seq_lens,
                "block_table": kv.metadata.block_table,
            },
            scheduler,
        )
