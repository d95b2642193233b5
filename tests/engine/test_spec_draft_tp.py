"""The draft proposer under tensor parallelism (2 ranks, gloo on a CPU): the draft runs whole on
rank 0, beside the target's rank-0 shard; the verify step is an ordinary sharded forward. Greedy
tokens equal the plain single-device run's (the tiny model's all-reduce sums change no argmax)."""

from stagewise import LLM, SamplingParams
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread

PROMPTS = ["the cat sat on a mat and then", "7 ! 7", "a far away cat ran"]


def test_tp2_greedy_with_a_draft_equals_plain(tiny):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    spec = {  # the target's own first layer: shares rank 0's full copy of the weights
        "method": "draft_model",
        "model": "tiny",
        "num_speculative_tokens": 3,
        "draft_num_layers": 1,
    }
    expected = [o.token_ids for o in LLM(tiny).generate(PROMPTS, params)]  # one device, plain
    with LLM(tiny, tensor_parallel_size=2, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert llm.last_stats.spec_draft_tokens > 0
        proposer = llm.engine.proposer
    assert llm.engine.proposer is None  # shutdown closed it: its blocks are free
    assert proposer.block_manager.num_free_blocks == proposer.block_manager.num_blocks
