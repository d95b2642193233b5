"""Checks for the systems exercises of notebooks 08-10: the student writes the mechanism.

08 a KV cache: append each new token's K/V, attend its one query against all of them; the tiny
   model, run token by token on the student's cache, must give recompute's greedy tokens.
09 the block allocator: `allocate` and `free` over a free queue, and the prefix-cache lookup;
   each call is made on a copy of a real `BlockManager`'s state along a random trace and must
   make the same decision (which blocks, in which order, or "does not fit").
10 one `schedule()` step: the student's scheduler and the real `Scheduler` run the same random
   workloads side by side, each over its own real block manager; every step must schedule the
   same requests with the same token counts, and leave the same queues.
"""

import random
from collections import deque
from dataclasses import dataclass

import torch

from stagewise.engine.request import Request, RequestStatus
from stagewise.engine.scheduler import Scheduler
from stagewise.engine.text_stream import TextStream
from stagewise.exercises.core import Mismatch, call, close, equal
from stagewise.exercises.engine_checks import tiny_model
from stagewise.kv.block_manager import BlockManager
from stagewise.sampling_params import SamplingParams
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata

# ---------------------------------------------------------------- 08 the KV cache


class _StudentCache:
    """A `KVAccess` for the forward pass: each layer's attention is the student's function.

    Beside it the check keeps its own cache and runs the attention stage's naive path over it,
    so a wrong output or a wrong cache is caught at the layer and step where it happens.
    """

    def __init__(self, fn, cache: list[dict], ref: list[dict]):
        self.fn, self.cache, self.ref, self.step = fn, cache, ref, 0

    def attend(self, ops, layer, q, k, v, scale):  # q [1, H, d], k, v [1, Hkv, d]
        ref = self.ref[layer]
        ref["k"], ref["v"] = torch.cat([ref["k"], k]), torch.cat([ref["v"], v])  # [n, Hkv, d]
        n = ref["k"].shape[0]
        one_query = AttentionMetadata.build([1], [n], "cpu", k_starts=[0, n])
        want = STAGES["attention"].naive(q=q, k=ref["k"], v=ref["v"], metadata=one_query, scale=scale)
        where = f"step {self.step} (position {n - 1}), layer {layer}"
        got = call(self.fn, self.cache, layer, q, k, v, scale)
        close(got, want, f"{where}: attention output", atol=1e-5)
        for name in ("k", "v"):
            close(self.cache[layer][name], ref[name], f"{where}: cache[{layer}][{name!r}]", atol=0, rtol=0)
        return got


def check_cached_attention(fn) -> str:
    """my_cached_attention(cache, layer, q [1, H, d], k [1, Hkv, d], v, scale) -> out [1, H, d].

    The tiny model runs one token per forward pass (the prompt too), so every call brings one
    query; the greedy tokens must equal recompute's (the whole sequence every step, no cache).
    """
    from stagewise.kv.none import NoKVCache
    from stagewise.models.forward_batch import ForwardBatch
    from stagewise.models.llama import LlamaModel
    from stagewise.models.ops import StageOps

    loaded = tiny_model()
    model, cfg = LlamaModel(loaded, StageOps("naive")), loaded.config
    g = torch.Generator().manual_seed(8)
    prompt, new_tokens = torch.randint(0, cfg.vocab_size, (5,), generator=g).tolist(), 6

    def empty():
        return [{n: torch.zeros(0, cfg.num_kv_heads, cfg.head_dim) for n in ("k", "v")} for _ in range(cfg.num_layers)]

    recompute = list(prompt)
    for _ in range(new_tokens):
        batch = ForwardBatch.from_sequences([recompute], [0], "cpu")
        recompute.append(int(model.forward(batch, NoKVCache.of(batch))[0].argmax()))

    kv = _StudentCache(fn, empty(), empty())
    ids = list(prompt)
    for pos in range(len(prompt) + new_tokens - 1):
        kv.step = pos
        logits = model.forward(ForwardBatch.from_sequences([[ids[pos]]], [pos], "cpu"), kv)
        if pos >= len(prompt) - 1:
            ids.append(int(logits[0].argmax()))
    equal(ids, recompute, "greedy tokens (prompt, then generated)")
    return f"{len(ids) - 1} one-token steps x {cfg.num_layers} layers: outputs, cache and tokens equal recompute's"


# ---------------------------------------------------------------- 09 the block allocator


def _state(bm: BlockManager, request_id: str):
    """A copy of what the student's functions work on: free queue, reference counts, a row."""
    return deque(bm.free_queue), [b.ref_count for b in bm.blocks], bm.block_ids(request_id)


def _same_state(bm: BlockManager, free_queue, ref_counts, where: str) -> None:
    equal(list(free_queue), list(bm.free_queue), f"{where}: the free queue afterwards")
    equal(list(ref_counts), [b.ref_count for b in bm.blocks], f"{where}: the reference counts afterwards")


def check_allocate(fn) -> str:
    """my_allocate(free_queue, ref_counts, row, num_tokens, block_size) -> the row, or False."""
    rng = random.Random(9)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    lengths: dict[str, int] = {}  # request id -> tokens its blocks hold
    calls = refused = 0
    for op in range(60):
        if lengths and rng.random() < 0.25:
            bm.free(rng.choice(sorted(lengths)))  # the real free: blocks return to the tail
            lengths = {r: n for r, n in lengths.items() if bm.block_ids(r)}
            continue
        rid = rng.choice(sorted(lengths)) if lengths and rng.random() < 0.6 else f"r{op}"
        have, n = lengths.get(rid, 0), rng.randint(1, 9)
        free_queue, ref_counts, row = _state(bm, rid)
        got = call(fn, free_queue, ref_counts, row, have + n, bm.block_size)
        fits = bm.allocate(rid, have, n)
        where = f"call {calls}: {rid} holding {have} tokens asks for {n} more"
        equal(got, bm.block_ids(rid) if fits else False, where)
        _same_state(bm, free_queue, ref_counts, where)
        equal(row, bm.block_ids(rid), f"{where}: the row afterwards")
        calls, refused = calls + 1, refused + (not fits)
        if fits:
            lengths[rid] = have + n
    return f"{calls} allocations ({refused} refused) agree with BlockManager.allocate"


def _shared_prefix_trace(seed: int):
    """A block manager with prefix caching, requests sharing prompt beginnings; yields each step.

    Yields ("admit", request id, prompt) after a request took its cached prefix and new blocks,
    and ("free", request id, None) before a request is freed.
    """
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=40, block_size=4, enable_prefix_caching=True)
    families = [[rng.randrange(30) for _ in range(24)] for _ in range(2)]
    live: list[str] = []
    for i in range(40):
        if live and (rng.random() < 0.35 or bm.num_free_blocks < 8):
            rid = live.pop(rng.randrange(len(live)))
            yield bm, "free", rid, None
            bm.free(rid)
            continue
        shared = rng.choice([0, 4, 8, 9, 12, 16])
        prompt = families[i % 2][:shared] + [rng.randrange(30) for _ in range(rng.randint(1, 9))]
        hits = bm.find_cached_prefix(prompt)
        if not bm.allocate(f"r{i}", 0, len(prompt) - len(hits) * bm.block_size, cached_prefix=hits):
            continue
        bm.register_full_blocks(f"r{i}", prompt, len(prompt))
        live.append(f"r{i}")
        yield bm, "admit", f"r{i}", prompt


def check_free(fn) -> str:
    """my_free(free_queue, ref_counts, row) -> the block ids that went back to the free queue."""
    frees = shared = 0
    for bm, what, rid, _ in _shared_prefix_trace(seed=10):
        if what != "free":
            continue
        free_queue, ref_counts, row = _state(bm, rid)
        before = len(bm.free_queue)
        shared += any(bm.blocks[b].ref_count > 1 for b in row)
        got = call(fn, free_queue, ref_counts, row)
        bm.free(rid)
        where = f"free {frees}: {rid} holding blocks {bm.block_ids(rid) or row}"
        equal(got, list(bm.free_queue)[before:], f"{where}: blocks returned")
        _same_state(bm, free_queue, ref_counts, where)
        frees += 1
    return f"{frees} frees ({shared} of requests sharing blocks) agree with BlockManager.free"


def check_cached_prefix(fn) -> str:
    """my_cached_prefix(token_ids, block_size, cached) -> block ids of the longest cached prefix."""
    lookups = hits = 0
    for bm, what, _, prompt in _shared_prefix_trace(seed=11):
        if what != "admit":
            continue
        for query in (prompt, prompt[:8], prompt[:9], prompt + [1, 2, 3]):  # 8: a block-multiple
            want = bm.find_cached_prefix(query)
            got = call(fn, list(query), bm.block_size, dict(bm.cached))
            equal(got, want, f"lookup {lookups}: {len(query)} tokens {query[:12]}...")
            lookups, hits = lookups + 1, hits + bool(want)
    return f"{lookups} lookups ({hits} with hits) agree with BlockManager.find_cached_prefix"


# ---------------------------------------------------------------- 10 one schedule() step


@dataclass
class Seq:
    """What the student's scheduler sees of a request."""

    request_id: str
    num_tokens: int  # prompt + output tokens so far
    num_computed_tokens: int = 0  # of those, tokens whose K/V are in the cache


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, "", [1] * prompt_len, params, 0, TextStream(decode=lambda ids: ""))


def check_schedule_step(fn) -> str:
    """my_schedule(running, waiting, budget, max_num_seqs, allocate, free) -> [(request id, tokens)].

    `allocate(seq, n) -> bool` asks the block manager for room for n more tokens of seq;
    `free(seq)` returns its blocks. The student moves Seqs between `running` and `waiting`.
    """
    steps = preemptions = chunks = 0
    for seed in range(4):
        rng = random.Random(seed)
        work = [(f"r{i}", rng.randint(1, 20), rng.randint(1, 8)) for i in range(rng.randint(3, 7))]
        block_size, seats, budget = 4, rng.randint(2, 4), rng.randint(4, 16)
        num_blocks = max(-(-(p + m) // block_size) for _, p, m in work) + rng.randint(0, 3)
        sched = Scheduler(BlockManager(num_blocks, block_size, False), seats, budget)
        mine = BlockManager(num_blocks, block_size, False)
        reqs = {rid: _request(rid, p, m) for rid, p, m in work}
        seqs = {rid: Seq(rid, p) for rid, p, _ in work}
        for rid in reqs:
            sched.add(reqs[rid])
        running, waiting = [], deque(seqs.values())

        def allocate(seq, n, bm=mine):
            return bm.allocate(seq.request_id, seq.num_computed_tokens, n)

        def free(seq, bm=mine):
            bm.free(seq.request_id)

        while sched.has_unfinished():
            out = sched.schedule()
            want = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
            where = f"workload {seed}, step {steps} (budget {budget}, max_num_seqs {seats})"
            got = call(fn, running, waiting, budget, seats, allocate, free)
            equal([tuple(x) for x in got] if isinstance(got, list) else got, want, f"{where}: scheduled")
            for name, mine_q, real_q in (("running", running, sched.running), ("waiting", waiting, sched.waiting)):
                equal([s.request_id for s in mine_q], [r.request_id for r in real_q], f"{where}: {name} afterwards")
            for r in [*sched.running, *sched.waiting]:
                equal(
                    seqs[r.request_id].num_computed_tokens, r.num_computed_tokens, f"{where}: {r.request_id} computed"
                )
            preemptions += len(out.preempted)
            for s in out.scheduled:  # the step's forward pass: K/V written, a token where one is due
                req, seq = s.request, seqs[s.request.request_id]
                chunks += s.num_new_tokens < req.num_tokens - req.num_computed_tokens
                req.num_computed_tokens += s.num_new_tokens
                seq.num_computed_tokens += s.num_new_tokens
                if s.samples:
                    req.output_token_ids.append(1)
                    seq.num_tokens += 1
                    if len(req.output_token_ids) >= req.params.max_tokens:
                        sched.finish(req)
                        running.remove(seq)
                        mine.free(seq.request_id)
            steps += 1
            if steps > 2000:
                raise Mismatch("the workloads did not finish in 2000 steps")
        assert all(r.status == RequestStatus.FINISHED for r in reqs.values())
    return f"{steps} steps of 4 workloads ({chunks} chunked prefills, {preemptions} preemptions) equal Scheduler's"


CHECKS = {
    "08.cached_attention": check_cached_attention,
    "09.allocate": check_allocate,
    "09.free": check_free,
    "09.cached_prefix": check_cached_prefix,
    "10.schedule_step": check_schedule_step,
}
