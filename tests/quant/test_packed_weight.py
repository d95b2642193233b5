"""Packed weights: the naive dequantization equals llama.cpp's reference (`gguf.quants`) bit for bit.

Blocks come from `gguf.quants.quantize` (the reference quantizers) on irregular, block-aligned
shapes; `packed_from_blocks` moves them apart without changing a bit, and `dequant_gemm`'s
textbook formula must give exactly `gguf.quants.dequantize`'s float32 numbers.
"""

import gguf
import numpy as np
import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.quant.gguf_blocks import packed_from_blocks
from stagewise.quant.packed_weight import PackedWeightError, cat_out_features
from stagewise.quant.quantize import quantize
from stagewise.stages import dequant_gemm

TYPES = ["Q4_0", "Q4_1", "Q8_0"]
SHAPES = [(5, 96), (17, 64), (3, 32)]  # [out, in]: odd row counts, a few blocks per row


def blocks_of(rows: np.ndarray, type_name: str) -> np.ndarray:
    return gguf.quants.quantize(rows, gguf.GGMLQuantizationType[type_name])


def reference(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[type_name])))


def rows(shape, seed=0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    x = gen.standard_normal(shape).astype(np.float32)
    x[0, :7] *= 40  # an outlier group: its scale differs by far from the others
    return x


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_naive_dequantize_is_gguf_bit_for_bit(type_name, shape):
    blocks = blocks_of(rows(shape), type_name)
    w = packed_from_blocks(blocks, type_name, shape, "t")
    assert w.shape == (shape[1], shape[0])  # [in, out]
    ours = dequant_gemm.dequantize_rows(w)  # [out, in]
    ref = reference(blocks, type_name)
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)
    assert torch.equal(dequant_gemm.dequantize(w), ref.t())
    assert w.nbytes == blocks.nbytes  # nothing added, nothing lost


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_cuts_and_concatenation_are_exact(type_name):
    a, b = rows((5, 64), 1), rows((7, 64), 2)
    wa = packed_from_blocks(blocks_of(a, type_name), type_name, a.shape, "a")
    wb = packed_from_blocks(blocks_of(b, type_name), type_name, b.shape, "b")
    both = cat_out_features([wa, wb])
    ref = torch.cat([dequant_gemm.dequantize_rows(wa), dequant_gemm.dequantize_rows(wb)])
    assert torch.equal(dequant_gemm.dequantize_rows(both), ref)
    order = torch.tensor([3, 0, 11, 5])
    assert torch.equal(dequant_gemm.dequantize_rows(both, order), ref[order])
    assert torch.equal(dequant_gemm.gather_rows(both, order, torch.float32), ref[order])
    assert torch.equal(dequant_gemm.dequantize_rows(both.in_features(32, 64)), ref[:, 32:64])
    with pytest.raises(PackedWeightError, match="groups of 32"):
        both.in_features(16, 64)


@pytest.mark.parametrize("type_name", TYPES)
def test_quantize_writes_the_reference_quantizers_codes(type_name):
    x = rows((6, 96), 3)
    w = quantize(torch.from_numpy(x).t(), type_name.lower())  # [in, out]
    ref = reference(blocks_of(x, type_name), type_name)
    assert torch.equal(dequant_gemm.dequantize_rows(w), ref)


def test_naive_product_is_x_at_the_dequantized_matrix():
    x = rows((4, 64), 4)
    w = packed_from_blocks(blocks_of(x, "Q4_1"), "Q4_1", x.shape, "w")
    a = torch.randn(3, 64)
    assert torch.equal(dequant_gemm.naive(a, w), a @ dequant_gemm.dequantize(w))


def test_truncated_or_bad_blocks_are_one_line_errors():
    x = rows((4, 64), 5)
    blocks = blocks_of(x, "Q4_1")
    with pytest.raises(StagewiseError, match="truncated or corrupt"):
        packed_from_blocks(blocks.reshape(-1)[:-3], "Q4_1", x.shape, "t")
    with pytest.raises(StagewiseError, match="not whole blocks"):
        packed_from_blocks(blocks, "Q4_1", (8, 40), "t")
    bad = blocks.copy()
    bad[0, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(StagewiseError, match="NaN or infinite"):
        packed_from_blocks(bad, "Q4_1", x.shape, "t")
    w = packed_from_blocks(blocks, "Q4_1", x.shape, "t")
    with pytest.raises(PackedWeightError, match="mins"):
        type(w)("q4_1", w.codes, w.scales, None)
