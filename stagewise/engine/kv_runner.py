"""Mode "kv": static batching over a contiguous per-request KV cache.

The classic baseline (the seeds' chapter 7, section 3): a batch of up to
`max_num_seqs` prompts is left-padded to the longest one, starts together,
and ends when its longest request ends.

- prefill: one pass over B * P_max tokens; the pad tokens are computed by
  every GEMM (waste) but never stored or attended to;
- decode: one token per row per step, with K/V of earlier tokens read from the
  cache instead of recomputed (O(1) linear work per token, O(N) attention);
  rows whose request already finished keep being computed (waste) until the
  longest request of the batch is done.

`stats.padding_tokens` counts both kinds of waste.
"""

import time
from collections.abc import Iterator

import torch

from stagewise.engine.checks import check_kv_batches
from stagewise.engine.request import Request, RequestStatus
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampler import sample_next_tokens
from stagewise.engine.tracing import begin_step, end_step, request_info
from stagewise.kv.contiguous import ContiguousKVCache, ContiguousKVStep
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.runtime import to_device
from stagewise.stages.attention_metadata import AttentionMetadata


class KVRunner:
    def __init__(
        self,
        model: LlamaModel,
        stop_ids: frozenset[int],
        pad_id: int,
        max_model_len: int,
        max_num_seqs: int,
    ):
        self.model = model
        self.stop_ids = stop_ids  # eos and the other end-of-sequence ids
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.stats = RunStats()

    def run(self, requests: list[Request]) -> Iterator[tuple[Request, int, str]]:
        """Yield (request, token id, new text) for every token as it is sampled."""
        batches = [
            requests[start : start + self.max_num_seqs]
            for start in range(0, len(requests), self.max_num_seqs)
        ]
        # every batch's cache is checked before the first one runs: refuse at once, not half-way
        sizes = [(len(b), self._capacity(b)) for b in batches]
        check_kv_batches(self.model.config, self.model.dtype, self.model.device, sizes)
        for batch in batches:
            yield from self._run_batch(batch)

    @staticmethod
    def _capacity(reqs: list[Request]) -> int:
        """Slots each row of a static batch reserves: longest prompt + largest max_tokens."""
        return max(r.num_prompt_tokens for r in reqs) + max(r.params.max_tokens for r in reqs)

    def _run_batch(self, reqs: list[Request]) -> Iterator[tuple[Request, int, str]]:
        cfg, device = self.model.config, self.model.device
        num_rows = len(reqs)
        prompt_len = max(r.num_prompt_tokens for r in reqs)  # P_max: every row is padded to it
        pads = [prompt_len - r.num_prompt_tokens for r in reqs]
        capacity = self._capacity(reqs)
        cache = ContiguousKVCache(
            cfg.num_layers,
            num_rows,
            capacity,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.model.dtype,
            device,
        )
        self.stats.kv_cache_bytes = max(self.stats.kv_cache_bytes, cache.num_bytes())
        row_start = [b * capacity for b in range(num_rows)]

        # Prefill: rows [pad..pad, prompt], positions count from each prompt's first real token.
        ids, positions, slots = [], [], []
        for b, r in enumerate(reqs):
            ids += [self.pad_id] * pads[b] + r.prompt_token_ids
            positions += [0] * pads[b] + list(range(r.num_prompt_tokens))
            slots += [-1] * pads[b] + [
                row_start[b] + pads[b] + t for t in range(r.num_prompt_tokens)
            ]
        # [B+1]: every row has P_max query rows
        cu_q = [b * prompt_len for b in range(num_rows + 1)]
        seq_lens = [r.num_prompt_tokens for r in reqs]
        now = time.perf_counter()
        for r in reqs:
            r.status, r.first_scheduled_time = RequestStatus.RUNNING, now
        yield from self._step(
            reqs, cache, ids, positions, slots, cu_q, pads, seq_lens, len(ids), sum(pads)
        )

        # Decode: one token per row until the longest request is done.
        while not all(r.finished for r in reqs):
            ids, positions, slots = [], [], []
            for b, r in enumerate(reqs):
                if r.finished:  # the row still runs (static batching), but nothing is stored
                    ids.append(self.pad_id)
                    positions.append(0)
                    slots.append(-1)
                else:
                    ids.append(r.output_token_ids[-1])
                    positions.append(r.num_tokens - 1)
                    slots.append(row_start[b] + pads[b] + r.num_tokens - 1)
                    seq_lens[b] = r.num_tokens
            wasted = sum(r.finished for r in reqs)
            cu_q = list(range(num_rows + 1))  # one query row per sequence
            yield from self._step(
                reqs, cache, ids, positions, slots, cu_q, pads, seq_lens, num_rows, wasted
            )

    def _step(self, reqs, cache, ids, positions, slots, cu_q, pads, seq_lens, num_tokens, wasted):
        device = self.model.batch_device
        batch = ForwardBatch(
            input_ids=to_device(ids, torch.long, device),
            positions=to_device(positions, torch.long, device),
            cu_seqlens_q=to_device(cu_q, torch.int32, device),
            last_token_index=to_device([c - 1 for c in cu_q[1:]], torch.long, device),
            cu_seqlens_q_host=cu_q,
            max_q_len=num_tokens // len(reqs),  # every row has the same count: P_max, or 1
        )
        starts = [b * cache.capacity + pads[b] for b in range(len(reqs))] + [
            len(reqs) * cache.capacity
        ]
        metadata = AttentionMetadata.build(  # once per step, read by every layer
            [num_tokens // len(reqs)] * len(reqs),  # every row has the same count: P_max, or 1
            seq_lens,
            device,
            k_starts=starts,  # row b's keys start at slot b * capacity + its padding
            slot_mapping=slots,
            cu_seqlens_q=batch.cu_seqlens_q,
        )
        kv = ContiguousKVStep(cache=cache, metadata=metadata)
        prefill = num_tokens > len(reqs)
        rows = num_tokens // len(reqs)  # query rows per sequence this step (P_max, or 1)
        infos = [
            request_info(
                r,
                0 if r.finished else rows - pads[b] if prefill else 1,
                "finished (padding row)" if r.finished else "prefill" if prefill else "decode",
                padding=pads[b] if prefill else int(r.finished),
            )
            for b, r in enumerate(reqs)
        ]
        begin_step(
            self.stats.steps,
            "kv",
            infos,
            {
                "positions": batch.positions,
                "slot_mapping": kv.metadata.slot_mapping,
                "cu_seqlens_q": kv.metadata.cu_seqlens_q,
                "cu_seqlens_k": kv.metadata.cu_seqlens_k,
                "seq_lens": kv.metadata.seq_lens,
            },
        )
        logits = self.model.forward(batch, kv)  # [B, vocab]
        self.stats.steps += 1
        self.stats.tokens_computed += num_tokens
        self.stats.padding_tokens += wasted
        live = [b for b, r in enumerate(reqs) if not r.finished]
        if len(live) < len(reqs):  # rows of finished requests are not sampled
            # [B, V] -> [live, V]
            logits = logits.index_select(0, to_device(live, torch.long, logits.device))
        tokens = sample_next_tokens(self.model.ops, logits, [reqs[b] for b in live])
        results = []
        for b, token in zip(live, tokens):
            r = reqs[b]
            r.num_computed_tokens = r.num_tokens
            delta = r.append_token(token, self.stop_ids, self.max_model_len)
            if r.finish_reason is not None:
                r.status = RequestStatus.FINISHED
            results.append((r, token, delta))
        end_step([(r, t) for r, t, _ in results])
        yield from results
