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
        assert set(runner.graphs.graphs) <= {1, 2, 4, 3}, "graphs were captured for the padded sizes"


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
