"""The radix prefix cache: token-granular matches, copy-on-write, locks, LRU eviction, no leaks.

The block manager alone (no model): requests are admitted, grown and freed as the scheduler does,
and after every operation the tree's invariants hold (tests/kv/radix_invariants.py).
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.config import PRESETS
from stagewise.engine.request import Request
from stagewise.engine.scheduler import Scheduler
from stagewise.engine.text_stream import TextStream
from stagewise.kv.block_manager import BlockManager
from stagewise.kv.paged import PagedKVCache, PagedKVStep
from stagewise.sampling_params import SamplingParams
from tests.kv.radix_invariants import check_tree

BS = 4


def admit(bm: BlockManager, rid: str, prompt: list[int]):
    """Admit a request in a step of its own, as the scheduler does: look it up, allocate the rest,
    name its whole blocks."""
    bm.begin_step()
    hit = bm.match_prefix(prompt)
    assert bm.allocate(rid, 0, len(prompt) - hit.num_tokens, cached_prefix=hit)
    bm.register_full_blocks(rid, prompt, len(prompt))
    return hit


def leave(bm: BlockManager, rid: str, tokens: list[int]) -> None:
    """The request finished: all but its last token have K/V, and the cache keeps them."""
    bm.free(rid, tokens, len(tokens) - 1)


def test_a_match_ends_at_the_first_different_token_not_at_a_block_boundary():
    first = list(range(100, 120))  # 20 tokens: 5 blocks of 4
    for kind, reused in (("hash", 16), ("radix", 18)):
        bm = BlockManager(32, BS, prefix_cache=kind)
        admit(bm, "a", first)
        leave(bm, "a", first + [7])  # its 20 prompt tokens have K/V
        bm.begin_step()  # the next step looks the new prompt up
        hit = bm.match_prefix(first[:18] + [1, 2, 3])  # the same first 18 tokens
        assert hit.num_tokens == reused, kind
        assert len(hit.blocks) == -(-reused // BS)


def test_a_hit_inside_a_block_is_copied_before_it_is_written():
    bm = BlockManager(32, BS, prefix_cache="radix")
    a = list(range(10, 20))  # blocks: [10..13] [14..17] [18, 19]
    admit(bm, "a", a)
    leave(bm, "a", a + [5])
    b = a[:6] + [99, 98]  # shares 6 tokens: one whole block and two tokens of the second
    hit = admit(bm, "b", b)
    assert hit.num_tokens == 6 and len(hit.blocks) == 2
    row = bm.block_ids("b")
    assert row[0] == hit.blocks[0], "a whole block is shared"
    assert row[1] != hit.blocks[1] and bm.copies == {row[1]: hit.blocks[1]}, "the partial block is copied"
    assert bm.blocks[hit.blocks[1]].ref_count == 1, "the tree still holds the original"
    check_tree(bm, {"b"})


def test_eviction_takes_least_recently_used_leaves_and_never_a_locked_path():
    bm = BlockManager(8, BS, prefix_cache="radix")
    old, mid, busy = [1] * 8, [2] * 8, [3] * 8  # two blocks each
    for rid, tokens in (("old", old), ("mid", mid)):
        admit(bm, rid, tokens)
        leave(bm, rid, tokens + [0])
    admit(bm, "busy", busy)  # running: its path is locked
    assert bm.num_free_blocks == 2
    bm.begin_step()
    assert bm.prefixes.evict(1) == 2  # the least recently used leaf goes whole: "old"
    assert bm.match_prefix(old + [0]).num_tokens == 0 and bm.match_prefix(mid + [0]).num_tokens == 8
    assert bm.prefixes.evict(100) == 2  # then "mid"; "busy" is in use
    assert bm.match_prefix(busy + [0]).num_tokens == 8
    check_tree(bm, {"busy"})


def test_a_failed_step_forgets_what_it_inserted():
    bm = BlockManager(16, BS, prefix_cache="radix")
    admit(bm, "a", list(range(10)))
    assert bm.match_prefix(list(range(12))).num_tokens == 8  # named while scheduled
    bm.forget_names_of_step()  # its forward pass did not complete
    assert bm.match_prefix(list(range(12))).num_tokens == 0
    bm.free("a")
    assert bm.num_free_blocks == 16


def test_the_block_copy_moves_k_and_v_of_every_layer():
    cfg = PRESETS["tiny"]
    cache = PagedKVCache(cfg, 6, BS, 2, 32, torch.float32, torch.device("cpu"))
    cache.kv.copy_(torch.randn_like(cache.kv))
    before = cache.kv.clone()
    step = PagedKVStep(cache=cache, metadata=None, block_copies=((1, 4), (2, 5)))
    for layer in range(cfg.num_layers):
        step.copy_blocks(layer)
    assert torch.equal(cache.kv[:, :, 4], before[:, :, 1]) and torch.equal(cache.kv[:, :, 5], before[:, :, 2])
    assert torch.equal(cache.kv[:, :, :4], before[:, :, :4])


# ---- random sequences of operations ----

ops = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "finish", "preempt", "evict"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), block_size=st.sampled_from([2, 4]))
def test_tree_invariants_under_random_insert_match_evict_preempt(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size, prefix_cache="radix")
    rng, running = random.Random(0), {}  # request id -> its tokens (K/V computed for all but none)
    families = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    for i, (op, r) in enumerate(ops):
        bm.begin_step()
        if op == "admit" or not running:
            tokens = families[r % 3][: 1 + r % 17] + [r % 5] * (r % 3)
            hit = bm.match_prefix(tokens)
            if bm.allocate(f"r{i}", 0, len(tokens) - hit.num_tokens, cached_prefix=hit):
                bm.register_full_blocks(f"r{i}", tokens, len(tokens))
                running[f"r{i}"] = tokens
        elif op == "grow":
            rid = sorted(running)[r % len(running)]
            tokens = running[rid]
            if bm.allocate(rid, len(tokens), 1):
                tokens.append(r % 4)
                bm.register_full_blocks(rid, tokens, len(tokens))
        elif op in ("finish", "preempt"):
            rid = sorted(running)[r % len(running)]
            tokens = running.pop(rid)
            bm.free(rid, tokens, len(tokens) - (op == "finish"))
        else:
            bm.prefixes.evict(1 + r % num_blocks)
        check_tree(bm, set(running))
    for rid, tokens in running.items():
        bm.free(rid, tokens, len(tokens))
    bm.prefixes.evict(num_blocks)
    assert bm.num_free_blocks == num_blocks and not bm.prefixes.nodes()


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_no_block_leaked_after_1000_mixed_requests(kind):
    """The scheduler and the block manager alone: shared prefixes, parallel samples, a pool small
    enough to preempt, aborted requests; at the end every block is free (the tree's once evicted)."""
    rng = random.Random(1)
    bm = BlockManager(16, 8, prefix_cache=kind)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=48)
    heads = [[rng.randrange(50) for _ in range(40)] for _ in range(4)]
    made, steps = 0, 0
    while made < 1000 or sched.has_unfinished():
        while made < 1000 and len(sched.waiting) < 4:
            prompt = rng.choice(heads)[: rng.randrange(1, 40)] + [rng.randrange(50) for _ in range(rng.randrange(4))]
            params = SamplingParams(max_tokens=rng.randrange(1, 12), n=rng.choice([1, 1, 1, 3]))
            first = make(f"q{made}", prompt, params)
            sched.add(first)
            for k in range(1, params.n):
                sched.add(make(f"q{made}.{k}", prompt, params, fork_of=first, sample_index=k))
            made += 1
        out = sched.schedule()
        steps += 1
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        for s in out.scheduled:
            req = s.request
            if s.samples and not req.finished:
                req.output_token_ids.append(rng.randrange(50))
                if len(req.output_token_ids) >= req.params.max_tokens:
                    sched.finish(req)
        if sched.running and rng.random() < 0.02:
            sched.abort(rng.choice(sched.running))  # a stream closed early
    assert made == 1000 and sched.num_preemptions > 0 and bm.stats.hit_tokens > 0
    assert not bm.req_blocks
    bm.prefixes.evict(bm.num_blocks)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def make(rid: str, prompt: list[int], params: SamplingParams, **kw) -> Request:
    text = TextStream(decode=lambda ids: "")
    return Request(rid, "", list(prompt), params, seed=0, text_stream=text, **kw)
