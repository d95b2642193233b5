"""The draft model's catch-up keeps to the engine's token budget.

After a prefill, the draft has not seen the prompt: its first proposal feeds
every token its cache lacks. Those passes are cut to max_num_batched_tokens
tokens each (a long prompt in chunks, as the target's chunked prefill), and
the guesses are the ones a single unbounded pass gives.
"""

import pytest

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.speculative.config import SpeculativeConfig
from stagewise.engine.speculative.draft import DraftModelProposer
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread

GREEDY = SamplingParams(max_tokens=8, temperature=0)
BUDGET = 8


def proposer_with_budget(tiny, budget: int) -> DraftModelProposer:
    target = LLM(tiny, engine_config=EngineConfig(block_size=4, max_num_batched_tokens=budget))
    config = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=3)
    return DraftModelProposer(config, target, draft=tiny)


def fed_per_pass(proposer: DraftModelProposer) -> list[int]:
    """Records the tokens of each draft forward pass (the proposer's own passes, unchanged)."""
    sizes, forward = [], proposer._forward

    def recording(chunks):
        sizes.append(sum(len(fed) for _, _, fed, _ in chunks))
        return forward(chunks)

    proposer._forward = recording
    return sizes


@pytest.mark.parametrize("prompt_lengths", [[30], [13, 21, 2]])
def test_catch_up_runs_in_passes_within_the_budget(tiny, prompt_lengths):
    def requests(llm_proposer):
        out = []
        for n in prompt_lengths:
            req = llm_proposer.make_request("x", GREEDY)
            req.prompt_token_ids = [(7 * i + n) % 500 + 5 for i in range(n)]
            req.output_token_ids = [9]  # decoding: the prompt's pass gave one token
            out.append(req)
        return out

    small = proposer_with_budget(tiny, BUDGET)
    sizes = fed_per_pass(small)
    target = LLM(tiny, engine_config=EngineConfig(block_size=4))
    guesses = [p.token_ids for p in small.propose(requests(target), [3] * len(prompt_lengths))]
    total = sum(n + 1 for n in prompt_lengths)
    assert max(sizes) <= BUDGET and sum(sizes) == total + 2 * len(prompt_lengths)
    assert len(sizes) >= -(-total // BUDGET) + 2  # the catch-up took several passes
    roomy = proposer_with_budget(tiny, 512)
    roomy_sizes = fed_per_pass(roomy)
    want = [p.token_ids for p in roomy.propose(requests(target), [3] * len(prompt_lengths))]
    assert roomy_sizes[0] == total  # one unbounded pass: the old behaviour
    assert guesses == want and all(len(g) == 3 for g in guesses)
    for proposer in (small, roomy):
        proposer.close()
        assert proposer.block_manager.num_used_blocks == 0
