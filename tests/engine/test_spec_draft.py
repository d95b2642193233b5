"""The draft-model proposer on its own (no engine): proposals, its KV cache, its checks.

A draft that IS the target must propose exactly the target's greedy
continuation, through any pattern of partial acceptances (each one rewinds its
cache); rejected drafts' blocks go back to the free list; a request that does
not fit gets no proposal; seeded draws do not depend on the batch; a draft with
another vocabulary is refused in one line.
"""

import dataclasses
import random

import pytest
import torch

from stagewise import LLM, SamplingParams, StagewiseError
from stagewise.config import EngineConfig
from stagewise.engine.speculative import SpeculativeConfig, make_proposer
from stagewise.engine.speculative.draft import DraftModelProposer
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.registry import LoadedModel
from stagewise.sampling_params import SamplingTensors
from stagewise.stages.sampling import processed_probs
from tests.checkpoints import hf_tiny_model, write_gguf
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread

PROMPTS = ["the cat sat on", "a", "then it ran far away and the cat sat on a mat, quickly", "7 ! 7"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def draft_config(k: int = 4, model: str = "tiny") -> SpeculativeConfig:
    """The textbook acceptance: sampled guesses come back with the q rows these tests check
    (the default, coupled, returns point masses: tests/engine/test_spec_seeded_cuts.py)."""
    return SpeculativeConfig(method="draft_model", model=model, num_speculative_tokens=k, acceptance="rejection")


@pytest.fixture(scope="module")
def target(tiny):
    return LLM(tiny, engine_config=EngineConfig(block_size=4, max_num_seqs=8))


@pytest.fixture(scope="module")
def continuations(target):
    """The target's own greedy tokens for each prompt (the answer a perfect draft gives)."""
    return [out.token_ids for out in target.generate(PROMPTS, GREEDY)]


def used_blocks(proposer: DraftModelProposer) -> int:
    return proposer.block_manager.num_used_blocks


def test_a_draft_that_is_the_target_proposes_its_greedy_continuation(target, tiny, continuations):
    """Accept a random number of drafts each round (then the target's token), as verification
    would: every later proposal must still be the continuation, alone or batched."""
    rng = random.Random(0)
    proposer = DraftModelProposer(draft_config(k=5), target, draft=tiny)
    requests = [target.make_request(p, GREEDY) for p in PROMPTS]
    rounds = 0
    while any(len(r.output_token_ids) < 18 for r in requests):
        live = [r for r in requests if len(r.output_token_ids) < 18]
        ks = [rng.randint(1, 5) for _ in live]
        for req, k, proposal in zip(live, ks, proposer.propose(live, ks)):
            truth = continuations[requests.index(req)]
            done = len(req.output_token_ids)
            assert proposal.token_ids == truth[done : done + k], (req.prompt, done)
            assert proposal.probs is None  # greedy guesses are point masses
            fed = len(req.all_token_ids) + k - 1  # the tokens and drafts 1 .. k-1 were fed
            accepted = rng.randint(0, k)  # the verifier keeps `accepted`, then its own token
            req.output_token_ids += truth[done : done + accepted + 1]
            proposer.on_verified(req)
            # what the cache keeps: all of the text it was fed (its drafts were the truth)
            assert len(proposer.held[req.request_id]) == min(len(req.all_token_ids), fed)
        rounds += 1
    assert rounds > 4
    expected = sum(proposer.block_manager.blocks_needed(len(h)) for h in proposer.held.values())
    assert used_blocks(proposer) == expected  # nothing past any request's cached end
    for req in requests:
        proposer.on_removed(req)
    assert used_blocks(proposer) == 0 and not proposer.cache.row_of and not proposer.held


def test_rejected_drafts_give_back_the_blocks_past_the_accepted_end(target, tiny):
    """block_size 4: a prompt of 10 tokens and 7 drafts need ceil(16 / 4) = 4 blocks; a rejection
    at the first draft leaves 11 tokens, of which the cache keeps 10: 3 blocks."""
    proposer = DraftModelProposer(draft_config(k=7), target, draft=tiny)
    req = target.make_request("x", GREEDY)
    req.prompt_token_ids = list(range(20, 30))  # 10 tokens
    (proposal,) = proposer.propose([req], [7])
    assert len(proposal.token_ids) == 7
    assert used_blocks(proposer) == 4  # K/V of 10 tokens + 6 drafts
    req.output_token_ids.append((proposal.token_ids[0] + 1) % 512)  # the target disagreed at once
    proposer.on_verified(req)
    assert proposer.held[req.request_id] == req.prompt_token_ids
    assert used_blocks(proposer) == 3
    (again,) = proposer.propose([req], [2])  # catches up with the one new token, then drafts
    assert len(again.token_ids) == 2 and used_blocks(proposer) == 3  # 11 + 1 tokens
    proposer.on_removed(req)
    assert used_blocks(proposer) == 0


def test_a_request_that_does_not_fit_gets_no_proposal_and_holds_nothing(target, tiny):
    proposer = DraftModelProposer(draft_config(k=4), target, draft=tiny, num_blocks=4)
    long = target.make_request("x", GREEDY)
    long.prompt_token_ids = list(range(20, 32))  # 12 tokens + 3 drafts = 15: 4 blocks
    short = target.make_request("the cat", GREEDY)
    first, second = proposer.propose([long, short], [4, 4])
    assert len(first.token_ids) == 4
    assert second.token_ids == [] and second.probs is None
    assert short.request_id not in proposer.held and used_blocks(proposer) == 4
    proposer.on_removed(long)
    (later,) = proposer.propose([short], [4])  # room again
    assert len(later.token_ids) == 4
    assert proposer.propose([short], [0])[0].token_ids == []  # asked for nothing: nothing
    proposer.close()
    assert used_blocks(proposer) == 0


def test_seeded_draws_are_the_same_alone_or_batched_and_come_from_q(target, tiny):
    """Temperature 1.5 over a 512-token vocabulary: each draft token is a draw from its q row."""
    proposer = DraftModelProposer(draft_config(k=4), target, draft=tiny)
    params = [
        SamplingParams(max_tokens=20, temperature=1.5, seed=s, repetition_penalty=r, top_k=t)
        for s, r, t in [(1, 1.0, -1), (2, 1.3, 50), (3, 1.0, 8)]
    ]

    def fresh(i: int):
        return target.make_request(PROMPTS[i], params[i])

    alone = [proposer.propose([fresh(i)], [4])[0] for i in range(3)]
    proposer.close()
    batched = proposer.propose([fresh(2), fresh(0), fresh(1)], [4, 4, 4])
    for a, b in zip(alone, [batched[1], batched[2], batched[0]]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.probs, b.probs)
    for p in alone:
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(4))
        assert all(p.probs[j, t] > 0 for j, t in enumerate(p.token_ids))
    assert (alone[2].probs > 0).sum(-1).max() <= 8  # top_k = 8 shaped q
    other_seed = dataclasses.replace(params[0], seed=99)
    draws = {tuple(proposer.propose([target.make_request(PROMPTS[0], other_seed)], [4])[0].token_ids)}
    draws.add(tuple(alone[0].token_ids))
    assert len(draws) == 2  # another seed, other draws (at temperature 1.5 over 512 tokens)


def test_a_draft_with_other_weights_loads_from_a_gguf_and_its_q_differs(target, tiny, tmp_path):
    path = write_gguf(tmp_path / "draft.gguf", hf_tiny_model(seed=1))
    proposer = make_proposer(draft_config(k=3, model=str(path)), target)
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.loaded.config.num_layers == tiny.config.num_layers
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    req = target.make_request(PROMPTS[0], sampled)
    (proposal,) = proposer.propose([req], [3])
    own = DraftModelProposer(draft_config(k=3), target, draft=tiny)
    (mine,) = own.propose([target.make_request(PROMPTS[0], sampled)], [1])
    assert (proposal.probs[0] - mine.probs[0]).abs().max() > 1e-3  # other weights, other q
    proposer.close()
    own.close()


def _with_tokenizer(model: LoadedModel, **changes) -> LoadedModel:
    return dataclasses.replace(model, tokenizer=dataclasses.replace(model.tokenizer, **changes))


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(target, tiny):
    tokens = list(tiny.tokenizer.tokens)
    tokens[300] = tokens[300] + "x"
    bigger = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, vocab_size=576))
    cases = {
        "token 300 is": _with_tokenizer(tiny, tokens=tokens),
        "eos_id 5, the target's is": _with_tokenizer(tiny, eos_id=5),
        "vocab size 576, the target's is 512": bigger,
    }
    for phrase, draft in cases.items():
        with pytest.raises(StagewiseError) as info:
            DraftModelProposer(draft_config(), target, draft=draft)
        message = str(info.value)
        assert phrase in message and "\n" not in message, message
        assert "vocabulary differs" in message


def test_proposals_use_the_requests_sampling_rules(target, tiny):
    """A greedy request's guess is a point mass (no q); q of a sampled one is processed_probs."""
    proposer = DraftModelProposer(draft_config(k=1), target, draft=tiny)
    greedy, hot = (target.make_request(PROMPTS[0], p) for p in (GREEDY, SamplingParams(seed=1)))
    a, b = proposer.propose([greedy, hot], [1, 1])
    assert a.probs is None and len(a.token_ids) == 1

    batch = ForwardBatch.from_sequences([hot.all_token_ids], [0], torch.device("cpu"))
    logits = target.model.forward(batch, NoKVCache.of(batch))
    seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
    tensors = SamplingTensors.from_params([hot.params], seen, [0], [hot.seed], "cpu")
    torch.testing.assert_close(b.probs, processed_probs(logits, tensors), atol=1e-5, rtol=1e-4)


def test_a_truncated_draft_of_the_target_shares_its_weights(target, tiny):
    """model = the target's own name and draft_num_layers = 1: its first layer, no second copy."""
    config = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=2, draft_num_layers=1)
    proposer = make_proposer(config, target)
    assert proposer.loaded.config.num_layers == 1 and len(proposer.loaded.weights.layers) == 1
    assert proposer.loaded.weights.layers[0] is tiny.weights.layers[0]  # shared, not loaded
    assert proposer.loaded.weights.lm_head is tiny.weights.lm_head
    assert "first 1 of 2 layers" in proposer.loaded.source
    req = target.make_request(PROMPTS[0], GREEDY)
    (proposal,) = proposer.propose([req], [2])
    assert len(proposal.token_ids) == 2
    proposer.close()
    too_many = dataclasses.replace(config, draft_num_layers=3)
    with pytest.raises(StagewiseError, match="draft_num_layers=3, but the draft model .* has 2"):
        make_proposer(too_many, target)
    with pytest.raises(StagewiseError, match="draft_num_layers must be an int >= 1"):
        SpeculativeConfig(method="draft_model", model="tiny", draft_num_layers=0)


def test_greedy_guesses_with_a_repetition_penalty_see_the_guesses_before_them(target, tiny):
    """A draft that is the target, greedy with penalty 1.5: its k guesses are the target's next
    k tokens only if each guess counts the ones before it as seen, as plain decoding does."""
    params = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    expected = target.generate(PROMPTS[2], params)[0].token_ids
    proposer = DraftModelProposer(draft_config(k=5), target, draft=tiny)
    req = target.make_request(PROMPTS[2], params)
    req.output_token_ids.append(expected[0])
    (proposal,) = proposer.propose([req], [5])
    assert proposal.token_ids == expected[1:6] and proposal.probs is None
    proposer.close()
