"""The radix prefix cache in the engine: the same tokens as without a cache wherever it reuses K/V.

Same-step sharing, preemption (a preempted request's tokens stay in the tree and are found again
when it resumes), speculative decoding, a step whose forward pass raised, a failing request, and
what the trace records of each request's reused tokens.
"""

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.outputs import RequestFailed
from stagewise.engine.snapshot import engine_snapshot
from stagewise.errors import StagewiseError
from stagewise.trace import Tracer
from tests.engine.test_reliability_requests import poisoned

PROMPTS = ["the cat sat on the mat and then ran far away quickly", "the cat sat on the mat and so", "a dog"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    return [o.token_ids for o in LLM(tiny, prefix_cache="none").generate(PROMPTS, GREEDY)]


def test_radix_equals_no_cache_alone_together_and_after_preemption(tiny, reference):
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(block_size=4, num_kv_blocks=12))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference  # together: one step
    assert llm.last_stats.preemptions > 0, "12 blocks of 4 were meant to force preemption"
    hits = 0
    for prompt, ref in zip(PROMPTS, reference):  # one at a time: each finds what the pool still keeps
        assert llm.generate([prompt], GREEDY)[0].token_ids == ref
        hits += llm.last_stats.prefix_hit_tokens
    assert hits > 0
    again = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert again.token_ids[:8] == reference[0]  # its answer was kept: the prompt + answer match


def test_radix_with_speculative_decoding(tiny, reference):
    llm = LLM(tiny, prefix_cache="radix", speculative_config="ngram:3")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert [o.token_ids for o in llm.generate(PROMPTS[1:], GREEDY)] == reference[1:]  # on the tree


def test_a_step_that_raised_is_forgotten(tiny, reference, monkeypatch):
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(block_size=4))
    real, calls = llm.model.forward, []

    def forward(batch, kv):
        calls.append(1)
        if len(calls) == 2:  # the second step: its blocks were named, its K/V never written
            raise KeyboardInterrupt
        return real(batch, kv)

    monkeypatch.setattr(llm.model, "forward", forward)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_failing_request_leaves_the_others_their_tokens(tiny, reference):
    llm = LLM(tiny, prefix_cache="radix")
    bad = poisoned(SamplingParams(max_tokens=10, temperature=0.5))  # every step with it raises
    with pytest.raises(RequestFailed):
        llm.generate(PROMPTS, [GREEDY, bad, GREEDY])
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_the_trace_records_each_requests_reused_tokens(tiny):
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(block_size=4))
    llm.generate([PROMPTS[0]], GREEDY)
    with Tracer() as tracer:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, n=2, ignore_eos=True))
    first = tracer.steps[0].requests[0]
    assert first["reused_from"] == "radix" and first["reused_tokens"] == len(llm.encode(PROMPTS[0])) - 1
    forked = [r for step in tracer.steps for r in step.requests if r.get("reused_from") == "fork"]
    assert len(forked) == 1 and forked[0]["reused_tokens"] == first["reused_tokens"]
    assert tracer.model["prefix_cache"] == "radix"


def test_unknown_prefix_cache_is_one_line(tiny):
    for value in ("lru", "", None.__class__.__name__, 1):
        with pytest.raises(StagewiseError, match=r"^unknown prefix_cache .*; use one of hash, radix, none$"):
            LLM(tiny, prefix_cache=value)
    with pytest.raises(StagewiseError, match="enable_prefix_caching=False"):
        LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(enable_prefix_caching=False))
    with pytest.raises(StagewiseError, match="^unknown prefix_cache"):
        EngineConfig(prefix_cache="tree")


def test_the_view_marks_shared_blocks_and_the_cache_in_use(tiny):
    llm = LLM(tiny, prefix_cache="radix", engine_config=EngineConfig(block_size=4))
    llm.generate([PROMPTS[0]], GREEDY)  # its blocks stay in the tree
    snap = engine_snapshot(llm.engine, step_index=0, step_stats=None, now=0.0)
    kv = snap["kv"]
    assert kv["prefix_cache"] == "radix" and not kv["shared"]
    assert kv["cached"] and len(kv["cached"]) == kv["num_used"], "no request runs: the tree holds every used block"
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, n=2, ignore_eos=True))
    llm.step()
    llm.step()  # the first sample found the prompt in the tree; the second shares its blocks
    kv = engine_snapshot(llm.engine, step_index=2, step_stats=None, now=0.0)["kv"]
    rows = [llm.engine.block_manager.block_ids(r.request_id) for r in llm.engine.scheduler.running]
    assert len(rows) == 2 and kv["shared"] == sorted(set(rows[0]) & set(rows[1]))
    assert snap["counters"]["prefix_hit_tokens"] == 0
