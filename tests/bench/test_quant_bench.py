"""`bench quant --quick` on a tiny Q4_1 GGUF: float32 and packed weights decode the same greedy tokens,
the report prints tokens/s, memory and agreement, and JSON + PNG land together; bad options in one line."""

import json

import gguf
import torch
from typer.testing import CliRunner

from stagewise.cli.bench import bench_app
from tests.checkpoints import hf_tiny_model, write_gguf


def invoke(args):
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(bench_app, ["quant", "--threads", "1", *args])
    finally:
        torch.set_num_threads(threads)


def test_quick_run_on_a_tiny_q4_1_gguf(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", hf_tiny_model(seed=3), projection_type=gguf.GGMLQuantizationType.Q4_1)
    out = tmp_path / "out"
    result = invoke(["--model", str(path), "--quick", "--systems", "float32,packed", "--out", str(out)])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    assert (out / "quant.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "quant.json").read_text())
    assert set(data["decode_tok_s_median"]) == {"float32", "packed"}
    assert all(v > 0 for v in data["decode_tok_s_median"].values())
    # the tiny model's torch tier: bf16 rounding leaves its few greedy tokens unchanged (test_quantized_model)
    assert data["greedy_agreement"] == {"packed": [4]}
    mem = data["memory"]
    assert mem["packed"]["weight_tensor_bytes"] < mem["float32"]["weight_tensor_bytes"] / 4
    assert "q4_1" in mem["packed"]["weights"] and "packed over float32" in result.output


def test_unknown_system_is_one_line(tmp_path):
    result = invoke(["--systems", "float32,vllm", "--out", str(tmp_path)])
    assert result.exit_code != 0
    assert "unknown system 'vllm'" in str(result.exception) + result.output
