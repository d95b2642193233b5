"""Decode steps through the CUDA-graph path (engine/cuda_graphs.py) give the eager engine's tokens.

On a CPU nothing is captured, but the same padded static-buffer path runs: padding rows, the spare
block, worst-case grid sizes and the copies into the buffers are all exercised. On a GPU the test
captures and replays real graphs.
"""

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.cuda_graphs import graph_sizes

PROMPTS = ["Hello there, how are you?", "A", "The quick brown fox", "jumps over", "the lazy dog again"]


def test_graph_sizes_cover_every_batch():
    assert graph_sizes(1) == [1]
    assert graph_sizes(6) == [1, 2, 4, 6]
    assert graph_sizes(16) == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("backend", ["triton", "naive-but-attention"])
def test_graph_path_gives_the_eager_tokens(tiny, backend):
    # 5 prompts with 3 seats: decode batches of 3, 2 and 1 requests (padded to 4, 2, 1), joiners in between.
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (7, 3, 5, 6, 2)]
    ecfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32)
    kw = {"backend": "triton"} if backend == "triton" else {"stage_backends": {"paged_attention": "triton"}}
    eager = LLM(tiny, engine_config=ecfg, **kw)
    graphs = LLM(tiny, engine_config=ecfg.with_updates(cuda_graphs=True), **kw)
    expected = [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert [o.token_ids for o in graphs.generate(PROMPTS, params)] == expected
    runner = graphs.engine
    assert runner.graphs is not None and runner.graphs.failed is None
    assert runner.block_manager.num_free_blocks == runner.block_manager.num_blocks  # nothing leaked
    if torch.cuda.is_available():
        captured = set(runner.graphs.graphs) | set(runner.graphs.greedy_graphs)  # greedy: argmax inside
        assert captured and captured <= {1, 2, 3}, "graphs were captured for the padded sizes"


def test_padding_rows_write_only_the_spare_block(tiny):
    llm = LLM(tiny, backend="triton", engine_config=EngineConfig(max_num_seqs=4, cuda_graphs=True))
    cache = llm.engine.cache
    assert cache.spare_slot == cache.num_blocks * cache.block_size
    assert cache.kv.shape[2] == cache.num_blocks + 1  # the spare block sits past every usable one
    cache.kv[:, :, -1].fill_(float("nan"))  # padding writes must land here, and nobody may read it
    out = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # batch 3 -> pad 4
    assert not torch.isnan(cache.kv[:, :, -1, 0]).all(), "the padded row stored its K/V in the spare block"
    assert all(len(o.token_ids) == 4 for o in out)


def test_graphs_refuse_the_naive_paged_attention(tiny):
    with pytest.raises(ValueError, match="cuda_graphs needs the triton paged_attention"):
        LLM(tiny, engine_config=EngineConfig(cuda_graphs=True))


NAIVE_BUT_ATTENTION = {"stage_backends": {"paged_attention": "triton"}}  # the graphs need this stage only


def test_a_graphed_step_uploads_once_plus_the_changed_table_rows_and_reads_once(tiny, monkeypatch):
    """Per decode step: one staging upload, a block-table row only for a slot whose blocks changed
    (block size 4: a request crosses into a new block every 4 tokens), one host read (the ids).
    Ids read at once, each step on its own (test_graph_deferred_reads.py reads them a step late)."""
    from stagewise.runtime import DEBUG_CHECKS_ENV
    from tests.host_reads import HostReadCounter

    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")  # the suite turns value checks (host reads) on
    ecfg = EngineConfig(
        max_num_seqs=2, block_size=4, max_num_batched_tokens=32, cuda_graphs=True, defer_graph_reads=False
    )
    # the Triton sampler: the naive one draws with torch.multinomial, which reads the device
    llm = LLM(tiny, engine_config=ecfg, stage_backends={"paged_attention": "triton", "sampling": "triton"})
    runner, graphs = llm.engine, llm.engine.graphs
    llm.add_request("Hello there", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    llm.add_request("A", SamplingParams(max_tokens=5, temperature=0.8, seed=5, ignore_eos=True))
    held, graphed = {}, 0  # held: batch slot -> (request, blocks it needs) after the last graphed step
    while llm.has_unfinished_requests():
        before = dict(graphs.counts)
        with HostReadCounter() as counter:
            llm.step()
        done = {k: graphs.counts[k] - before[k] for k in before}
        if not done["steps"]:
            continue  # a prefill step, eager
        graphed += 1
        now = {b: (s.request.request_id, -(-(s.request.num_computed_tokens) // 4))
               for b, s in enumerate(runner.last_step.scheduled)}  # fmt: skip
        changed = sum(held.get(b) != need for b, need in now.items())
        held.update(now)
        assert done["table_rows"] == changed and done["uploads"] == 1 + changed, (graphed, done, now)
        assert [what for what, _ in counter.reads] == ["tolist"], counter.reads
    assert graphed >= 6 and graphs.counts["table_rows"] < 2 * graphed  # most steps upload no row


@pytest.mark.parametrize("seeded", [False, True])
def test_graph_path_equals_the_eager_path_across_stop_conditions(tiny, seeded):
    """Greedy batches take the argmax inside the graph; seeded sampling runs after the replay. Either
    way the tokens and finish reasons equal the eager engine's under max_tokens and stop strings."""
    ecfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32)
    eager = LLM(tiny, engine_config=ecfg, **NAIVE_BUT_ATTENTION)
    graphs = LLM(tiny, engine_config=ecfg.with_updates(cuda_graphs=True), **NAIVE_BUT_ATTENTION)
    kw = {"temperature": 0.9, "top_k": 20} if seeded else {"temperature": 0}
    probe = eager.generate(PROMPTS[:1], SamplingParams(max_tokens=4, seed=0, ignore_eos=True, **kw))[0]
    stop = probe.text.replace("\ufffd", "")[-2:]  # met by the 4th token at the latest: before the 6th
    assert stop.strip(), probe
    params = [
        SamplingParams(max_tokens=6, seed=0, stop=(stop,), **kw),  # cut by the stop string
        SamplingParams(max_tokens=3, seed=1, ignore_eos=True, **kw),  # cut by max_tokens
        SamplingParams(max_tokens=5, seed=2, **kw),  # EOS may end it, else max_tokens
    ]
    expected = [(o.token_ids, o.finish_reason) for o in eager.generate(PROMPTS[:3], params)]
    assert expected[0][1] == "stop" and len(expected[0][0]) <= 4 and expected[1][1] == "length"
    assert [(o.token_ids, o.finish_reason) for o in graphs.generate(PROMPTS[:3], params)] == expected
    counts = graphs.engine.graphs.counts
    assert counts["steps"] >= 3 and (counts["greedy_in_graph"] == counts["steps"]) != seeded, counts
