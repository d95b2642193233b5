"""Prefix-cache identity: a block's name (a chained SHA-256 digest) is only where to look; every hit
is checked against the token ids and the parent the block was named with. With the digest replaced
by a constant (every block collides with every other) no request reads K/V of another prefix, and
equal prompts still find their first block."""

import hashlib
from array import array

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.kv import hash_cache
from stagewise.kv.block_manager import BlockManager, block_digest
from tests.engine.test_scheduler_properties import run_workload

COLLIDING = bytes(32)


@pytest.fixture
def constant_digest(monkeypatch):
    """Every block of every prompt gets the same name."""
    monkeypatch.setattr(hash_cache, "block_digest", lambda parent, token_ids: COLLIDING)


@pytest.fixture
def parent_blind_digest(monkeypatch):
    """A block's name covers its own tokens only: equal blocks after different prefixes collide."""
    monkeypatch.setattr(hash_cache, "block_digest", lambda parent, token_ids: bytes(array("q", token_ids)))


def _admit(bm: BlockManager, rid: str, prompt: list[int]) -> list[int]:
    """Admit a request as the scheduler does (cached prefix, then the rest); -> its hits."""
    hits = bm.find_cached_prefix(prompt)
    assert bm.allocate(rid, 0, len(prompt) - len(hits) * bm.block_size, cached_prefix=hits)
    bm.register_full_blocks(rid, prompt, len(prompt))
    return hits


def test_the_digest_is_sha256_of_the_parent_digest_and_the_token_ids():
    first = block_digest(None, [1, 2, 3, 4])
    assert first == hashlib.sha256(bytes(32) + array("q", [1, 2, 3, 4]).tobytes()).digest()
    second = block_digest(first, [5, 6, 7, 8])
    assert second == hashlib.sha256(first + array("q", [5, 6, 7, 8]).tobytes()).digest()
    assert block_digest(second, [1, 2, 3, 4]) != first  # the same tokens after another prefix
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [first, second]


def test_a_constant_digest_shares_no_block_between_different_prompts(constant_digest):
    bm = BlockManager(num_blocks=32, block_size=4)
    _admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 9]) == []  # another first block
    # the same first block twice: only position 0 holds those K/V
    assert bm.find_cached_prefix([1, 2, 3, 4, 1, 2, 3, 4, 9]) == bm.block_ids("a")[:1]
    _admit(bm, "b", [7] * 13)
    bm.free("a")  # "a"'s blocks stay named in the free queue
    assert bm.find_cached_prefix([7] * 13) == []  # the one name is still "a"'s first block
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == [0]  # equal prompts still hit


def test_a_block_is_found_only_after_the_prefix_it_was_computed_after(parent_blind_digest):
    bm = BlockManager(num_blocks=32, block_size=4)
    _admit(bm, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    a0, a1, _ = bm.block_ids("a")
    assert bm.find_cached_prefix([5, 6, 7, 8, 5, 6, 7, 8, 0]) == []  # [5 6 7 8] sits at position 4 only
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1]) == [a0, a1]
    assert bm.find_cached_prefix([9, 9, 9, 9, 5, 6, 7, 8, 1]) == []


@pytest.mark.parametrize("vocab", [1, 3, 50])
def test_scheduled_workloads_under_a_constant_digest_read_only_their_own_kv(constant_digest, vocab):
    """The fake step of test_scheduler_properties (a slot's "K/V" is the token prefix that wrote it),
    every block named alike: each read still sees its own prefix. vocab 1: every block of every
    prompt holds the same tokens, only their positions differ."""
    hits = 0
    for seed in range(12):
        workload = [(20 + seed, 6, seed % 2), (33, 4, seed % 2), (9, 8, 0), (40, 3, 1), (17, 5, 0)]
        hits += run_workload(workload, 4, 3, 24, None, 6, True, seed, vocab=vocab)
    assert hits > 0, "equal prefixes should still hit"


def test_the_engine_under_a_constant_digest_answers_as_without_the_cache(tiny, constant_digest):
    config = dict(block_size=4, max_num_seqs=4)
    on = LLM(tiny, mode="paged", engine_config=EngineConfig(**config))
    off = LLM(tiny, mode="paged", engine_config=EngineConfig(**config, enable_prefix_caching=False))
    prompts = ["the cat sat on the mat and then", "the cat sat on the mat and so", "a dog ran far away from it"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for p in prompts + prompts[:1]:  # one at a time: each finds what the earlier ones left
        assert on.generate([p], params)[0].token_ids == off.generate([p], params)[0].token_ids, p
    assert on.engine.block_manager.stats.hit_tokens > 0, "equal prompts should still hit their first block"
