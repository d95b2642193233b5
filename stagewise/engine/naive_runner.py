"""Mode "naive": no KV cache; every step recomputes every sequence from its first token.

The seeds' chapter 5: to produce token N+1 the whole sequence of N tokens
goes through every layer again, so one step costs O(N * d^2) in the linear
layers and O(N^2 * d) in attention, and a generation of n tokens costs the sum
of that over a growing N. This mode exists to be measured against `kv` and
`paged`; it gives the same tokens, much more slowly.

Requests start together; a finished request leaves the batch, so no padding.
"""

import time
from collections.abc import Iterator

from stagewise.engine.request import Request, RequestStatus
from stagewise.engine.run_stats import RunStats
from stagewise.engine.sampler import sample_next_tokens
from stagewise.engine.tracing import begin_step, end_step, request_info
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel


class NaiveRunner:
    def __init__(self, model: LlamaModel, stop_ids: frozenset[int], max_model_len: int):
        self.model = model
        self.stop_ids = stop_ids  # eos and the other end-of-sequence ids
        self.max_model_len = max_model_len
        self.stats = RunStats()

    def run(self, requests: list[Request]) -> Iterator[tuple[Request, int, str]]:
        """Yield (request, token id, new text) for every token as it is sampled."""
        active = list(requests)
        while active:
            now = time.perf_counter()
            for r in active:
                r.status = RequestStatus.RUNNING
                r.first_scheduled_time = r.first_scheduled_time or now
            seqs = [r.all_token_ids for r in active]  # the whole sequence, every step
            batch = ForwardBatch.from_sequences(seqs, [0] * len(seqs), self.model.batch_device)
            infos = [
                request_info(r, r.num_tokens, "prefill" if not r.output_token_ids else "recompute")
                for r in active
            ]
            for r in active:
                r.num_computed_tokens = 0  # nothing is cached: every token is computed again
            begin_step(
                self.stats.steps,
                "naive",
                infos,
                {"positions": batch.positions, "cu_seqlens_q": batch.cu_seqlens_q},
            )
            logits = self.model.forward(batch, NoKVCache.of(batch))  # [B, vocab]
            self.stats.steps += 1
            self.stats.tokens_computed += batch.num_tokens
            tokens = sample_next_tokens(self.model.ops, logits, active)
            results = []
            for r, token in zip(active, tokens):
                r.num_computed_tokens = r.num_tokens  # everything was (re)computed this step
                delta = r.append_token(token, self.stop_ids, self.max_model_len)
                if r.finish_reason is not None:
                    r.status = RequestStatus.FINISHED
                results.append((r, token, delta))
            end_step([(r, t) for r, t, _ in results])
            yield from results
            active = [r for r in active if not r.finished]
