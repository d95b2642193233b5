"""Speculative decoding with sampling: seeded runs reproduce alone vs batched, every parameter
works, and the repetition penalty of a verify row sees the guesses before it.

(The distribution test, a chi-square over thousands of seeded draws against
plain sampling, needs a draft model whose q differs from p: it lives with the
draft-model proposer's tests.)
"""

import random

import torch

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.request import Request
from stagewise.engine.speculative.verify import verify
from stagewise.engine.text_stream import TextStream
from stagewise.models.ops import StageOps
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread
from tests.engine.test_spec_greedy import ngram, repetitive_prompt

MENU = [
    dict(temperature=0.8, top_k=5, seed=11),
    dict(temperature=0.7, top_p=0.8, min_p=0.05, seed=13),
    dict(temperature=0.9, repetition_penalty=1.2, top_k=20, top_p=0.95, seed=15),
    dict(temperature=0.0, repetition_penalty=1.3),  # greedy beside them
]


def test_seeded_sampling_is_the_same_alone_and_batched(tiny):
    rng = random.Random(4)
    prompts = [repetitive_prompt(rng, n) for n in (20, 35, 8, 27)]
    params = [SamplingParams(max_tokens=20, ignore_eos=True, **kw) for kw in MENU]
    ecfg = EngineConfig(max_num_batched_tokens=512)  # room for every guess: nothing is cut
    llm = LLM(tiny, mode="paged", engine_config=ecfg, speculative_config=ngram(3, adaptive=False))
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.last_stats
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens  # some guesses rejected
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(reversed(prompts), reversed(params))]
    assert batched == alone[::-1]
    assert all(len(t) == 20 for t in batched)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_verify_rows_penalty_sees_the_guesses_before_it():
    """Row i penalises guesses 1..i as if they had been sampled: a guess repeated inside one
    verify step is judged against the penalised logits (what plain decoding would have seen)."""
    req = Request(
        request_id="r",
        prompt="",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=8, temperature=0, repetition_penalty=2.0),
        seed=0,
        text_stream=TextStream(decode=lambda t: ""),
        output_token_ids=[2],
    )
    req.spec_token_ids = [3, 3]  # a new token, guessed twice
    logits = torch.zeros(3, 8)  # [1 + k, V]
    logits[0, 3] = 2.0  # row 0: 3 unseen, the argmax -> the first guess is kept
    logits[1, 3], logits[1, 4] = 2.0, 1.5  # row 1 has seen 3: 2.0 / 2 = 1.0 < 1.5 -> 4
    logits[2, 5] = 9.0
    assert verify(StageOps("naive"), logits, [req]) == [[3, 4]]
    req.params = SamplingParams(max_tokens=8, temperature=0)  # no penalty: both kept, then 5
    assert verify(StageOps("naive"), logits, [req]) == [[3, 3, 5]]
