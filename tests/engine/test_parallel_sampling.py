"""Parallel sampling (SamplingParams.n): n samples of one prompt share its KV blocks.

The first sample computes the prompt; the others then share its blocks (one reference more each)
and compute only the prompt's last token, from which each draws with its own stream. The block
that the prompt's last token sits in is shared until a sample writes into it: then that sample gets
a copy (copy-on-write). Sample i's tokens and log-probabilities are those of a lone request seeded
with sample_seed(seed, i) = seed + i, bit for bit: the shared and copied K/V are the right ones.
"""

import random

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.outputs import RequestOutput
from stagewise.errors import StagewiseError
from stagewise.sampling_params import MAX_SAMPLES, sample_seed

CACHES = ["none", "hash", "radix"]


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 250) for _ in range(n)]


def requests_of(llm: LLM, ids: list[int], params: SamplingParams):
    """The n samples of a prompt given as token ids (no text round trip)."""
    first = llm.make_request("x", params)
    first.prompt_token_ids = list(ids)
    return [first, *llm._more_samples(first)]


def run(llm: LLM, requests) -> list[RequestOutput]:
    for _ in llm._stream_requests(requests):
        pass
    return [RequestOutput.of(r) for r in requests]


@pytest.mark.parametrize("cache", CACHES)
def test_four_samples_of_500_tokens_hold_the_prompt_once(tiny, cache):
    llm = LLM(tiny, prefix_cache=cache, engine_config=EngineConfig(max_model_len=600))
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=4, ignore_eos=True)
    samples = requests_of(llm, prompt_ids(500), params)
    engine, bm = llm.engine, llm.engine.block_manager
    for r in samples:
        engine.add(r)
    engine.step()  # the first sample's prefill: 500 tokens, 32 blocks (31 full, 4 tokens in the last)
    assert [len(r.output_token_ids) for r in samples] == [1, 0, 0, 0]
    assert bm.num_held_blocks() == 32
    engine.step()  # the others share those and compute the prompt's last token; the first decodes
    assert [len(r.output_token_ids) for r in samples] == [2, 1, 1, 1]
    rows = [bm.block_ids(r.request_id) for r in samples]
    assert all(row[:31] == rows[0][:31] for row in rows), "the 31 full blocks are shared"
    assert len({row[31] for row in rows}) == 4, "each sample writes into its own copy of the last block"
    assert bm.num_held_blocks() == 35 <= 35  # 31 full blocks once, plus one partial block each
    assert bm.stats.forked_tokens == 3 * 499
    while engine.has_unfinished():
        engine.step()


def test_sample_i_is_a_lone_request_seeded_seed_plus_i(tiny):
    """Bitwise: the shared prompt blocks and the copied last block hold the right K/V."""
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(max_model_len=256))
    ids = prompt_ids(70)  # 4 full blocks and 6 tokens: the copied block holds 5 of the prompt's
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=11, n=3, logprobs=4, ignore_eos=True)
    outs = run(llm, requests_of(llm, ids, params))
    assert len({tuple(o.token_ids) for o in outs}) > 1, "samples with their own streams should differ"
    nocache = LLM(tiny, prefix_cache="none", engine_config=EngineConfig(max_model_len=256))
    for i, out in enumerate(outs):
        one = SamplingParams(
            max_tokens=6, temperature=0.9, top_k=40, seed=sample_seed(11, i), logprobs=4, ignore_eos=True
        )
        (alone,) = run(nocache, requests_of(nocache, ids, one))
        assert out.token_ids == alone.token_ids, f"sample {i}"
        assert torch.equal(out.logprobs.values, alone.logprobs.values), f"sample {i}: logprobs differ"


def test_generate_returns_one_output_per_prompt_with_its_samples(tiny):
    llm = LLM(tiny)
    prompts = ["the cat sat on the mat and then", "a dog ran"]
    params = [SamplingParams(max_tokens=4, temperature=0, n=3, ignore_eos=True), SamplingParams(max_tokens=5, n=1)]
    outs = llm.generate(prompts, params)
    assert len(outs) == 2 and [len(o.samples) for o in outs] == [3, 1]
    greedy = outs[0].samples
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids == outs[0].token_ids
    assert len({s.request_id for s in greedy}) == 3
    assert outs[1].samples[0].token_ids == outs[1].token_ids
    events = list(llm.stream(prompts[:1], SamplingParams(max_tokens=2, temperature=0, n=2, ignore_eos=True)))
    assert sorted((e.index, e.sample) for e in events) == [(0, 0), (0, 0), (0, 1), (0, 1)]


@pytest.mark.parametrize("mode", ["kv", "naive"])
def test_other_modes_sample_n_times_too(tiny, mode):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=5, n=2, ignore_eos=True)
    paged = LLM(tiny).generate(["the cat sat"], params)[0]
    other = LLM(tiny, mode=mode).generate(["the cat sat"], params)[0]
    assert [s.token_ids for s in other.samples] == [s.token_ids for s in paged.samples]


def test_a_first_sample_that_ends_at_once_leaves_its_prompt_to_the_cache(tiny):
    """max_tokens=1: the first sample is gone before the others run; they find its prompt in the cache."""
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(max_num_seqs=1))
    params = SamplingParams(max_tokens=1, temperature=0, n=3, ignore_eos=True)
    out = llm.generate(["the cat sat on the mat and then ran far away"], params)[0]
    assert len({tuple(s.token_ids) for s in out.samples}) == 1
    assert llm.last_stats.prefix_hit_tokens > 0


def test_n_is_checked_and_must_fit_the_pool(tiny):
    for bad in (0, MAX_SAMPLES + 1, True, 2.0, "2", None):
        with pytest.raises(StagewiseError, match=r"^n must be an int in \[1, 16\]"):
            SamplingParams(n=bad)
    cfg = tiny.config
    block = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32 bytes per block
    llm = LLM(tiny, engine_config=EngineConfig(kv_cache_bytes=8 * block))
    llm.engine.check_fits(llm.make_request("the cat", SamplingParams(max_tokens=40, n=2)))  # 2 x 3 of 8
    with pytest.raises(StagewiseError, match=r"^n=3 samples of .* need 3 x 3 KV blocks, but the cache has 8"):
        llm.generate(["the cat"], SamplingParams(max_tokens=40, n=3))
