"""`bench scale` on a tiny Q4_1 GGUF: every system's row (or the reason it has none), the ratios, the
load record, JSON + PNG together; bad options in one line. (The real runs write gigabyte files: never
here.)"""

import json
import os

import gguf
import pytest
import torch
from typer.testing import CliRunner

from stagewise.bench.commands.scale import ScaleSettings, Stagewise, run_scale, scale_table
from stagewise.cli.bench import bench_app
from stagewise.cpu import build
from stagewise.errors import StagewiseError
from stagewise.quant.packed_parts import packed_leaves
from stagewise.quant.packed_weight import is_packed
from tests.checkpoints import hf_tiny_model, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("scale") / "tiny.gguf"
    return write_gguf(path, hf_tiny_model(seed=3), projection_type=gguf.GGMLQuantizationType.Q4_1)


def test_rows_for_each_system_and_a_reason_for_the_missing_one(tiny_gguf):
    settings = ScaleSettings(
        models=(str(tiny_gguf),),
        prompt_tokens=(5, 9),
        threads=(1,),
        systems=("packed", "float32", "llama.cpp"),
        decode_tokens=3,
        repeats=2,
    )
    r = run_scale(settings)
    runs = {(run["system"], run["prompt_tokens"]): run for run in r["runs"]}
    assert set(runs) == {(s, n) for s in ("packed", "float32") for n in (5, 9)}
    for run in runs.values():
        assert len(run["ttft_ms"]) == 2 and run["ttft_ms_median"] > 0 and run["decode_tok_s_median"] > 0
        assert run["prompt_tokens_seen"] == run["prompt_tokens"]  # the text cut to that many tokens
    assert [s["system"] for s in r["skipped"]] == ["llama.cpp"] and "--llamacpp" in r["skipped"][0]["reason"]
    assert {(q["over"], q["prompt_tokens"]) for q in r["ratios"]} == {("float32", 5), ("float32", 9)}
    assert isinstance(r["busy"], bool) and len(r["loadavg_start"]) == 3 and "int8_dot" in r["kernel"]
    assert any("llama.cpp not run" in note for note in r["notes"])
    assert scale_table(r).row_count == 2


def test_the_cli_writes_json_and_png(tiny_gguf, tmp_path):
    threads = torch.get_num_threads()
    try:
        args = ["scale", "--models", str(tiny_gguf), "--prompt-tokens", "6", "--threads", "1"]
        result = CliRunner().invoke(bench_app, [*args, "--systems", "packed", "--repeats", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "scale.json").read_text())
    assert data["settings"]["prompt_tokens"] == [6] and [run["system"] for run in data["runs"]] == ["packed"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "gpt-5"], "unknown model 'gpt-5'"),
        (["--systems", "packed,vllm"], "unknown system 'vllm'"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be positive integers"),
        (["--threads", "two"], "--threads must be comma-separated integers"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    ],
)
def test_bad_options_are_one_line(tmp_path, args, message):
    result = CliRunner().invoke(bench_app, ["scale", *args, "--out", str(tmp_path)])
    assert result.exit_code != 0
    text = str(result.exception) + result.output
    assert message in text, text
    assert not list(tmp_path.iterdir()), "nothing is written before the options are checked"


def test_unknown_model_fails_before_any_file_is_written():
    with pytest.raises(StagewiseError, match="unknown model"):
        run_scale(ScaleSettings(models=("llama-3-8b", "nope.gguf")))


FORMS = {1: "rows8", 2: "int4pack"}  # the torch tier's forms by their tensors (dequant_gemm_torch.gemm)


def kernel_forms(system: Stagewise) -> set[str]:
    """The torch tier's form of every packed projection the system's model multiplies by."""
    forms = set()
    for layer in system.llm.loaded.weights.layers:
        for w in vars(layer).values():
            if is_packed(w):
                forms |= {FORMS[len(leaf.prepared["torch"])] for leaf in packed_leaves(w)}
    return forms


@pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the integer-dot kernel is not built")
def test_the_two_packed_systems_run_their_own_kernels_and_leave_the_switch_as_it_was(tiny_gguf, monkeypatch):
    monkeypatch.delenv(build.ENV_SWITCH, raising=False)
    stock, int8 = Stagewise(tiny_gguf, "auto", int8_dot=False), Stagewise(tiny_gguf, "auto", int8_dot=True)
    assert kernel_forms(stock) == {"int4pack"} and kernel_forms(int8) == {"rows8"}
    assert not stock.llm.engine_config.enable_prefix_caching  # each repeat prefills its whole prompt
    assert build.ENV_SWITCH not in os.environ  # switched back after the load
    prompt = "The capital of France is"
    _, _, n = int8.run(prompt, 3, 1)  # the kernel runs at call time too, with the switch on
    assert n == len(int8.tokenizer.encode(prompt)) and build.ENV_SWITCH not in os.environ
    r = run_scale(
        ScaleSettings(
            models=(str(tiny_gguf),),
            prompt_tokens=(5,),
            threads=(1,),
            systems=("packed", "packed-int8"),
            decode_tokens=2,
            repeats=1,
        )
    )
    assert [run["system"] for run in r["runs"]] == ["packed", "packed-int8"] and not r["skipped"]
    assert "built for" in r["kernel"]  # where the kernels packed-int8 ran are kept, the switch off outside
    assert "packed-int8 / llama.cpp" not in [c.header for c in scale_table(r).columns]  # no llama.cpp row
