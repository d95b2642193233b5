"""Speculative decoding, greedy: the n-gram proposer's output is exactly the plain engine's.

Greedy acceptance keeps a guess only when it is the target's argmax, so any
difference from plain decoding is a bug in the engine around it: a guess's
K/V not rewound, a block past the new end kept, a block of unverified tokens
named in the prefix cache, a verify row's repetition penalty seeing the wrong
tokens, a stop or max_tokens not cut exactly where it is reached.
"""

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "7", "!"]


def repetitive_prompt(rng: random.Random, n: int) -> str:
    """Words with repeats: a phrase said again and again (what prompt lookup feeds on)."""
    phrase = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
    out = []
    while len(out) < n:
        out += phrase if rng.random() < 0.7 else [rng.choice(WORDS)]
    return " ".join(out[:n])


def kv_bytes_for_blocks(tiny, blocks: int, block_size: int) -> int:
    cfg = tiny.config
    return blocks * block_size * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


def ngram(k: int, n_min: int = 1, n_max: int = 3, adaptive: bool = True) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": n_min,
        "prompt_lookup_max": n_max,
        "adaptive": adaptive,
    }


@pytest.fixture(scope="module")
def plain(tiny):
    """Greedy tokens, text, finish reason and every step's log-probabilities (`logprobs=3`) of one
    request on the plain paged engine, cached."""
    llm = LLM(tiny, mode="paged")
    cache = {}

    def run(prompt: str, params: SamplingParams):
        key = (prompt, params.max_tokens, params.stop, params.repetition_penalty)
        if key not in cache:
            out = llm.generate(prompt, dataclasses.replace(params, logprobs=3))[0]
            cache[key] = (out.token_ids, out.text, out.finish_reason, out.logprobs.values)
        return cache[key]

    return run


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks still held after the run"
    assert not bm.req_blocks
    assert not llm.engine.cache.row_of


def test_copying_workload_accepts_and_rejects_and_matches_plain(tiny, plain):
    """A fixed workload under a tight budget and a small cache: chunks, preemptions, guesses
    kept and guesses thrown away, and every token as without speculation."""
    rng = random.Random(3)
    prompts = [repetitive_prompt(rng, n) for n in (40, 12, 70, 25, 5, 33)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=3) for m in (30, 24, 17, 40, 9, 28)]
    ecfg = EngineConfig(
        max_num_seqs=4,
        max_num_batched_tokens=20,
        block_size=16,
        kv_cache_bytes=kv_bytes_for_blocks(tiny, 12, 16),
    )
    llm = LLM(tiny, mode="paged", engine_config=ecfg, speculative_config=ngram(4))
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == plain(prompt, p)[0], prompt
        # batch invariance: a row verified among k + 1 has the logits it has decoded alone
        assert torch.equal(out.logprobs.values, plain(prompt, p)[3]), prompt
    stats = llm.last_stats
    assert stats.spec_draft_tokens > 0, "nothing was proposed"
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, "want kept and rejected guesses"
    assert stats.preemptions > 0, "the KV budget was meant to force preemption"
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.spec_accepted_tokens
    assert_all_blocks_free(llm)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    outs=st.lists(st.integers(1, 24), min_size=4, max_size=4),
    k=st.integers(1, 5),
    n_max=st.integers(1, 4),
    budget=st.integers(3, 48),
    max_num_seqs=st.integers(1, 4),
    spare=st.integers(0, 4),
    block_size=st.sampled_from([4, 16]),
    prefix_caching=st.booleans(),
    penalty=st.sampled_from([1.0, 1.0, 1.3]),
    stop_at=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 1000),
)
def test_random_workloads_match_plain(
    tiny,
    plain,
    lens,
    outs,
    k,
    n_max,
    budget,
    max_num_seqs,
    spare,
    block_size,
    prefix_caching,
    penalty,
    stop_at,
    seed,
):
    rng = random.Random(seed)
    shared = repetitive_prompt(rng, 40)
    prompts = [
        shared[: rng.randrange(len(shared))] + " " + repetitive_prompt(rng, n)
        if rng.random() < 0.4
        else repetitive_prompt(rng, n)
        for n in lens
    ]
    params = []
    for prompt, m in zip(prompts, outs):
        p = SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, repetition_penalty=penalty)
        if stop_at is not None:  # a stop string from the plain text: a cut inside a verify step
            text = plain(prompt, p)[1]
            piece = text[stop_at : stop_at + 3]
            if piece.strip():
                p = SamplingParams(
                    max_tokens=m,
                    temperature=0,
                    ignore_eos=True,
                    repetition_penalty=penalty,
                    stop=(piece,),
                )
        params.append(p)
    lengths = [len(tiny.tokenizer.encode(p)) + 1 for p in prompts]
    need = max(-(-(n + m) // block_size) for n, m in zip(lengths, outs))
    ecfg = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        kv_cache_bytes=kv_bytes_for_blocks(tiny, need + spare, block_size),
        enable_prefix_caching=prefix_caching,
    )
    llm = LLM(tiny, mode="paged", engine_config=ecfg, speculative_config=ngram(k, 1, n_max))
    params = [dataclasses.replace(p, logprobs=3) for p in params]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params)):
        tokens, text, reason, logprobs = plain(prompt, p)
        assert out.token_ids == tokens, (prompt, p)
        assert out.text == text and out.finish_reason == reason
        assert torch.equal(out.logprobs.values, logprobs), (prompt, p)  # the same bits, step by step
    assert_all_blocks_free(llm)


def test_streaming_delivers_several_tokens_per_step_and_ends_once(tiny, plain):
    rng = random.Random(5)
    prompt = repetitive_prompt(rng, 30)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    llm = LLM(tiny, mode="paged", speculative_config=ngram(4, adaptive=False))
    events = list(llm.stream(prompt, params))
    assert [e.token_id for e in events] == plain(prompt, params)[0]
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason == "length"
    assert llm.last_stats.steps < len(events), "no step delivered more than one token"
    assert_all_blocks_free(llm)


def test_prefix_cache_names_only_verified_blocks(tiny):
    """After every step, each named block holds exactly the tokens its hash says (verified ones)."""
    rng = random.Random(8)
    llm = LLM(
        tiny,
        mode="paged",
        engine_config=EngineConfig(block_size=4),
        speculative_config=ngram(5, adaptive=False),
    )
    engine, bm = llm.engine, llm.engine.block_manager
    for _ in range(3):
        llm.add_request(repetitive_prompt(rng, 20), SamplingParams(max_tokens=25, temperature=0))
    while llm.has_unfinished_requests():
        llm.step()
        for req in engine.scheduler.running:
            hashes = bm.block_hashes(req.all_token_ids[: req.num_computed_tokens])
            owned = bm.block_ids(req.request_id)
            for i, h in enumerate(hashes):
                named = bm.blocks[owned[i]].block_hash
                assert named in (None, h), "a block is named for tokens it does not hold"
            for b in owned[len(hashes) :]:
                assert bm.blocks[b].block_hash is None, "a block with unverified tokens is named"
            assert len(owned) <= bm.blocks_needed(req.num_tokens), "blocks past the end kept"
    assert llm.last_stats.spec_accepted_tokens > 0
    assert_all_blocks_free(llm)
