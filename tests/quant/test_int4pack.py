"""One layout held: int4pack's exact inverse, and packed weights whose file codes were released.

The expected values come from outside the code under test: PyTorch's own packing
(`_convert_weight_to_int4pack_for_cpu`) for the inverse, and llama.cpp's reference
(`gguf.quants`) for the numbers the naive tier must still give once the codes are rebuilt.
"""

import gguf
import numpy as np
import pytest
import torch

from stagewise.quant import int4pack
from stagewise.quant.dequantize import dequantize_rows, gather_rows
from stagewise.quant.gguf_blocks import packed_from_blocks
from stagewise.stages import dequant_gemm_torch

# PyTorch's int4 kernel's layout: the torch tier's form without the compiled integer-dot kernel
pytestmark = pytest.mark.usefixtures("stock_kernels")

# [N, K]: a tail block of 16 / 48 rows after full ones (64 rows with AVX-512), K of 1, 3, 9 tiles
SHAPES = [(16, 64), (80, 192), (112, 576), (48, 128)]


def torch_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)


@pytest.mark.parametrize("shape", SHAPES)
def test_unpack_inverts_pytorchs_packing_exactly(shape):
    q = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(shape[0]))
    packed = torch_pack(q)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert torch.equal(int4pack.unpack(packed).to(torch.int64), q)
    rows = torch.tensor([shape[0] - 1, 0, 17 % shape[0], shape[0] // 2, 0])  # tail, repeats
    assert torch.equal(int4pack.unpack_rows(packed, rows).to(torch.int64), q[rows])


def packed(type_name: str, shape: tuple[int, int], seed: int = 0):
    """A GGUF-quantized [out, in] matrix as a PackedWeight, and llama.cpp's float32 values."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[1, :5] *= 30  # an outlier group
    qtype = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(x, qtype)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype)))
    return packed_from_blocks(blocks, type_name, shape, "w"), ref, blocks.nbytes


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_released_codes_rebuild_the_files_numbers(type_name):
    w, ref, file_bytes = packed(type_name, (80, 192))
    codes = w.codes.clone()
    x = torch.randn(3, 192)
    before = dequant_gemm_torch.gemm(x, w)  # builds the form, then releases the codes
    assert not w.codes_held
    ids = torch.tensor([79, 3, 3, 64])
    assert torch.equal(gather_rows(w, ids, torch.float32), ref[ids])  # the embedding's rows
    assert torch.equal(dequantize_rows(w.out_features(slice(16, 48))), ref[16:48])  # a TP cut
    assert not w.codes_held  # rows were rebuilt, not the matrix
    assert torch.equal(dequant_gemm_torch.gemm(x, w), before)  # the torch tier reads its form
    assert w.nbytes == file_bytes  # the weight's value: the file's bytes, whichever form holds it
    assert torch.equal(w.codes, codes)  # rebuilt bit for bit from the int4pack form, then kept
    assert w.codes_held and w.held_bytes() == file_bytes + w.prepared_bytes()
    assert torch.equal(dequantize_rows(w), ref)  # the naive tier: still gguf's float32 values
    assert torch.equal(dequantize_rows(w.in_features(64, 192)), ref[:, 64:])  # a row-parallel cut


def test_held_bytes_count_one_layout():
    w, _, file_bytes = packed("Q4_1", (64, 128))
    assert w.codes_held and w.held_bytes() == w.nbytes == file_bytes
    dequant_gemm_torch.prepare(w)
    code_bytes = 64 * 128 // 2  # two 4-bit codes a byte
    form = w.prepared["torch"]
    form_bytes = sum(t.numel() * t.element_size() for t in form)
    assert form[0].numel() == code_bytes  # int4pack: the same 4 bits a code
    assert w.held_bytes() == file_bytes - code_bytes + form_bytes
    assert w.file_parts()["codes"].shape == (64, 64)  # the tracer's view: shape, no rebuild


def test_a_rounded_form_keeps_the_codes():
    """N = 17 is not a multiple of 16: q8_0 gets a bfloat16 copy, which cannot give codes back."""
    w, ref, file_bytes = packed("Q8_0", (17, 64))
    dequant_gemm_torch.prepare(w)
    assert dequant_gemm_torch.form_name(w) == "bf16" and w.codes_held
    assert torch.equal(dequantize_rows(w), ref)
    assert w.held_bytes() == file_bytes + 17 * 64 * 2
