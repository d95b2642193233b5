"""The command line: output content, and one-line errors with exit status 2 on bad input."""

import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "STAGEWISE_QUIET": "1", "COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}


def run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stagewise.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


def test_generate_streams_text_on_tiny():
    res = run("generate", "Hello there", "--model", "tiny", "--max-tokens", "6")
    assert res.returncode == 0, res.stderr
    from stagewise import LLM, SamplingParams

    expected = LLM("tiny").generate("Hello there", SamplingParams(max_tokens=6, temperature=0))[0].text
    assert res.stdout == expected + "\n"


def test_no_batch_invariant_runs_the_variant_paths_and_the_trace_says_so():
    res = run("trace", "Hello there", "--model", "tiny", "--max-tokens", "2", "--no-timing", "--no-batch-invariant")
    assert res.returncode == 0, res.stderr
    assert "not batch-invariant" in res.stdout
    from stagewise import LLM, SamplingParams
    from stagewise.trace import Tracer
    from stagewise.trace.render_table import render_markdown

    with Tracer(timing=False) as tracer:
        LLM("tiny").generate("Hello there", SamplingParams(max_tokens=1))
    assert "batch-invariant on" in render_markdown(tracer)  # the default, said in every format


def test_stages_lists_the_registry():
    res = run("stages")
    assert res.returncode == 0, res.stderr
    from stagewise.stages import STAGES

    for name in STAGES:
        assert name in res.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "", "--model", "tiny"], "the prompt is empty"),
        (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "hi", "--model", "tiny", "--max-tokens", "0"], "max_tokens must be"),
        (["generate", "hi", "--model", "tiny", "--temperature", "-1"], "temperature must be"),
        (["generate", "hi", "--model", "tiny", "--top-p", "1.5"], "top_p must be"),
        (["generate", "hi", "--model", "tiny", "--top-k", "-3"], "top_k must be"),
        (["generate", "hi", "--model", "tiny", "--min-p", "2"], "min_p must be"),
        (["generate", "hi", "--model", "tiny", "--repetition-penalty", "0"], "repetition_penalty must be"),
        (["generate", "word " * 1100, "--model", "tiny"], "more than max_model_len"),
        (["generate", "hi", "--model", "/nonexistent/model.gguf"], "not found"),
    ],
)
def test_bad_input_one_line_exit_2(args, message):
    res = run(*args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_trace_prints_every_stage_with_config_shapes():
    res = run("trace", "Hello there", "--model", "tiny", "--max-tokens", "2", "--width", "200")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    from stagewise.config import PRESETS
    from stagewise.stages import STAGES

    cfg = PRESETS["tiny"]
    for name in STAGES:
        # mode paged reads K/V through the block table (paged_attention); rejection_sampling runs
        # only when speculating
        if name not in ("attention", "rejection_sampling"):
            assert name in out, f"stage {name} missing from the trace"
    assert f"hidden={cfg.hidden_size}" in out
    assert f"heads={cfg.num_heads}, head_dim={cfg.head_dim}" in out
    assert f"kv_heads={cfg.num_kv_heads}" in out
    assert f"vocab={cfg.vocab_size}" in out
    assert "step 0" in out and "step 1" in out and "summary:" in out
    assert f"x{cfg.num_layers - 1} more layers, same shapes" in out
