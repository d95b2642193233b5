"""Property-based tests of the block manager and scheduler, with a model-free fake step.

The fake step does what the real runner does to the cache — write each
scheduled token's "K/V" into its slot, then read every position of every
scheduled sequence back through the block table — but the K/V of a token is
the tuple of token ids up to it (what real K/V depend on). So a read that
returns the wrong content means a request would attend to someone else's or
stale keys.
"""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.engine.request import Request, RequestStatus
from stagewise.engine.scheduler import Scheduler
from stagewise.engine.text_stream import TextStream
from stagewise.kv.block_manager import BlockManager
from stagewise.sampling_params import SamplingParams
from tests.kv.radix_invariants import check_tree


def make_request(i: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt="",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0),
        seed=0,
        text_stream=TextStream(decode=lambda ids: ""),
    )


def cache_refs(bm: BlockManager) -> list[int]:
    """References the prefix cache holds on each block (the radix tree: one per node listing it)."""
    refs = [0] * bm.num_blocks
    for node in getattr(bm.prefixes, "nodes", list)():
        for b in node.blocks:
            refs[b] += 1
    return refs


def check_block_invariants(bm: BlockManager, running: list[Request]) -> None:
    refs = cache_refs(bm)
    for req in running:
        for b in bm.block_ids(req.request_id):
            refs[b] += 1
    assert [blk.ref_count for blk in bm.blocks] == refs, "reference counts disagree with the owners"
    free = list(bm.free_queue)
    assert len(free) == len(set(free)), "a block is in the free queue twice"
    assert all(bm.blocks[b].ref_count == 0 for b in free), "a referenced block is in the free queue"
    assert len(free) + sum(1 for r in refs if r > 0) == bm.num_blocks, "a block leaked"
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h


workloads = st.lists(
    st.tuples(st.integers(1, 70), st.integers(1, 12), st.integers(0, 3)),  # prompt len, max_tokens, prefix family
    min_size=1,
    max_size=10,
)


@settings(max_examples=300, deadline=None)
@given(
    workload=workloads,
    block_size=st.sampled_from([4, 16]),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 64),
    prefill_cap=st.one_of(st.none(), st.integers(1, 24)),
    spare_blocks=st.integers(0, 12),
    prefix_caching=st.sampled_from(["none", "hash", "radix"]),
    seed=st.integers(0, 1000),
    fail_steps=st.booleans(),
)
def test_scheduler_and_block_manager_invariants(
    workload, block_size, max_num_seqs, budget, prefill_cap, spare_blocks, prefix_caching, seed, fail_steps
):
    args = (workload, block_size, max_num_seqs, budget, prefill_cap, spare_blocks, prefix_caching, seed)
    run_workload(*args, fail_steps=fail_steps)


def run_workload(
    workload,
    block_size,
    max_num_seqs,
    budget,
    prefill_cap,
    spare_blocks,
    prefix_caching,
    seed,
    vocab: int = 50,
    fail_steps: bool = False,
) -> int:
    """Schedule `workload` to its end through the fake step, checking every step; -> prefix-hit tokens.

    Token ids are drawn from range(vocab): a small vocab repeats blocks within and across prompts.
    `prefix_caching`: True / False (the hash cache, or none) or a design: "hash", "radix", "none".
    `fail_steps`: one step in ten, five at most, fails before its forward pass writes anything
    (recovered as the engine recovers an interrupted step: every running request back to waiting).
    """
    kind = prefix_caching if isinstance(prefix_caching, str) else "hash" if prefix_caching else "none"
    rng = random.Random(seed)
    families = [[rng.randrange(vocab) for _ in range(64)] for _ in range(4)]  # shared prefixes
    requests = []
    for i, (plen, max_tokens, fam, *samples) in enumerate(workload):  # samples: n (parallel sampling)
        shared = rng.randrange(plen + 1)
        prompt = families[fam][:shared] + [rng.randrange(vocab) for _ in range(plen - shared)]
        first = make_request(i, prompt[:plen] or [1], max_tokens)
        requests.append(first)
        for k in range(1, samples[0] if samples else 1):  # they share the first sample's prompt
            requests.append(make_request(f"{i}.{k}", first.prompt_token_ids, max_tokens))
            requests[-1].fork_of, requests[-1].sample_index = first, k
    max_len = max(r.num_prompt_tokens + r.params.max_tokens for r in requests)
    num_blocks = -(-max_len // block_size) + spare_blocks  # the largest request always fits alone
    bm = BlockManager(num_blocks, block_size, prefix_cache=kind)
    sched = Scheduler(bm, max_num_seqs, budget, prefill_cap)
    for r in requests:
        sched.add(r)
    cache: dict[int, tuple] = {}  # slot -> content ("K/V") written there
    failures = 0  # steps failed on purpose (a few: every request sent back each time)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        decoding_before = {r.request_id for r in sched.running if r.num_tokens - r.num_computed_tokens == 1}
        out = sched.schedule()
        assert out.scheduled, "no progress"
        prompt_tokens = sum(s.num_new_tokens for s in out.scheduled if s.request.request_id not in decoding_before)
        if decoding_before and prefill_cap is not None and not out.preempted:  # prompts beside decodes: capped
            assert prompt_tokens <= prefill_cap
        if decoding_before and not out.preempted:  # decode first: every decoding request runs
            assert decoding_before <= {s.request.request_id for s in out.scheduled}
        assert len(sched.running) <= max_num_seqs  # constraint 1
        assert out.num_tokens <= budget  # constraint 2
        check_block_invariants(bm, sched.running)
        if kind == "radix":
            check_tree(bm, {r.request_id for r in sched.running})
        for s in out.scheduled:
            req = s.request
            assert req.status == RequestStatus.RUNNING
            assert req.num_computed_tokens + s.num_new_tokens <= req.num_tokens <= max_len  # constraint 3
            assert s.num_new_tokens > 0
            blocks = bm.block_ids(req.request_id)
            assert len(blocks) * block_size >= req.num_computed_tokens + s.num_new_tokens  # constraint 4
        if fail_steps and failures < 5 and rng.random() < 0.1:  # the forward pass raised: nothing written
            failures += 1
            sched.recover_interrupted_step()
            check_block_invariants(bm, sched.running)
            if kind == "radix":
                check_tree(bm, set(), cache)
            continue
        # who already relies on which slot: (slot -> content) for positions computed before this step
        relied = {}
        for req in sched.running:
            blocks = bm.block_ids(req.request_id)
            for p in range(req.num_computed_tokens):
                relied[blocks[p // block_size] * block_size + p % block_size] = tuple(req.all_token_ids[: p + 1])
        # copy-on-write: the step copies shared blocks first (each source as the step began)
        before = dict(cache)
        for dst, src in bm.copies.items():
            for off in range(block_size):
                cache.pop(dst * block_size + off, None)
                if src * block_size + off in before:
                    cache[dst * block_size + off] = before[src * block_size + off]
        # writes: every scheduled token's K/V into its slot
        for s in out.scheduled:
            req, blocks = s.request, bm.block_ids(s.request.request_id)
            for p in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
                slot = blocks[p // block_size] * block_size + p % block_size
                content = tuple(req.all_token_ids[: p + 1])
                if slot in relied:
                    assert relied[slot] == content, "a block another request relies on was overwritten"
                cache[slot] = content
        # reads: every position of every scheduled sequence sees its own prefix
        for s in out.scheduled:
            req, blocks = s.request, bm.block_ids(s.request.request_id)
            for p in range(req.num_computed_tokens + s.num_new_tokens):
                slot = blocks[p // block_size] * block_size + p % block_size
                assert cache.get(slot) == tuple(req.all_token_ids[: p + 1]), f"{req.request_id} reads wrong K/V at {p}"
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        for s in out.scheduled:
            if s.samples:
                req = s.request
                req.output_token_ids.append(rng.randrange(vocab))
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req)
        check_block_invariants(bm, sched.running)
        if kind == "radix":
            check_tree(bm, {r.request_id for r in sched.running}, cache)
    assert not sched.has_unfinished(), "some request never finished"
    assert all(r.status == RequestStatus.FINISHED for r in requests)
    assert not bm.req_blocks, "a finished request still holds blocks"
    bm.prefixes.evict(num_blocks)  # the radix tree keeps finished requests' blocks until evicted
    assert bm.num_free_blocks == num_blocks, "blocks leaked after all requests finished"
    assert all(b.ref_count == 0 for b in bm.blocks)
    return bm.stats.hit_tokens
