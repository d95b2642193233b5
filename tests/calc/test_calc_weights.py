"""`calc --weights`: bytes per weight of a storage format, and the decode floor it sets.

Hand-checkable numbers: a q4_0 block is 32 four-bit codes (16 B) and a float16 scale (2 B),
18 / 32 = 0.5625 B per weight; q4_1 adds a float16 minimum, 20 / 32 = 0.625; q8_0 is 32 int8
codes and a scale, 34 / 32 = 1.0625. llama.cpp's own table (`gguf.GGML_QUANT_SIZES`) is the
outside reference for every block format.
"""

import json

import gguf
import pytest
import typer
from typer.testing import CliRunner

from stagewise.calc.counts import weight_bytes_streamed
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.roofline import analyze
from stagewise.calc.weight_formats import FORMATS, from_gguf, get_format, uniform, weight_bytes_of
from stagewise.cli.calc import calc
from stagewise.config import PRESETS
from stagewise.errors import StagewiseError
from stagewise.models.files import smollm2_gguf_path

SMOL, L3_8B = PRESETS["smollm2-135m"], PRESETS["llama-3-8b"]


def test_bytes_per_weight_by_hand_and_against_llama_cpps_table():
    assert get_format("q4_0").bytes_per_weight == 0.5625
    assert get_format("Q4_1").bytes_per_weight == 0.625
    assert get_format("q8_0").bytes_per_weight == 1.0625
    assert get_format("f32").bytes_per_weight == 4 and get_format("bfloat16").bytes_per_weight == 2
    for fmt in FORMATS.values():
        if fmt.group > 1:
            group, block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt.name.upper()]]
            assert (fmt.group, fmt.block_bytes) == (group, block), fmt.name
    with pytest.raises(StagewiseError, match="unknown weight format 'q3_x'"):
        get_format("q3_x")


def test_smollm2_file_per_tensor_vs_float32():
    """The shipped GGUF: 30 layers of Q4_1 projections, a Q8_0 tied embedding, float32 norms."""
    stored = weight_bytes_of(SMOL, "gguf", "fp32", "smollm2-135m")  # the preset reads its own file
    per_layer = 576 * 960 + 576 * 576 + 576 * 2 * 1536 + 1536 * 576  # 3,538,944 weights
    assert stored.blocks.value == 30 * per_layer * 20 // 32 == 66_355_200
    assert stored.embedding.value == 49152 * 576 * 34 // 32 == 30_081_024
    assert stored.norms.value == 61 * 576 * 4 and stored.tied
    assert stored.total().value == 96_576_768  # the file's tensor bytes
    packed = analyze(SMOL, HARDWARE["h100"], context=1, dtype="fp32", weights=stored)
    floats = analyze(SMOL, HARDWARE["h100"], context=1, dtype="fp32")
    kv = 2 * 30 * 3 * 64 * 4 * 2  # K and V of 2 tokens (1 read + 1 written), float32
    assert packed.decode.bytes.value == 96_576_768 + kv  # tied: the table is read whole as the LM head
    assert floats.decode.bytes.value == 538_060_032 + kv  # (134,479,872 matmul + 35,136 norm weights) * 4
    assert packed.weights.endswith("(per tensor)") and floats.weights == "fp32"
    assert abs(packed.bytes_per_weight.value - 96_576_768 / SMOL.num_parameters()) < 1e-12


def test_llama_3_8b_q4_0_vs_bf16_decode_floor():
    """Untied: the blocks, the LM head and one gathered embedding row are read per decode step."""
    blocks = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096)  # 6,979,321,856
    head = 128256 * 4096
    q4 = analyze(L3_8B, HARDWARE["h100"], context=1, weights=uniform(L3_8B, get_format("q4_0")))
    bf16 = analyze(L3_8B, HARDWARE["h100"], context=1)
    kv = 2 * 32 * 8 * 128 * 2 * 2  # bf16 K and V of 2 tokens
    assert q4.decode.bytes.value == (blocks + head + 4096) * 0.5625 + 65 * 4096 * 4 + kv
    assert bf16.decode.bytes.value == (blocks + head + 4096 + 65 * 4096) * 2 + kv
    assert q4.weight_bytes.value == (blocks + 2 * head) * 0.5625 + 65 * 4096 * 4 == 4_517_937_152
    assert 3.5 < bf16.decode.time.value / q4.decode.time.value < 3.6  # memory-bound: the bytes' ratio
    assert q4.capacity.max_batch.value > bf16.capacity.max_batch.value  # room the weights gave back


@pytest.mark.parametrize("tokens", [1, 7, 200_000])
def test_a_float_format_streams_what_the_dtype_did(tokens):
    for cfg, nbytes, name in ((SMOL, 4, "fp32"), (L3_8B, 2, "bf16")):
        ours = uniform(cfg, get_format(name)).streamed(tokens).value
        assert ours == weight_bytes_streamed(cfg, nbytes, tokens).value


def test_gguf_weights_need_a_gguf_model():
    with pytest.raises(StagewiseError, match="--weights gguf reads the tensors of a .gguf"):
        weight_bytes_of(L3_8B, "gguf", "bf16", "llama-3-8b")
    assert from_gguf(SMOL, smollm2_gguf_path()).total().value == 96_576_768  # a path works as the preset did


def test_cli_weights_option(tmp_path):
    """In-process (the exit-2 path of a StagewiseError is test_calc.py's CLI test)."""
    app = typer.Typer()
    app.command()(calc)
    out = tmp_path / "calc.json"
    args = ["--model", "llama-3-8b", "--context", "8192", "--weights", "q4_0", "--json-out", str(out)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    assert "weights in memory (q4_0)" in res.output and "0.5626 B/weight" in res.output  # norms stay float32
    data = json.loads(out.read_text())["analysis"]
    assert data["weights"] == "q4_0" and data["weight_bytes"]["value"] == 4_517_937_152
    bad = CliRunner().invoke(app, ["--weights", "q3_x"])
    assert isinstance(bad.exception, StagewiseError) and "unknown weight format 'q3_x'" in str(bad.exception)
    both = CliRunner().invoke(app, ["--weights", "q4_0", "--tp", "2"])
    assert isinstance(both.exception, StagewiseError) and "--tp" in str(both.exception)
