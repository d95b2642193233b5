"""Speculative decoding under tensor parallelism (2 ranks, gloo on a CPU): the verify step is an
ordinary forward of 1 + k rows per request, so the ranks need nothing new."""

import random

from stagewise import LLM, SamplingParams
from tests.engine.test_spec_greedy import ngram, repetitive_prompt


def test_tp2_speculative_greedy_equals_tp2_plain(tiny):
    rng = random.Random(9)
    prompts = [repetitive_prompt(rng, n) for n in (20, 9, 31)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(tiny, tensor_parallel_size=2) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(tiny, tensor_parallel_size=2, speculative_config=ngram(3, adaptive=False)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert llm.last_stats.spec_accepted_tokens > 0
