"""Seeded speculative sampling writes the same text whatever cuts a request's guesses.

How many guesses a request verifies in a step depends on the requests beside
it: the step's token budget and the free KV blocks cut guesses short. With
the coupled acceptance (engine/speculative/randomness.py) the token at each
output position is the target's own draw there, whatever was guessed, so a
seeded request's text is a function of its seed and its own text only. The
check is strong: every run below must equal a reference run on the same
target in which nothing is ever guessed (an n-gram longer than any prompt
never matches), for the n-gram proposer and for a draft model, alone with room for every guess and
batched under a 3-token budget (under 1 + k) or an 18-block pool, with guesses cut (counted)
and guesses both kept and rejected.
"""

import random

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.models.registry import load_model
from tests.engine.spec_models import one_thread, target_and_draft  # noqa: F401 - a fixture
from tests.engine.test_spec_greedy import repetitive_prompt

K = 3
ROOMY = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=4)
TIGHT_BUDGET = EngineConfig(max_num_seqs=4, max_num_batched_tokens=3, block_size=4)
SMALL_POOL = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_kv_blocks=18)
PARAMS = [  # peaked enough that the tiny model's text repeats and lookups hit
    SamplingParams(max_tokens=16, temperature=0.8, top_k=5, seed=21, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.7, top_p=0.8, min_p=0.05, seed=22, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.9, repetition_penalty=1.2, top_k=8, seed=23),
    SamplingParams(max_tokens=16, temperature=0.6, top_k=3, seed=24, ignore_eos=True),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the target, loaded; its draft's path): a full-depth draft with 5% noise on its weights."""
    target, draft = target_and_draft(tmp_path_factory.mktemp("spec_cuts"), layers=2, noise=0.05)
    return load_model(target, dtype=torch.float32), draft


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [repetitive_prompt(rng, n) for n in (20, 27, 8, 14)]


def ngram(k: int = K, n: int = 1) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": n,
        "prompt_lookup_max": max(n, 2),
        "adaptive": False,
    }


def count_cuts(llm: LLM) -> list[int]:
    """A counter of scheduled requests whose guesses the budget or the blocks cut short."""
    scheduler, cuts = llm.engine.scheduler, [0]
    original = scheduler._scheduled

    def scheduled(out, req, n, *hit):  # hit: the prefix a newly admitted request reuses
        before = len(req.spec_token_ids)
        original(out, req, n, *hit)
        cuts[0] += len(req.spec_token_ids) < before

    scheduler._scheduled = scheduled
    return cuts


def run(llm: LLM, prompts: list[str], alone: bool) -> tuple[list[list[int]], int, int]:
    """-> every request's tokens, and the guesses verified and kept over the run(s)."""
    groups = [([p], [sp]) for p, sp in zip(prompts, PARAMS)] if alone else [(prompts, PARAMS)]
    texts, verified, kept = [], 0, 0
    for group_prompts, group_params in groups:
        texts += [out.token_ids for out in llm.generate(group_prompts, group_params)]
        verified += llm.last_stats.spec_draft_tokens
        kept += llm.last_stats.spec_accepted_tokens
    return texts, verified, kept


def reference(target, prompts) -> list[list[int]]:
    """Nothing is ever guessed: every token is the target's own draw at its position."""
    llm = LLM(target, engine_config=ROOMY, speculative_config=ngram(n=200))
    texts, verified, _ = run(llm, prompts, alone=False)
    assert verified == 0
    assert all(len(t) == 16 for t in texts)
    return texts


def draft_spec(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": K}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_text_is_the_same_alone_batched_and_cut(tiny, pair, prompts, method):
    if method == "ngram":  # the tiny model repeats itself: prompt lookup guesses well
        target, spec = tiny, ngram()
    else:  # a draft close to its target
        target, spec = pair[0], draft_spec(pair[1])
    want = reference(target, prompts)
    configs = [("alone", ROOMY), ("budget", TIGHT_BUDGET)]
    if method == "ngram":  # the pool's preemptions and block cuts (the draft's pool is as small)
        configs.append(("pool", SMALL_POOL))
    for label, ecfg in configs:
        llm = LLM(target, engine_config=ecfg, speculative_config=spec)
        cuts = count_cuts(llm)
        texts, verified, kept = run(llm, prompts, alone=label == "alone")
        assert 0 < kept < verified, f"{method} {label}: want guesses kept and rejected"
        if label == "budget":
            assert cuts[0] > 0, "meant to cut guesses"
        if label == "pool":  # blocks run short: guesses cut, or requests preempted (guesses gone)
            assert cuts[0] + llm.engine.scheduler.num_preemptions > 0, "meant to run short"
        assert texts == want, f"{method} {label}: the text depends on the guesses"
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_the_textbook_rule_keeps_q_rows_and_its_own_draws(pair, prompts):
    """acceptance "rejection": the draft's guesses come with q rows (min(1, p / q)); with room
    for every guess its seeded text is still the same alone and batched."""
    target, draft = pair
    spec = dict(draft_spec(draft), acceptance="rejection")
    llm = LLM(target, engine_config=ROOMY, speculative_config=spec)
    probe = llm.make_request(prompts[0], PARAMS[0])
    (proposal,) = llm.engine.proposer.propose([probe], [K])
    llm.engine.proposer.on_removed(probe)
    assert proposal.probs is not None and proposal.probs.shape == (K, llm.config.vocab_size)
    batched, verified, kept = run(llm, prompts, alone=False)
    assert 0 < kept < verified
    assert run(llm, prompts, alone=True)[0] == batched


def test_plain_seeded_sampling_is_the_same_alone_batched_and_cut(tiny, prompts):
    """Without speculation each draw is keyed by (seed, output index) already: kept so."""
    alone = run(LLM(tiny, engine_config=ROOMY), prompts, alone=True)[0]
    for ecfg in (TIGHT_BUDGET, SMALL_POOL):
        assert run(LLM(tiny, engine_config=ecfg), prompts, alone=False)[0] == alone
