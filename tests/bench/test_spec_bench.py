"""`bench spec --quick` on the tiny model: every system runs, greedy text identical, JSON + PNG;
the truncated-layer draft GGUF keeps exactly the layers asked for; bad options in one line."""

import json

import pytest
import torch
from typer.testing import CliRunner

from stagewise.bench.commands.spec import parse_layers
from stagewise.bench.commands.spec_steps import write_truncated_gguf
from stagewise.cli.bench import bench_app
from stagewise.errors import StagewiseError


def test_quick_run_on_tiny(tmp_path):
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(
            bench_app, ["spec", "--model", "tiny", "--quick", "--threads", "1", "--out", str(tmp_path)]
        )
    finally:
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    assert result.exit_code == 0, result.output
    png = tmp_path / "spec.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "spec.json").read_text())
    assert data["benchmark"] == "spec" and data["outputs_identical"]
    summary = data["summary"]["none"]
    assert set(summary) == {"copy", "prose"}
    for kind in summary.values():
        assert set(kind) == {"none", "ngram", "draft"}
        assert kind["none"]["speedup"] == 1.0
        # the draft is the tiny preset itself: its greedy guesses are the target's, all kept
        assert kind["draft"]["acceptance_rate"] == 1.0
    texts = {(r["prompt"], r["system"]): r["text"] for r in data["runs"]}
    for prompt in {p for p, _ in texts}:
        assert texts[(prompt, "none")] == texts[(prompt, "ngram")] == texts[(prompt, "draft")]
    step = data["verify_step"]["none"]
    assert step["verify_rows"] == 5 and step["decode_ms"] > 0 and step["verify_ms"] > 0
    assert "verify step vs decode step" in result.output


def test_truncated_draft_keeps_the_layers(tmp_path):
    """A 3-layer GGUF cut to layers 0 and 2: two layers, renamed blk.0 and blk.1, bytes unchanged
    (a Q8_0 tensor too), every other key and tensor as it was."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    source = tmp_path / "three.gguf"
    w = gguf.GGUFWriter(str(source), "llama")
    w.add_block_count(3)
    w.add_token_list(["a", "b", "c"])
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for layer in range(3):
        w.add_tensor(f"blk.{layer}.attn_norm.weight", np.full(8, layer, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    target = write_truncated_gguf(source, tmp_path / "draft.gguf", [0, 2])
    before, after = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(target))
    assert after.fields["llama.block_count"].contents() == 2
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    new = {t.name: t for t in after.tensors}
    assert sorted(new) == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "token_embd.weight"]
    assert new["blk.1.attn_norm.weight"].data.tolist() == [2.0] * 8  # the old layer 2
    old_embd = next(t for t in before.tensors if t.name == "token_embd.weight")
    assert new["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert bytes(new["token_embd.weight"].data) == bytes(old_embd.data)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quantization", "int3"], "unknown weight format 'int3'"),
        (["--methods", "eagle"], "unknown speculation method 'eagle'"),
        (["--draft-layers", "3-x"], "--draft-layers must look like"),
        (["-k", "0"], "--num-speculative-tokens must be >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(args, message, tmp_path):
    result = CliRunner().invoke(bench_app, ["spec", "--model", "tiny", *args, "--out", str(tmp_path)])
    assert isinstance(result.exception, StagewiseError), result.output
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_parse_layers():
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    with pytest.raises(StagewiseError, match="increasing"):
        parse_layers("4-6,5")
