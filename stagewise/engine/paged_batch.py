"""One paged step's inputs: every scheduled token flattened into one batch; what the tracer sees.

    input_ids [T], positions [T], slot_mapping [T], cu_seqlens_q [B+1], seq_lens [B],
    block_table [B, max_blocks]: the requests' rows of the block table

Prefill chunks and decode tokens sit side by side, with no padding; a token at
position p of a request lives in slot `blocks[p // block_size] * block_size +
p % block_size`. A speculating request (engine/speculative/) runs its last token
and then its k guesses, 1 + k rows, and every one of them goes to the LM head
(`last_token_index` lists all 1 + k): the verify step needs the target's
distribution after each guess.
"""

import itertools

import torch

from stagewise.engine.scheduler import Scheduler, SchedulerOutput
from stagewise.engine.tracing import begin_step, request_info
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep
from stagewise.models.forward_batch import ForwardBatch
from stagewise.runtime import to_device
from stagewise.stages.attention_metadata import AttentionMetadata


def build_batch(
    sched: SchedulerOutput, cache: PagedKVCache, block_manager: BlockManager, device
) -> tuple[ForwardBatch, PagedKVStep]:
    """Flatten every scheduled token into one batch, and the step's paged attention metadata."""
    bs = cache.block_size
    ids, positions, slots, q_lens, seq_lens, rows, last = [], [], [], [], [], [], []
    for s in sched.scheduled:
        req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
        blocks = block_manager.block_ids(req.request_id)
        ids += (req.spec_all_token_ids if s.num_spec_tokens else req.all_token_ids)[
            start : start + n
        ]
        positions += range(start, start + n)
        # slot of each new token
        slots += [blocks[p // bs] * bs + p % bs for p in range(start, start + n)]
        rows.append(cache.write_row(req.request_id, blocks))
        q_lens.append(n)
        seq_lens.append(start + n)
        if s.samples:  # the last token's row, and one row per guess after it
            last.extend(range(len(ids) - 1 - s.num_spec_tokens, len(ids)))
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
    block_table = cache.block_table[to_device(rows, torch.long, device), :max_blocks]
    metadata = AttentionMetadata.build(  # once per step, read by every layer
        q_lens,
        seq_lens,
        device,
        block_table=block_table.contiguous(),  # [B, max_blocks]: this step's rows
        slot_mapping=slots,
        cu_seqlens_q=batch.cu_seqlens_q,
    )
    copies = tuple((src, dst) for dst, src in block_manager.copies.items())  # copy-on-write
    kv = PagedKVStep(cache=cache, metadata=metadata, block_copies=copies)
    return batch, kv


def trace_step(
    index: int,
    sched: SchedulerOutput,
    batch: ForwardBatch,
    kv: PagedKVStep,
    scheduler: Scheduler,
    block_manager: BlockManager,
    moves: tuple[int, int, int],
) -> None:
    """Tell the tracer what the step runs; `moves`: blocks allocated and freed by preemption while
    scheduling, and freed by the requests that finished in the previous step."""
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
        extra = {"blocks": block_manager.block_ids(r.request_id)}
        if s.num_spec_tokens:  # speculative: the last token and k guesses, all to the LM head
            phase = "verify"
            extra["draft_token_ids"] = list(r.spec_token_ids)
        if s.num_cached_tokens:  # K/V reused when admitted: the prefix cache's, or a fork's
            extra["reused_tokens"] = s.num_cached_tokens
            extra["reused_from"] = s.reused_from  # "hash", "radix" or "fork"
        infos.append(request_info(r, s.num_new_tokens, phase, **extra))
    scheduler = {
        "waiting": [r.request_id for r in scheduler.waiting],
        "preempted": [r.request_id for r in sched.preempted],
        "admitted": [r.request_id for r in sched.admitted],
        "kv_blocks_in_use": block_manager.num_used_blocks,
        "kv_blocks_total": block_manager.num_blocks,
        "blocks_allocated": moves[0],
        "blocks_freed_by_preemption": moves[1],
        "blocks_freed_by_finished_last_step": moves[2],
    }
    if block_manager.copies:  # copy-on-write: shared blocks copied before this step writes them
        scheduler["block_copies"] = [[src, dst] for dst, src in block_manager.copies.items()]
    begin_step(
        index,
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
