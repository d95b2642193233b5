"""Greedy graphed decode steps read their ids one step late (engine/graph_runner.py, `defer_graph_reads`).

On a CPU the graph runner replays eagerly, but its bookkeeping is the GPU's: the staging upload, the
changed block-table rows, the next step queued with its input ids copied on the device from this step's
argmax, and this step's ids read after that. The tests check that the tokens and finish reasons equal
the synchronous engine's under every stop, and count the queues, reads and uploads of each step.
"""

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.graph_runner import GraphRunner, schedule_ahead
from stagewise.engine.request import Request
from stagewise.engine.scheduler import Scheduler, SchedulerOutput
from stagewise.engine.text_stream import TextStream
from stagewise.errors import StagewiseError
from stagewise.kv.block_manager import BlockManager

ATTENTION_ONLY = {"stage_backends": {"paged_attention": "triton"}}  # the graphs need this stage only
ECFG = EngineConfig(max_num_seqs=3, block_size=4, max_num_batched_tokens=32)
PROMPTS = ["Hello there, how are you?", "A", "The quick brown fox", "jumps over"]


def drive(llm: LLM, arrivals: dict[int, list[tuple[str, SamplingParams]]]) -> dict[str, tuple]:
    """Step the engine by hand, adding arrivals[k] before call k -> {request id: (tokens, finish reason)}."""
    tokens, reasons, call = {}, {}, 0
    while call <= max(arrivals) or llm.has_unfinished_requests():
        for prompt, params in arrivals.get(call, []):
            tokens[llm.add_request(prompt, params)] = []
        for event in llm.step():
            tokens[event.request_id].append(event.token_id)
            if event.finished:
                reasons[event.request_id] = event.finish_reason
        call += 1
    return {rid: (tokens[rid], reasons.get(rid)) for rid in tokens}


def test_reading_a_step_late_gives_the_synchronous_tokens_under_every_stop(tiny):
    """eos, stop strings and max_tokens end requests at different steps, with arrivals mid-run and one
    seeded request (sampled after the replay: its steps read at once); the deferred engine's tokens and
    finish reasons equal the eager engine's and the synchronous graph engine's."""
    eager = LLM(tiny, engine_config=ECFG, **ATTENTION_ONLY)
    greedy = {"temperature": 0}
    probe = eager.generate([PROMPTS[0], PROMPTS[3]], SamplingParams(max_tokens=12, ignore_eos=True, **greedy))
    first = probe[0].token_ids
    eos = max(set(first), key=first.index)  # the token that shows up last: made an end-of-sequence id
    text = probe[1].text.replace("\ufffd", "")
    stop = max(set(text), key=text.index)  # the character that shows up last: a stop string
    arrivals = {
        0: [
            (PROMPTS[0], SamplingParams(max_tokens=12, **greedy)),  # eos
            (PROMPTS[3], SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True, **greedy)),  # stop string
        ],
        1: [(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0.8, seed=3, ignore_eos=True))],  # seeded
        2: [(PROMPTS[2], SamplingParams(max_tokens=4, ignore_eos=True, **greedy))],  # max_tokens; waits for a seat
    }
    engines = {
        "eager": eager,
        "sync": LLM(tiny, engine_config=ECFG.with_updates(cuda_graphs=True, defer_graph_reads=False), **ATTENTION_ONLY),
        "deferred": LLM(tiny, engine_config=ECFG.with_updates(cuda_graphs=True), **ATTENTION_ONLY),
    }
    outs = {}
    for name, llm in engines.items():
        llm.engine.stop_ids = frozenset({eos})
        outs[name] = list(drive(llm, arrivals).values())
    assert [r for _, r in outs["eager"]] == ["stop", "stop", "length", "length"], outs["eager"]
    assert outs["eager"][0][0][-1] == eos and min(len(outs["eager"][i][0]) for i in (0, 1)) >= 6, outs["eager"]
    assert outs["sync"] == outs["eager"] and outs["deferred"] == outs["eager"]
    sync, deferred = engines["sync"].engine, engines["deferred"].engine
    assert not sync.defer_reads and sync.graphs.counts["reads"] == 0  # the option off: every read at once
    counts = deferred.graphs.counts
    assert deferred.defer_reads and counts["reads"] >= 4, counts
    assert counts["dropped"] >= 1, counts  # a stop fired while the next step was already queued
    assert deferred.block_manager.num_free_blocks == deferred.block_manager.num_blocks  # nothing leaked
    # the blocks named while steps ran ahead hold the right K/V: the same prompts again, from the prefix cache
    again = list(drive(engines["deferred"], {0: arrivals[0]}).values())
    assert again == outs["eager"][:2]
    assert deferred.block_manager.stats.hit_tokens > 0


def test_each_call_reads_one_step_after_queuing_the_next(tiny):
    """One greedy request, block size 4: each call settles one step. Its ids are read once, after the
    next step is queued, except where the next step is unknown (its last token: max_tokens). Each queued
    step uploads once, plus a block-table row when the request enters a new block."""
    llm = LLM(tiny, engine_config=ECFG.with_updates(cuda_graphs=True), **ATTENTION_ONLY)
    runner, graphs = llm.engine, llm.engine.graphs
    max_tokens = 9
    llm.add_request(PROMPTS[0], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    prompt_len = runner.scheduler.waiting[0].num_prompt_tokens
    calls = []
    while llm.has_unfinished_requests():
        before, seen = dict(graphs.counts), len(graphs.timeline)
        assert len(llm.step()) == 1  # one token per call, as the synchronous engine
        calls.append(({k: graphs.counts[k] - before[k] for k in before}, list(graphs.timeline)[seen:]))
    assert len(calls) == max_tokens and calls[0][0]["steps"] == 0  # the first token: the prompt's step
    decode = calls[1:]
    # the first decode call queues its step and the next, then reads its own; later calls queue one ahead
    assert decode[0][1] == [("queue", 1), ("queue", 2), ("read", 1)], decode[0]
    for t, (_, timeline) in enumerate(decode[1:-1], start=2):
        assert timeline == [("queue", t + 1), ("read", t)], (t, timeline)
    assert decode[-1][1] == [("read", max_tokens - 1)]  # the step before the last token queued none ahead
    assert all(done["reads"] == 1 for done, _ in decode)
    assert all(done["uploads"] == done["steps"] + done["table_rows"] for done, _ in decode)
    # decode positions prompt_len .. prompt_len + max_tokens - 2; a row each time one enters a new block
    blocks = {pos // 4 for pos in range(prompt_len, prompt_len + max_tokens - 1)}
    assert graphs.counts["table_rows"] == len(blocks) and graphs.counts["steps"] == max_tokens - 1
    assert graphs.counts["dropped"] == 0  # max_tokens is foreseen: no step runs past it


def test_the_option_is_a_bool_and_needs_the_graphs(tiny):
    with pytest.raises(StagewiseError, match="defer_graph_reads must be True or False"):
        EngineConfig(defer_graph_reads="yes")
    assert not isinstance(LLM(tiny, engine_config=ECFG, **ATTENTION_ONLY).engine, GraphRunner)  # nothing deferred


def test_a_stream_closed_while_a_step_runs_ahead_leaves_a_clean_engine(tiny):
    """Closing a stream aborts its requests while their next step is already queued: that step's ids
    are never read, its blocks go back, and the next run gives the eager engine's tokens."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = LLM(tiny, engine_config=ECFG, **ATTENTION_ONLY)
    expected = [o.token_ids for o in eager.generate(PROMPTS[:2], params)]
    llm = LLM(tiny, engine_config=ECFG.with_updates(cuda_graphs=True), **ATTENTION_ONLY)
    runner = llm.engine
    for n, _ in enumerate(llm.stream(PROMPTS[:2], params), start=1):
        if n == 6:  # 3 tokens each: decode steps are running one ahead of their reads
            assert runner._behind is not None
            break
    assert not runner.has_unfinished()
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == expected
    assert runner._behind is None and runner.graphs.counts["reads"] >= 2 + 5  # before the break, then the run
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks
    # Ctrl-C while the host waits for a step's ids, with the next step queued: both are undone
    reads = runner.graphs.read
    runner.graphs.read = lambda queued: reads(queued) if queued.step % 4 else _interrupt(runner.graphs, queued)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], params)
    assert runner._behind is None
    del runner.graphs.read  # the class's method again
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == expected
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks


def _interrupt(graphs, queued):
    assert graphs.timeline[-1] == ("queue", queued.step + 1), graphs.timeline  # the next step is queued
    raise KeyboardInterrupt


def _decoding(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int) -> SchedulerOutput:
    """Requests past their prompts, each with one sampled token: -> their first decode step."""
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", "", prompt, SamplingParams(max_tokens=max_tokens, temperature=0), 0, TextStream(str))
        scheduler.add(req)
    scheduler.schedule()  # the prompts' step
    for req in scheduler.running:
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(7)
    return scheduler.schedule()


def test_schedule_ahead_runs_only_what_schedule_would():
    """Block size 4: each request's unread token sits at position num_tokens; a new block when it
    starts one. No step ahead past a length stop, beside a waiting request, or short of blocks."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    step = _decoding(scheduler, [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], max_tokens=5)  # 4 and 8 tokens
    held = [len(bm.block_ids(r)) for r in ("r0", "r1")]
    assert held == [1, 2]
    ahead = schedule_ahead(scheduler, step, max_model_len=64)
    assert [(s.request.request_id, s.num_new_tokens) for s in ahead.scheduled] == [("r0", 1), ("r1", 1)]
    assert [len(bm.block_ids(r)) for r in ("r0", "r1")] == [2, 3]  # positions 4 and 8: new blocks
    assert schedule_ahead(scheduler, step, max_model_len=9) is None  # r1's unread token is its 9th: the last
    r0, r1 = scheduler.running
    r0.output_token_ids += [7, 7, 7]  # 4 of 5: the token being read is r0's last
    assert schedule_ahead(scheduler, ahead, max_model_len=64) is None
    del r0.output_token_ids[1:]
    scheduler.add(Request("r2", "", [1], SamplingParams(max_tokens=2), 0, TextStream(str)))
    assert schedule_ahead(scheduler, ahead, max_model_len=64) is None  # it would join the next step
    # 3 blocks, all held: positions 4 and 8 each need a new one; schedule() would preempt instead
    tight = Scheduler(BlockManager(num_blocks=3, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    step = _decoding(tight, [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], max_tokens=5)
    assert tight.block_manager.num_free_blocks == 0 and schedule_ahead(tight, step, max_model_len=64) is None
