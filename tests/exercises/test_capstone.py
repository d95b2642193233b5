"""The capstone (notebook 16): an engine made of the exercises' solutions generates LLM()'s greedy tokens.

The notebook runs it on SmolLM2; here the tiny model (2 layers, random weights) runs the same
engine with a pool small enough that the student's scheduler must chunk prompts and preempt.
"""

from pathlib import Path

import pytest

from stagewise.engine.llm import LLM
from stagewise.exercises.capstone import PARTS, StudentEngine, StudentParts, load_solutions
from stagewise.exercises.engine_checks import tiny_model
from stagewise.sampling_params import SamplingParams

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions"


def test_the_engine_of_the_solutions_generates_llms_greedy_tokens():
    loaded = tiny_model()
    prompts = ["the cat sat on the mat", "hello there, how are you today", "one two three"]
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    parts = StudentParts.of(load_solutions(SOLUTIONS))
    engine = StudentEngine(loaded, parts, num_blocks=7, block_size=4, budget=8, seats=2)
    yours = engine.generate(ids, 5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert yours == [o.token_ids for o in LLM(loaded, mode="paged").generate(prompts, params)]
    assert engine.preemptions > 0 and any(n > 1 and n < 8 for step in engine.steps for _, n in step[1:])
    assert set(engine.ops.calls) == {"embedding", "rmsnorm", "rope", "ffn"}


def test_a_missing_part_is_named():
    solved = load_solutions(SOLUTIONS)
    del solved[PARTS["schedule"]]
    with pytest.raises(KeyError, match="10.schedule_step"):
        StudentParts.of(solved)


def test_a_request_sharing_a_prompt_prefix_reuses_the_blocks_the_students_lookup_finds():
    loaded = tiny_model()
    shared = "the cat sat on the mat and looked at the dog. "
    prompts = [shared + "then it slept", shared + "then it ran away", "one two three"]
    ids = [loaded.tokenizer.encode(p) for p in prompts]
    common = next(i for i, (a, b) in enumerate(zip(*ids[:2])) if a != b)  # tokens the two prompts share
    parts = StudentParts.of(load_solutions(SOLUTIONS))
    engine = StudentEngine(loaded, parts, num_blocks=40, block_size=4, budget=64, seats=1)
    yours = engine.generate(ids, 4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert yours == [o.token_ids for o in LLM(loaded, mode="paged").generate(prompts, params)]
    # one seat: r0 finished and freed its blocks before r1 came; they stayed cached, r1 took them back
    assert engine.reused == {"r0": 0, "r1": common // 4 * 4, "r2": 0} and common >= 8
    assert [n for step in engine.steps for rid, n in step if rid == "r1"][0] == len(ids[1]) - common // 4 * 4
