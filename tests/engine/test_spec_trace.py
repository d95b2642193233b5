"""The tracer shows a speculative step: the guesses, the verify rows' shapes, what was kept."""

import random

from stagewise import LLM, SamplingParams
from stagewise.trace import Tracer
from tests.engine.spec_models import one_thread  # noqa: F401 - a fixture: one torch thread
from tests.engine.test_spec_greedy import ngram, repetitive_prompt


def test_a_verify_step_in_the_trace(tiny):
    rng = random.Random(2)
    prompts = [repetitive_prompt(rng, 24), repetitive_prompt(rng, 18)]
    llm = LLM(tiny, mode="paged", speculative_config=ngram(3, adaptive=False))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Tracer(timing=False) as tracer:
        outs = llm.generate(prompts, params)
    verify_steps = [s for s in tracer.steps if any(r["phase"] == "verify" for r in s.requests)]
    assert verify_steps, "no step verified guesses"
    vocab, hidden = tiny.config.vocab_size, tiny.config.hidden_size
    for step in verify_steps:
        rows = 0
        assert step.view["budget"]["decode_tokens"] + step.view["budget"]["prefill_tokens"] == (step.num_tokens)
        for r in step.requests:
            k = len(r.get("draft_token_ids", []))
            if r["phase"] == "verify":
                assert 1 <= k <= 3 and r["num_scheduled"] == 1 + k
                assert 0 <= r["accepted"] <= k and len(r["kept_token_ids"]) <= r["accepted"] + 1
                assert step.sampled[r["request_id"]] == r["kept_token_ids"][-1]
                assert step.view["requests"][r["request_id"]]["phase"] == "verify"  # live view
            rows += 1 + k
        head = next(rec for rec in step.stages if rec.stage == "lm_head")
        hidden_in = next(t for t in head.inputs if t.name == "hidden")
        assert hidden_in.shape == [step.num_tokens, hidden]
        assert [t.shape for t in head.outputs] == [[rows, vocab]]  # every verify row, no other
        judge = next(rec for rec in step.stages if rec.stage == "rejection_sampling")
        target = next(t for t in judge.inputs if t.name == "target_probs")
        assert target.shape == [rows, vocab]  # [num_draft + num_seqs, vocab]
    summary = tracer.summary
    assert summary["spec_draft_tokens"] == llm.last_stats.spec_draft_tokens > 0
    assert 0 < summary["spec_acceptance_rate"] <= 1
    assert summary["spec_mean_accepted_tokens"] > 0
    assert summary["output_tokens"] == sum(len(o.token_ids) for o in outs)
