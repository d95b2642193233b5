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
