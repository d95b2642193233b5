"""Triton on a CPU: `generate` and `trace` say how long the interpreter will take, and show progress."""

import pytest

from stagewise import LLM, SamplingParams
from stagewise.bench.harness.progress import Bar
from stagewise.cli import interpreted
from stagewise.config import EngineConfig
from stagewise.trace.tracer import Tracer


def test_steps_are_estimated_from_the_prompts(tiny):
    llm = LLM(tiny, engine_config=EngineConfig(max_num_batched_tokens=8, max_num_seqs=4))
    prompt = "the cat sat on the mat and the dog sat on the log"  # more than one 8-token chunk
    n = len(llm.tokenizer.encode(prompt))
    assert interpreted.estimated_steps(llm, [prompt, "hi"], 5) == -(-(n + 1) // 8) + 4
    kv = LLM(tiny, mode="kv", engine_config=EngineConfig(max_num_seqs=2))
    assert interpreted.estimated_steps(kv, ["a", "b", "c"], 5) == 2 * 5  # two static batches
    assert not interpreted.interpreted(llm)  # the torch tier: no progress, no tracer
    with interpreted.interpreter_progress(llm, ["hi"], 2) as tracer:
        assert tracer is None


class CountingBar(Bar):
    """A progress row that keeps what it was told (the real one draws on a terminal only)."""

    def __init__(self):
        super().__init__()
        self.advanced, self.texts = 0, []

    def advance(self, steps: float = 1) -> None:
        self.advanced += steps

    def update(self, description=None, total=None) -> None:
        if description is not None:
            self.texts.append(description)


@pytest.mark.parametrize("quiet", [False, True])
def test_triton_on_a_cpu_shows_progress_and_an_estimate(tiny, monkeypatch, capsys, quiet):
    llm = LLM(tiny, backend="triton")
    assert interpreted.interpreted(llm)
    monkeypatch.setattr(interpreted, "ESTIMATE_ABOVE_S", 0.0)  # tiny is quick: say it anyway
    if quiet:
        monkeypatch.setenv("STAGEWISE_QUIET", "1")
    else:
        monkeypatch.delenv("STAGEWISE_QUIET", raising=False)
    bar = CountingBar()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with interpreted.ProgressTracer(bar, tiny.config.num_layers, 2, "tiny", timing=False) as tracer:
        out = llm.generate(["Hello there"], params)[0].token_ids
    assert len(tracer.steps) == 2 and bar.advanced == 2 * (tiny.config.num_layers + 1)
    assert bar.texts[-1] == "triton in the CPU interpreter · step 2 of ~2 · layer 2 of 2"
    err = capsys.readouterr().err
    said = "note: the triton tier runs in Triton's CPU interpreter (no CUDA device): "
    assert (said in err) is not quiet, err
    if not quiet:
        assert "so tiny's ~2 steps of 2 layers take about " in err and "--model tiny" not in err
    with Tracer(timing=False) as plain:  # the same records as a plain tracer, and the same tokens
        assert llm.generate(["Hello there"], params)[0].token_ids == out
    assert [(r.stage, r.layer) for s in plain.steps for r in s.stages] == [
        (r.stage, r.layer) for s in tracer.steps for r in s.stages
    ]
