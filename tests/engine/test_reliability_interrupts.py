"""A second Ctrl-C during a stream's cleanup, and bursts of them, leave the LLM whole (issue 23, case 3).

Real SIGINTs, sent to this process: from inside `release_row` (the cleanup's
last move, which an interrupt used to cut off from `scheduler.abort`), and in
bursts 20 us - 2 ms apart while streams run. Afterwards every block and every
block-table row is free and the same LLM gives the tokens a fresh one gives.
"""

import os
import signal

import pytest

from stagewise import LLM, SamplingParams
from stagewise.bench.harness.bursts import InterruptBurst
from stagewise.config import EngineConfig

PROMPTS = ["the cat sat on the mat and then ran far away quickly", "a mat", "then ran far away and the cat sat"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """As in a terminal: SIGINT raises KeyboardInterrupt (a background job may inherit it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def reference(tiny):
    return [o.token_ids for o in LLM(tiny, mode="kv").generate(PROMPTS, GREEDY)]


def small_engine() -> EngineConfig:
    return EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4)


def assert_whole(llm: LLM, reference) -> None:
    """No request left, every block and row free, and a rerun gives the reference tokens."""
    bm, cache = llm.engine.block_manager, llm.engine.cache
    assert not llm.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks and not bm.req_blocks, bm.req_blocks
    assert sorted(cache.free_rows) == list(range(cache.block_table.shape[0])) and not cache.row_of
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert bm.num_free_blocks == bm.num_blocks and len(cache.free_rows) == cache.block_table.shape[0]


def interrupting_release_row(llm: LLM, action):
    """Wrap the cache's release_row so that each call first does `action` (a real SIGINT)."""
    cache = llm.engine.cache
    real = cache.release_row

    def release_row(request_id):
        action()
        return real(request_id)

    cache.release_row = release_row
    return lambda: setattr(cache, "release_row", real)


def sigint():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("first", ["in the consumer", "in the engine", "by close"])
def test_sigint_inside_release_row_during_cleanup(tiny, reference, first):
    """The issue's reproduction: the first interrupt stops the stream, a second one lands inside
    `release_row` while the stream's cleanup aborts its requests."""
    llm = LLM(tiny, engine_config=small_engine())
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)
    restore = interrupting_release_row(llm, sigint)
    model = llm.engine.model
    try:
        if first == "by close":
            stream.close()  # an explicit close: its cleanup finishes, the interrupt is dropped
        else:
            with pytest.raises(KeyboardInterrupt):
                if first == "in the consumer":
                    for _ in stream:
                        raise KeyboardInterrupt
                else:
                    model.forward = lambda *args: sigint()  # lands inside the next step's forward
                    for _ in stream:  # the first step's events, then a step that is interrupted
                        pass
    finally:
        restore()
        model.__dict__.pop("forward", None)
    del stream
    assert_whole(llm, reference)


def test_an_interrupt_that_escapes_cleanup_is_repaired_by_the_next_call(tiny, reference):
    """Worst case: the interrupt is raised where nothing can defer it, between the scheduler's abort
    and the row's release (as if it landed before the deferral was in place). The next engine
    call finishes the cleanup: the leaked row comes back, nothing is left running."""
    llm = LLM(tiny, engine_config=small_engine())
    stream = llm.stream(PROMPTS, GREEDY)
    next(stream)

    def raise_now():
        raise KeyboardInterrupt

    restore = interrupting_release_row(llm, raise_now)
    with pytest.raises(KeyboardInterrupt):
        stream.close()
    restore()
    assert llm.engine.cache.row_of or len(llm.engine.cache.free_rows) < 4  # the cut-off state
    assert_whole(llm, reference)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bursts_of_sigint_while_streams_and_generate_run(tiny, reference, seed):
    llm = LLM(tiny, engine_config=small_engine())
    interrupted = completed = 0
    with InterruptBurst(count=24, gap_s=(20e-6, 2e-3), burst_size=3, pause_s=(0.02, 0.1), seed=seed) as burst:
        while burst.running:
            try:
                burst.armed = True
                if completed % 2:
                    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
                else:
                    events = list(llm.stream(PROMPTS, GREEDY))
                    outs = [[e.token_id for e in events if e.index == i] for i in range(len(PROMPTS))]
                burst.armed = False
                assert outs == reference
                completed += 1
            except KeyboardInterrupt:
                burst.armed = False
                interrupted += 1
    assert burst.sent == 24 and interrupted >= 3, (burst.raised, interrupted, completed)
    print(f"burst {seed}: {burst.raised} interrupts raised, {interrupted} calls cut, {completed} completed")
    assert_whole(llm, reference)
