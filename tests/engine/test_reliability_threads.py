"""Several threads on one LLM (issue 23, case 4): each gets exactly the tokens it gets alone.

Each engine step runs under the LLM's lock; the lock is never held across a
stream's yield, so a thread that pauses between two tokens blocks nobody.
"""

import threading

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig

PROMPTS = [
    "the cat sat on the mat and then ran far away quickly",
    "a mat",
    "then ran far away and the cat sat",
    "far away the mill",
]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny, mode="kv")
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def run_threads(targets) -> list:
    """Start every target at once; re-raise the first error a thread met."""
    errors, barrier = [], threading.Barrier(len(targets))

    def guarded(target):
        try:
            barrier.wait()
            target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("mode", ["paged", "kv"])
def test_threads_generating_at_once_each_get_their_own_tokens(tiny, reference, mode):
    llm = LLM(tiny, mode=mode, engine_config=EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4))
    got = {}

    def worker(i):
        def run():
            for _ in range(3):  # several calls each, so the threads' steps interleave
                got.setdefault(i, []).append(llm.generate(PROMPTS[i], GREEDY)[0].token_ids)

        return run

    run_threads([worker(i) for i in range(len(PROMPTS))])
    assert got == {i: [reference[i]] * 3 for i in range(len(PROMPTS))}
    if mode == "paged":
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_generate_in_a_thread_while_another_streams_slowly(tiny, reference):
    """The streaming thread pauses between tokens (as a slow client would); the generating thread
    runs steps meanwhile, and the stream finds its tokens already waiting in its inbox."""
    llm = LLM(tiny, engine_config=EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4))
    streamed, generated = [], []
    started = threading.Event()

    def stream():
        for event in llm.stream(PROMPTS[:2], GREEDY):
            streamed.append(event)
            started.set()
            threading.Event().wait(0.005)  # a slow consumer, holding no lock

    def generate():
        started.wait(60)
        generated.extend(o.token_ids for o in llm.generate(PROMPTS[2:], GREEDY))

    run_threads([stream, generate])
    assert [[e.token_id for e in streamed if e.index == i] for i in (0, 1)] == reference[:2]
    assert generated == reference[2:]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_streams_interleaved_in_one_thread_beside_a_generating_thread(tiny, reference):
    llm = LLM(tiny, engine_config=EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=4))
    a, b = llm.stream(PROMPTS[0], GREEDY), llm.stream(PROMPTS[1], GREEDY)
    got_a, got_b, generated = [], [], []

    def interleave():
        for ea, eb in zip(a, b):
            got_a.append(ea.token_id)
            got_b.append(eb.token_id)

    def generate():
        generated.extend(llm.generate(PROMPTS[2], GREEDY)[0].token_ids for _ in range(2))

    run_threads([interleave, generate])
    assert got_a == reference[0] and got_b == reference[1]
    assert generated == [reference[2]] * 2
