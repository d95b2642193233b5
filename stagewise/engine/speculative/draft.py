"""The draft-model proposer: a small model with the same tokenizer guesses the next k tokens.

Speculative decoding needs guesses that are cheap and often right. A second,
much smaller model of the same family (SmolLM2-135M drafting for a 1.7B, a
2-layer model for a 30-layer one) runs k ordinary decode steps of its own; the
target then checks all k guesses in one forward pass of k + 1 rows.

The draft is a full model with its own state, so it keeps its own paged KV
cache — its own `PagedKVCache` (its layer count and head sizes, not the
target's) and its own `BlockManager` — exactly as the engine keeps the
target's. For each request it remembers which tokens its cache holds
(`held`, positions 0, 1, ...). One `propose()` for a batch of requests:

    catch up + draft 1   every request feeds the tokens its cache lacks (after a
                         prefill: the whole prompt; in steady decoding: the one or
                         few tokens the target accepted last step), flattened across
                         requests into passes of at most the engine's token budget
                         (max_num_batched_tokens: a long prompt is fed in chunks, as
                         the target's chunked prefill), logits of each one's last
                         row -> the first draft token
    drafts 2 .. k        one token per request per step, batched across requests
                         (a request asked for fewer tokens leaves the batch early)

    tokens  t_0 ... t_{n-1}   d_1   d_2 ... d_{k-1}   d_k
    K/V     cached or fed     fed   fed     fed        never fed (nothing reads it)

Each draft token is drawn from the request's own sampling rules (repetition
penalty — drafts already made count as seen —, temperature, min_p, top-k,
top-p: `stages.sampling.processed_probs`); greedy requests take the argmax.
Randomness (`randomness.py`) is keyed by the request's seed and the output
position t of the draft token, never by the batch. Acceptance "coupled" (the
default): d_t = argmax q_t / E_t with the very noise E_t of the target's own
draw at t, and the guess goes back as a point mass (kept when the target's
draw is the same token). "rejection": d_t is drawn from q_t by a generator of
its own (DRAFT_STREAM) and comes back with its q row, for min(1, p / q).

After verification (`on_verified`) the cache is cut back to the longest
prefix of what it holds that is still the request's text: the accepted
drafts stay, rejected ones are forgotten, and whole blocks past the new end go
back to the free list. Memory is bounded by the cache's own block count; a
request that does not fit gets no proposal (and holds no draft blocks) until
others have finished.

The draft's forward passes are not traced: a trace shows the target's engine
steps, and the proposed tokens are in them.
"""

import torch

from stagewise.engine.request import Request
from stagewise.engine.speculative import randomness
from stagewise.engine.speculative.draft_load import check_same_vocabulary, load_draft
from stagewise.engine.speculative.proposal import Proposal
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep, num_blocks_for_budget
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.prepare import build_packed_forms
from stagewise.models.registry import LoadedModel
from stagewise.runtime import to_device
from stagewise.sampling_params import SamplingTensors
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.base import stage_of
from stagewise.stages.sampling import apply_repetition_penalty, processed_probs


class UntracedOps(StageOps):
    """The target's stage tiers, run without telling the tracer (the draft is not traced)."""

    def __call__(self, stage, layer: int | None = None, **kwargs):
        return self._fns[stage_of(stage, STAGES).name](**kwargs)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, one comparison in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


class DraftModelProposer:
    """Proposes tokens with a draft model that shares the target's tokenizer (see the module doc).

    `target`: the target `LLM` (its `loaded` model, `ops`, `engine_config`, `max_model_len`).
    `draft`: an already loaded draft model (else `config.model` is loaded, on the target's device
    in its dtype). `num_blocks`: the draft cache's size; by default as many blocks as the
    target's cache has (the draft can hold every token the target holds).
    """

    def __init__(
        self, config, target, draft: LoadedModel | None = None, num_blocks: int | None = None
    ):
        t_loaded, ecfg = target.loaded, target.engine_config
        if draft is None:
            draft = load_draft(config, t_loaded)
        check_same_vocabulary(t_loaded, draft)
        self.loaded = draft
        self.num_speculative_tokens = config.num_speculative_tokens  # k, the most drafts per step
        self.acceptance = config.acceptance  # "coupled" or "rejection" (randomness.py)
        self.max_tokens_per_pass = ecfg.max_num_batched_tokens  # tokens fed per draft forward
        ops = UntracedOps(target.ops.backend, target.ops.overrides)
        # packed weights: the torch tier's forms, now (read from the disk cache when kept)
        build_packed_forms(draft.weights, ops.backends, draft.source)
        self.model = LlamaModel(draft, ops)
        # the draft feeds positions up to n + k - 2: within the target's limit and its own
        self.max_len = min(target.max_model_len, draft.config.max_position_embeddings)
        if num_blocks is None:
            num_blocks = _target_num_blocks(target, ecfg)
        self.cache = PagedKVCache(
            draft.config,
            num_blocks,
            ecfg.block_size,
            ecfg.max_num_seqs,
            self.max_len,
            draft.dtype,
            draft.device,
            self.model.batch_device,
        )
        # no prefix caching: drafted blocks hold guesses, and a rewind rewrites them
        self.block_manager = BlockManager(num_blocks, ecfg.block_size, enable_prefix_caching=False)
        self.held: dict[str, list[int]] = {}  # request id -> tokens whose draft K/V are cached
        self.num_proposed = 0  # draft tokens proposed so far (all requests)

    # ---- the Proposer protocol ----

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[Proposal]:
        """One Proposal per request: up to num_tokens[i] tokens continuing req.all_token_ids."""
        proposals = [Proposal([], None) for _ in requests]
        if self.model.device.type == "meta":  # a shape-only draft has no numbers to guess from
            return proposals
        work = []  # (index in requests, request, its tokens, k)
        for i, (req, k) in enumerate(zip(requests, num_tokens)):
            tokens = req.all_token_ids
            k = min(k, self.max_len - len(tokens) + 1)  # positions fed stay below max_len
            if k > 0 and self._make_room(req.request_id, tokens, k):
                work.append((i, req, tokens, k))
        if not work:
            return proposals
        drafts = {i: [] for i, *_ in work}  # index -> drafted tokens
        rows = {i: [] for i, *_ in work}  # index -> q rows [vocab] they were drawn from
        # the first pass: every request's missing tokens (at least its last one)
        chunks = []
        for i, req, tokens, _ in work:
            start = len(self.held[req.request_id])
            chunks.append((i, req, tokens[start:], start))
        while chunks:
            logits = self._feed(chunks)  # [len(chunks), vocab]
            positions = [start + len(fed) for _, _, fed, start in chunks]  # of each new draft
            reqs = [req for _, req, _, _ in chunks]
            new, q = self._draw(logits, reqs, [drafts[i] for i, *_ in chunks], positions)
            for row, (i, *_rest) in enumerate(chunks):
                drafts[i].append(new[row])
                rows[i].append(None if q is None else q[row])
            k_of = {i: k for i, _, _, k in work}
            chunks = [  # the next pass: the drafts just made, one token each
                (i, req, [drafts[i][-1]], pos)
                for (i, req, _, _), pos in zip(chunks, positions)
                if len(drafts[i]) < k_of[i]
            ]
        for i, *_ in work:
            # greedy or coupled guesses are checked as point masses: no q rows
            point_mass = requests[i].params.greedy or self.acceptance == "coupled"
            q_rows = None if point_mass else torch.stack(rows[i])  # [k', vocab]
            proposals[i] = Proposal(drafts[i], q_rows)
            self.num_proposed += len(drafts[i])
        return proposals

    def on_verified(self, req: Request) -> None:
        """Cut the draft cache back to what is still the request's text (rejected drafts go)."""
        held = self.held.get(req.request_id)
        if held is not None:
            self._truncate(req.request_id, common_prefix_length(held, req.all_token_ids))

    def on_removed(self, req: Request) -> None:
        """Finished, aborted, failed or preempted: free its draft blocks and block-table row."""
        self._drop(req.request_id)

    def close(self) -> None:
        for request_id in list(self.held):
            self._drop(request_id)

    # ---- the draft cache ----

    def _make_room(self, request_id: str, tokens: list[int], k: int) -> bool:
        """Keep the cached prefix that is still valid; make room for k drafts. False: no room."""
        held = self.held.get(request_id, [])
        keep = min(common_prefix_length(held, tokens), len(tokens) - 1)  # the last is fed again
        if request_id not in self.cache.row_of and not self.cache.free_rows:
            return False  # more requests than block-table rows (cannot happen under the engine)
        self.held[request_id] = held
        self._truncate(request_id, keep)
        total = len(tokens) + k - 1  # K/V of the tokens and of the first k - 1 drafts
        if not self.block_manager.allocate(request_id, keep, total - keep):
            self._drop(request_id)  # it cannot fit now: it holds nothing while others run
            return False
        return True

    def _truncate(self, request_id: str, length: int) -> None:
        """Forget cached tokens from position `length` on; blocks wholly past it are freed."""
        self.held[request_id] = self.held[request_id][:length]
        self.block_manager.truncate(request_id, length)

    def _drop(self, request_id: str) -> None:
        self.block_manager.free(request_id)
        self.cache.release_row(request_id)
        self.held.pop(request_id, None)

    # ---- the draft's forward passes, and the draw ----

    def _feed(self, chunks: list[tuple]) -> torch.Tensor:
        """Feed every chunk (index, request, tokens, first position) in forward passes of at most
        `max_tokens_per_pass` tokens in all, a chunk split across passes when it does not fit
        (earlier chunks first); -> logits [len(chunks), vocab] of each chunk's last token."""
        done = [0] * len(chunks)  # tokens of each chunk fed so far
        last: list[torch.Tensor | None] = [None] * len(chunks)
        while any(n < len(c[2]) for n, c in zip(done, chunks)):
            part, owners, left = [], [], self.max_tokens_per_pass
            for j, (i, req, fed, start) in enumerate(chunks):
                n = min(len(fed) - done[j], left)
                if n > 0:
                    part.append((i, req, fed[done[j] : done[j] + n], start + done[j]))
                    owners.append(j)
                    done[j] += n
                    left -= n
            logits = self._forward(part)  # [len(part), vocab]
            for row, j in enumerate(owners):
                if done[j] == len(chunks[j][2]):  # its last token was in this pass
                    last[j] = logits[row]
        return torch.stack(last)  # [len(chunks), vocab]

    def _forward(self, chunks: list[tuple]) -> torch.Tensor:
        """chunks: (index, request, tokens to feed, first position) -> logits [B, vocab] of each
        chunk's last token; the fed tokens' K/V are stored in the draft cache."""
        bs, device = self.cache.block_size, self.model.batch_device
        slots, q_lens, seq_lens, table_rows = [], [], [], []
        for _, req, fed, start in chunks:
            blocks = self.block_manager.block_ids(req.request_id)
            span = range(start, start + len(fed))  # the fed tokens' positions
            slots += [blocks[p // bs] * bs + p % bs for p in span]  # slot of each fed token
            q_lens.append(len(fed))
            seq_lens.append(start + len(fed))
            table_rows.append(self.cache.write_row(req.request_id, blocks))
        batch = ForwardBatch.from_sequences(  # input_ids [T], positions [T], cu_seqlens_q [B+1]
            [fed for _, _, fed, _ in chunks], [start for *_, start in chunks], device
        )
        max_blocks = max(-(-n // bs) for n in seq_lens)
        rows = to_device(table_rows, torch.long, device)
        metadata = AttentionMetadata.build(
            q_lens,
            seq_lens,
            device,
            block_table=self.cache.block_table[rows, :max_blocks].contiguous(),  # [B, max_blocks]
            slot_mapping=slots,
            cu_seqlens_q=batch.cu_seqlens_q,
        )
        logits = self.model.forward(batch, PagedKVStep(self.cache, metadata))  # [B, vocab]
        for _, req, fed, start in chunks:  # only now do the cached K/V hold these tokens
            self.held[req.request_id] = self.held[req.request_id][:start] + fed
        return logits

    def _draw(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafted: list[list[int]],
        positions: list[int],
    ) -> tuple[list[int], torch.Tensor | None]:
        """logits [B, vocab] -> one token per row, and the distributions q [B, vocab] drawn from
        (None when every row is greedy: a greedy guess is a point mass, the verifier needs no q)."""
        vocab = logits.shape[-1]
        params = [r.params for r in requests]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.stack([r.seen_mask(vocab).clone() for r in requests])  # [B, vocab] bool
            for row, tokens in enumerate(drafted):
                seen[row, tokens] = True  # the drafts before this one count as generated text
        else:
            seen = torch.zeros(len(requests), vocab, dtype=torch.bool)
        sampling = SamplingTensors.from_params(
            params, seen, offsets=positions, seeds=[r.seed for r in requests], device=logits.device
        )
        if all(sampling.greedy_rows):  # the argmax of the penalized logits; no softmax needed
            penalized = logits.float()  # [B, vocab]
            if sampling.any_penalty:
                penalized = apply_repetition_penalty(
                    penalized, sampling.seen, sampling.repetition_penalty
                )
            return penalized.argmax(dim=-1).tolist(), None
        q = processed_probs(logits, sampling)  # [B, vocab] float32; greedy rows one-hot
        tokens = q.argmax(dim=-1)  # [B]: exact for greedy rows, redrawn below for the others
        for row, greedy in enumerate(sampling.greedy_rows):
            if greedy:
                continue
            seed = sampling.seeds_host[row]
            t = positions[row] - requests[row].num_prompt_tokens  # the output index it guesses
            if self.acceptance == "coupled":  # the verifier's own noise at t (randomness.py)
                noise = randomness.exponentials(seed, [t], vocab, q.device)  # [1, vocab]
                tokens[row] = randomness.race_rows(q[row : row + 1], noise)[0]
            else:
                generator = randomness.generator_at(seed, randomness.DRAFT_STREAM, t, q.device)
                tokens[row] = torch.multinomial(q[row], 1, generator=generator)[0]
        return tokens.tolist(), q


def _target_num_blocks(target, ecfg) -> int:
    """The target cache's block count: its engine's when built, else what its budget gives."""
    engine = getattr(target, "engine", None)
    if engine is not None and getattr(engine, "cache", None) is not None:
        return engine.cache.num_blocks
    loaded = target.loaded
    return num_blocks_for_budget(
        loaded.config, ecfg, target.max_model_len, loaded.dtype, loaded.device
    )
