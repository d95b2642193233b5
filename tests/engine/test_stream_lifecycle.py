"""Streams that stop early, runs interrupted mid-step, and hand-stepping mixed with streams.

After each of them the same `LLM` must be ready again: every KV block free,
and the same greedy tokens as a fresh `LLM` gives.
"""

import gc

import pytest

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.config import EngineConfig

PROMPTS = ["the cat sat on the mat and then ran far away quickly", "a mat", "then ran far away and the cat sat"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy tokens of PROMPTS from an LLM that was never interrupted."""
    return [o.token_ids for o in LLM(tiny, mode="kv").generate(PROMPTS, GREEDY)]


def small_blocks() -> EngineConfig:
    # block_size 4: the first prompt fills several blocks, so prefix caching has names to reuse
    return EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4)


def assert_ready(llm: LLM, reference) -> None:
    """No request left, every block free, and a rerun gives the reference tokens."""
    if llm.engine is not None:
        bm = llm.engine.block_manager
        assert not llm.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} blocks still held"
        assert not bm.req_blocks, bm.req_blocks
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    if llm.engine is not None:
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_break_out_of_a_stream_frees_everything(tiny, reference, mode):
    llm = LLM(tiny, mode=mode, engine_config=small_blocks())
    seen = 0
    for _ in llm.stream(PROMPTS, GREEDY):
        seen += 1
        if seen == 5:
            break
    gc.collect()  # a dropped generator is closed when collected (CPython: at once)
    assert_ready(llm, reference)


def test_explicitly_closed_stream_aborts_its_requests(tiny, reference):
    llm = LLM(tiny, engine_config=small_blocks())
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)
    assert llm.engine.block_manager.num_used_blocks > 0
    stream.close()
    assert_ready(llm, reference)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_exception_raised_inside_the_consumer_loop(tiny, reference, exc):
    llm = LLM(tiny, engine_config=small_blocks())
    with pytest.raises(exc):
        for event in llm.stream(PROMPTS, GREEDY):
            if event.index == 1:
                raise exc("the consumer gave up")
    assert_ready(llm, reference)


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
@pytest.mark.parametrize("at_forward", [1, 4])
def test_keyboard_interrupt_inside_a_forward_pass_of_generate(tiny, reference, mode, at_forward):
    """Ctrl-C lands inside the model (forward call 1 = the first prefill, 4 = mid-decode)."""
    llm = LLM(tiny, mode=mode, engine_config=small_blocks())
    real_forward = llm.model.forward
    calls = 0

    def interrupted_forward(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at_forward:
            raise KeyboardInterrupt
        return real_forward(*args, **kwargs)

    llm.model.forward = interrupted_forward
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    assert calls == at_forward
    llm.model.forward = real_forward
    if mode == "paged" and at_forward == 1:
        # The first step named the prompts' full blocks before writing their K/V, and no K/V was
        # ever written: poison the whole pool, so a rerun that reused one of those names reads NaN.
        llm.engine.cache.kv.fill_(float("nan"))
    assert_ready(llm, reference)


def test_stream_and_add_request_share_the_engine_without_losing_a_token(tiny, reference):
    llm = LLM(tiny, engine_config=small_blocks())
    first = llm.add_request(PROMPTS[0], GREEDY)
    stream = llm.stream(PROMPTS[1:], GREEDY)
    streamed = [next(stream)]  # this runs engine steps: the hand-added request advances too
    stepped = llm.step() + llm.step()  # and these advance the stream's requests
    streamed += list(stream)  # runs to the end of the stream's requests
    while llm.has_unfinished_requests():
        stepped += llm.step()
    assert {e.request_id for e in stepped} == {first}
    assert [e.token_id for e in stepped] == reference[0]
    assert [e.index for e in stepped] == [0] * len(reference[0])
    assert [e.finished for e in stepped] == [False] * (len(reference[0]) - 1) + [True]
    for i in (0, 1):
        assert [e.token_id for e in streamed if e.index == i] == reference[i + 1]
    assert_ready(llm, reference)


def test_generate_while_hand_stepped_requests_run(tiny, reference):
    llm = LLM(tiny, engine_config=small_blocks())
    llm.add_request(PROMPTS[0], GREEDY)
    llm.step()
    outs = llm.generate(PROMPTS[1:], GREEDY)  # no "still running" refusal: they share the engine
    assert [o.token_ids for o in outs] == reference[1:]
    stepped = []
    while llm.has_unfinished_requests():
        stepped += llm.step()
    assert len(stepped) == len(reference[0]) - 1  # the first token came from the first step()
    assert_ready(llm, reference)


def test_two_interleaved_streams_each_get_their_own_tokens(tiny, reference):
    llm = LLM(tiny, engine_config=small_blocks())
    a, b = llm.stream(PROMPTS[:1], GREEDY), llm.stream(PROMPTS[1:], GREEDY)
    got_a, got_b = [], []
    for ea, eb in zip(a, b):
        got_a.append(ea)
        got_b.append(eb)
    got_a += list(a)
    got_b += list(b)
    assert [e.token_id for e in got_a] == reference[0]
    assert [[e.token_id for e in got_b if e.index == i] for i in (0, 1)] == reference[1:]
    assert_ready(llm, reference)


def test_weightless_models_refuse_to_generate():
    llm = LLM("llama-3-8b")
    for call in (lambda: llm.generate("hi"), lambda: next(llm.stream("hi")), lambda: llm.add_request("hi")):
        with pytest.raises(StagewiseError, match="no weights .* can be traced"):
            call()


def test_max_model_len_above_the_model_limit_is_an_error(tiny):
    with pytest.raises(StagewiseError, match=r"max_model_len=5000 is out of range: tiny allows 1\.\.1024"):
        LLM(tiny, engine_config=EngineConfig(max_model_len=5000))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": 3}, "model must be"),
        ({"mode": ["paged"]}, "unknown mode"),
        ({"dtype": "float32"}, "dtype must be a torch.dtype"),
        ({"engine_config": {"max_num_seqs": 2}}, "engine_config must be an EngineConfig"),
        ({"stage_backends": ["attention"]}, "stage_backends must be a dict"),
    ],
)
def test_wrong_python_types_for_llm(tiny, kwargs, message):
    with pytest.raises(StagewiseError, match=message):
        LLM(**{"model": tiny, **kwargs})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3,), "prompts must be a string or a list"),
        ((["hi", 3],), "a prompt must be a string"),
        (("hi", {"max_tokens": 3}), "params must be a SamplingParams"),
        (("hi", None, "yes"), "chat must be True or False"),
    ],
)
def test_wrong_python_types_for_generate(tiny, args, message):
    with pytest.raises(StagewiseError, match=message):
        LLM(tiny, mode="kv").generate(*args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": "4"}, "max_num_seqs must be an int >= 1"),
        ({"block_size": 2.0}, "block_size must be an int >= 1"),
        ({"kv_cache_fraction": "half"}, "kv_cache_fraction must be a number"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
        ({"max_model_len": 0}, "max_model_len must be an int >= 1"),
    ],
)
def test_wrong_python_types_for_engine_config(kwargs, message):
    with pytest.raises(StagewiseError, match=message):
        EngineConfig(**kwargs)
