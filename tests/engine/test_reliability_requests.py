"""One bad request cannot wedge the shared engine (issue 23, case 1).

A value that cannot become its device dtype is refused when the params are built; and a
request whose engine step still fails is finished with an error and removed, while the
other requests in the engine carry on with the tokens they get alone.
"""

import sys

import pytest

from stagewise import LLM, SamplingParams, StagewiseError, cli
from stagewise.config import EngineConfig
from stagewise.engine.outputs import RequestFailed

PROMPTS = ["the cat sat on the mat and then ran far away quickly", "a mat", "then ran far away and the cat sat"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy tokens of PROMPTS, each run by itself on an LLM that never saw a failure."""
    llm = LLM(tiny, mode="kv")
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=10**20), dict(top_k=2**63), dict(max_tokens=2**63), dict(seed=2**63), dict(seed=-(2**63) - 1)],
)
def test_integers_beyond_int64_are_refused_at_validation(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(StagewiseError, match=f"^{name} must be (None or )?an int in ") as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value) and len(str(info.value)) < 120


def test_the_largest_int64_top_k_runs(tiny, reference):
    """2**63 - 1 fits int64: it is accepted and means "keep every token" (greedy anyway here)."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, top_k=2**63 - 1)
    assert LLM(tiny).generate(PROMPTS[0], params)[0].token_ids == reference[0]


def test_cli_top_k_beyond_int64_exits_2_with_one_line(monkeypatch, capsys):
    argv = ["stagewise", "generate", "hi", "--model", "tiny", "--top-k", "100000000000000000000"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "top_k must be an int in [1, 2**63 - 1]" in lines[0], err


def poisoned(params: SamplingParams) -> SamplingParams:
    """Params made invalid after validation (frozen, but not beyond object.__setattr__): every step
    that builds the sampling tensors with them raises (int64 overflow), like the old top_k=10**20."""
    object.__setattr__(params, "top_k", 10**20)
    return params


def small_engine() -> EngineConfig:
    return EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4)


def assert_all_free(llm: LLM) -> None:
    bm, cache = llm.engine.block_manager, llm.engine.cache
    assert not llm.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and not bm.req_blocks, bm.req_blocks
    assert not cache.row_of and len(cache.free_rows) == cache.block_table.shape[0]


def test_a_failing_request_is_removed_and_the_others_continue(tiny, reference):
    llm = LLM(tiny, engine_config=small_engine())
    good = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad = llm.add_request(PROMPTS[2], poisoned(SamplingParams(max_tokens=10, temperature=0.5)))
    events = []
    while llm.has_unfinished_requests():
        events += llm.step()
    errors = [e for e in events if e.finish_reason == "error"]
    assert len(errors) == 1 and errors[0].request_id == bad and errors[0].finished
    assert errors[0].token_id is None and errors[0].text == ""
    assert errors[0].error.startswith(f"{bad} failed in an engine step (") and "\n" not in errors[0].error
    assert all(e.token_id is not None for e in events if e.request_id != bad)
    for rid, ref in zip(good, reference):
        assert [e.token_id for e in events if e.request_id == rid] == ref
        assert sum(e.finished for e in events if e.request_id == rid) == 1
    assert_all_free(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference  # the engine still works


def test_generate_raises_one_line_naming_the_request_and_the_engine_goes_on(tiny, reference):
    llm = LLM(tiny, engine_config=small_engine())
    params = [GREEDY, poisoned(SamplingParams(max_tokens=10, temperature=0.5)), GREEDY]
    with pytest.raises(RequestFailed, match=r"^prompt 1: req-1 failed in an engine step \(") as info:
        llm.generate(PROMPTS, params)
    assert "\n" not in str(info.value) and isinstance(info.value, StagewiseError)
    assert_all_free(llm)  # the call's other requests were aborted at once
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_a_stream_yields_an_error_event_and_goes_on_while_a_stream_beside_it_is_untouched(tiny, reference):
    llm = LLM(tiny, engine_config=small_engine())
    beside = llm.stream(PROMPTS[:1], GREEDY)
    first = next(beside)
    params = [poisoned(SamplingParams(max_tokens=10, temperature=0.5)), GREEDY]
    events = list(llm.stream(PROMPTS[1:], params))
    assert [e.finish_reason for e in events if e.index == 0] == ["error"]
    assert [e.token_id for e in events if e.index == 1] == reference[2]
    assert [first.token_id] + [e.token_id for e in beside] == reference[0]
    assert_all_free(llm)


def test_a_request_that_fails_alone_is_blamed_at_once(tiny, reference):
    llm = LLM(tiny, engine_config=small_engine())
    bad = llm.add_request(PROMPTS[0], poisoned(SamplingParams(max_tokens=10, temperature=0.5)))
    (event,) = llm.step()
    assert event.request_id == bad and event.finish_reason == "error"
    assert_all_free(llm)


def test_a_stage_that_fails_for_one_token_blames_its_request(tiny, reference, monkeypatch):
    """A failure inside the forward pass, for one request's token only: found by rerunning the
    step's requests one at a time; the others get exactly their tokens."""
    llm = LLM(tiny, engine_config=small_engine())
    poison = 7  # a token id that appears in no reference output and no prompt of the others
    assert all(poison not in ref for ref in reference)
    assert all(poison not in llm.encode(p) for p in PROMPTS)
    real = llm.model.forward

    def forward(batch, kv):
        if poison in batch.input_ids.tolist():
            raise RuntimeError("the embedding stage cannot read token 7\nsecond line")
        return real(batch, kv)

    monkeypatch.setattr(llm.model, "forward", forward)
    good = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
    bad_ids = llm.encode(PROMPTS[2])
    assert poison not in bad_ids
    bad = llm.add_request(llm.tokenizer.decode([*bad_ids, poison]), GREEDY)
    events = []
    while llm.has_unfinished_requests():
        events += llm.step()
    (error,) = [e for e in events if e.finish_reason == "error"]
    assert error.request_id == bad and error.error.endswith("(RuntimeError: the embedding stage cannot read token 7)")
    for rid, ref in zip(good, reference):
        assert [e.token_id for e in events if e.request_id == rid] == ref
    assert_all_free(llm)
