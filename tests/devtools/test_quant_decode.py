"""The device check's W4A16 decode GEMV rows (devtools/gpu/quant_decode.py) on the CPU dry run's shapes."""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.devtools.gpu.kernel_bench import DRY_SIZES, projection_shapes, summary_line
from stagewise.devtools.gpu.quant_decode import KINDS, quant_decode_cases, random_packed
from stagewise.quant.dequantize import dequantize


def test_rows_cover_every_projection_and_kind_and_match_the_float64_product():
    rows = quant_decode_cases(DRY_SIZES, torch.device("cpu"), torch.float32, copy_gbs=10.0)
    shapes = projection_shapes(PRESETS["tiny"])  # the dry run's models and attention models are both tiny
    expected = [f"tiny {p} {kind} M=1 K={k} N={n}" for p, (k, n) in shapes.items() for kind in KINDS]
    assert [r["shape"] for r in rows] == expected
    for r in rows:
        assert "error" not in r and r["kernel"] == "dequant_matmul" and r["stock"] == "F.linear (float32 weight)"
        assert r["rel_err"] < 1e-5 and r["triton_ms"] > 0 and r["stock_ms"] > 0
        assert r["target"] == "share_of_copy >= 0.7" and r["share_of_copy"] == pytest.approx(r["triton_value"] / 10)
        k, n = (int(part[2:]) for part in r["shape"].split()[-2:])
        bytes_per_weight = 0.625 if "q4_1" in r["shape"] else 0.5625
        assert r["packed_bytes"] == k * n * bytes_per_weight + (k + n) * 4  # codes, scales (mins), a, c
        assert "dequant_matmul" in summary_line(r)


@pytest.mark.parametrize("kind", KINDS)
def test_random_packed_weights_look_like_the_bf16_random_model(kind):
    """Mean ~0 and standard deviation ~K^-0.5, like synthetic_weights' fan-in scaling."""
    k, n = 512, 256
    w = dequantize(random_packed(kind, k, n, "cpu", torch.Generator().manual_seed(1)))  # [K, N]
    assert w.shape == (k, n) and abs(w.mean()) < 0.05 * k**-0.5
    assert 0.9 < w.std() * k**0.5 < 1.2
    with pytest.raises(ValueError, match="q4_1 or q4_0"):
        random_packed("q8_0", k, n, "cpu")
