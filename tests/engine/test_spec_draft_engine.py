"""Speculative decoding with a draft model, in the paged engine: greedy output is the plain one.

Two tiny checkpoints share a vocabulary (tests/engine/spec_models.py): the
target, and a draft whose weights are the target's plus noise, so it agrees
with the target often but not always. Greedy acceptance keeps a guess only
when it is the target's argmax, so any difference from plain decoding is a
bug of the engine around the proposer: the target's cache not rewound past a
rejected guess, blocks past the new end kept, a max_tokens cut missed. (A
draft cache that forgot to rewind would only guess worse; the draft's own
tests catch that.) Every KV block, the target's and the draft's, must be free
at the end.
"""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.kv.paged import kv_bytes_per_token
from stagewise.models.registry import load_model
from tests.engine.spec_models import one_thread, target_and_draft  # noqa: F401 - a fixture

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "7", "!"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the target, loaded; the draft's path): a full-depth draft with 5% noise on its weights."""
    target, draft = target_and_draft(tmp_path_factory.mktemp("spec_pair"), layers=2, noise=0.05)
    return load_model(target, dtype=torch.float32), draft


@pytest.fixture(scope="module")
def plain(pair):
    """Greedy tokens of one request on the plain paged engine, cached."""
    llm = LLM(pair[0])
    cache = {}

    def run(prompt: str, max_tokens: int) -> list[int]:
        if (prompt, max_tokens) not in cache:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            cache[prompt, max_tokens] = llm.generate(prompt, params)[0].token_ids
        return cache[prompt, max_tokens]

    return run


def draft_spec(path: str, k: int) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def kv_bytes_for_blocks(model, blocks: int, block_size: int) -> int:
    return blocks * block_size * kv_bytes_per_token(model.config, torch.float32)


def assert_all_blocks_free(llm: LLM) -> None:
    """The target's blocks and rows, and the draft's, all back on their free lists."""
    proposer = llm.engine.proposer
    for name, bm, cache in [
        ("target", llm.engine.block_manager, llm.engine.cache),
        ("draft", proposer.block_manager, proposer.cache),
    ]:
        assert bm.num_free_blocks == bm.num_blocks, f"{name} KV blocks still held after the run"
        assert not bm.req_blocks and not cache.row_of, name
    assert not proposer.held


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_greedy_with_the_draft_under_chunking_and_preemption_matches_plain(pair, plain):
    target, draft = pair
    rng = random.Random(1)
    prompts = [words(rng, n) for n in (30, 6, 55, 14, 2)]
    max_tokens = [20, 26, 9, 31, 15]
    ecfg = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=20,
        block_size=8,
        kv_cache_bytes=kv_bytes_for_blocks(target, 16, 8),
    )
    llm = LLM(target, engine_config=ecfg, speculative_config=draft_spec(draft, 3))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == plain(prompt, m), prompt
    stats = llm.last_stats
    assert stats.preemptions > 0, "the KV budget was meant to force preemption"
    assert stats.spec_draft_tokens > 0, "the draft proposed nothing"
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, "want kept and thrown guesses"
    assert_all_blocks_free(llm)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 4),
    k=st.integers(1, 4),
    budget=st.sampled_from([12, 24, 256]),
    prefix_caching=st.booleans(),
)
def test_greedy_with_the_draft_matches_plain_on_random_workloads(pair, plain, seed, batch, k, budget, prefix_caching):
    target, draft = pair
    rng = random.Random(seed)
    shared = words(rng, rng.randint(0, 20))  # a common start: prefix-cache hits on the target
    prompts = [(shared + " " + words(rng, rng.randint(1, 25))).strip() for _ in range(batch)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]  # 1: no guess at all
    ecfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching)
    llm = LLM(target, engine_config=ecfg, speculative_config=draft_spec(draft, k))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    for prompt, m, out in zip(prompts, max_tokens, llm.generate(prompts, params)):
        assert out.token_ids == plain(prompt, m), (prompt, m)
    stats = llm.last_stats
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens
    if any(m >= 3 for m in max_tokens):  # a request that decodes past its first token guesses
        assert stats.spec_draft_tokens > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_with_the_draft_is_the_same_alone_or_batched(pair):
    """The draft's draws (a stream per request and position) and the verifier's do not depend on
    the batch: a seeded request's text alone equals its text beside others."""
    target, draft = pair
    llm = LLM(target, speculative_config=draft_spec(draft, 3))
    prompts = ["the cat sat", "a mat and then", "7 ! 7 far"]
    params = [
        SamplingParams(max_tokens=14, temperature=1.0, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=12, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.2, repetition_penalty=1.3, seed=13),
    ]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    together = [out.token_ids for out in llm.generate(prompts, params)]
    assert together == alone
    assert llm.last_stats.spec_draft_tokens > 0
    assert_all_blocks_free(llm)
