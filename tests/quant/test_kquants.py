"""K-quants kept (Q4_K, Q5_K, Q6_K): the naive dequantization equals `gguf.quants.dequantize` bit
for bit, the torch and Triton tiers agree with naive, and bad blocks are refused in one line.

`gguf` has no K-quant quantizer, so the blocks are random bytes with finite float16 d / dmin
(every code and sub-scale pattern occurs) or a plain round-to-nearest (tests/kquant_blocks.py).
"""

import numpy as np
import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.dequant_matmul import dequant_matmul
from stagewise.quant.gguf_blocks import packed_from_blocks
from stagewise.quant.packed_weight import PackedWeightError
from stagewise.stages import dequant_gemm, dequant_gemm_torch
from tests.kquant_blocks import dequantize_reference, quantize_k, random_blocks

TYPES = ["Q4_K", "Q5_K", "Q6_K"]
HELD = {"Q4_K": 0.75, "Q5_K": 1.25, "Q6_K": 1.25}  # bytes per weight held (packed_weight.py)


def packed(type_name: str, n: int = 5, k: int = 512, seed: int = 0):
    rows = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    blocks = quantize_k(rows, type_name)
    return packed_from_blocks(blocks, type_name, (n, k), "w"), blocks


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(7, 768), (1, 256)])
def test_random_blocks_dequantize_as_gguf_bit_for_bit(type_name, shape):
    blocks = random_blocks(*shape, type_name, seed=shape[0])
    w = packed_from_blocks(blocks, type_name, shape, "w")
    ref = torch.from_numpy(dequantize_reference(blocks, type_name))
    assert w.kind == type_name.lower() and w.shape == (shape[1], shape[0])
    assert torch.equal(dequant_gemm.dequantize_rows(w), ref)
    assert w.nbytes == shape[0] * shape[1] * HELD[type_name]
    order = torch.tensor([0, shape[0] - 1, 0])
    assert torch.equal(dequant_gemm.gather_rows(w, order, torch.float32), ref[order])


@pytest.mark.parametrize("type_name", TYPES)
def test_cuts_at_group_boundaries_are_exact(type_name):
    w, blocks = packed(type_name)
    ref = torch.from_numpy(dequantize_reference(blocks, type_name))
    g = w.group_size  # 32, or 16 for q6_k: a row-parallel shard may cut between any two groups
    assert torch.equal(dequant_gemm.dequantize_rows(w.in_features(g, 8 * g)), ref[:, g : 8 * g])
    with pytest.raises(PackedWeightError, match=f"groups of {g}"):
        w.in_features(g // 2, 8 * g)


@pytest.mark.parametrize("type_name", TYPES)
def test_torch_tier_agrees_with_naive(type_name):
    """bfloat16 activations and (int4pack) scales: ~8 significant bits, so 2% of the output's size."""
    for n in (48, 5):  # 48: the int4 kernel's forms; 5 (N % 16): the bf16 copy
        w, _ = packed(type_name, n=n)
        x = torch.randn(3, 512, generator=torch.Generator().manual_seed(n))
        ref = dequant_gemm.naive(x, w)
        out = dequant_gemm_torch.gemm(x, w)
        torch.testing.assert_close(out, ref, rtol=0, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("type_name", TYPES)
def test_triton_tier_agrees_with_naive(type_name):
    w, _ = packed(type_name, n=5, k=256)
    for m in (2, 17):  # a decode row tile (split K), and a prefill tile of M
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        torch.testing.assert_close(dequant_gemm.triton(x, w), dequant_gemm.naive(x, w), rtol=1e-5, atol=1e-5)


def test_bad_blocks_are_refused_in_one_line():
    blocks = random_blocks(3, 512, "Q4_K")
    with pytest.raises(StagewiseError, match="needs 864 .truncated or corrupt"):
        packed_from_blocks(blocks[:, :-1], "Q4_K", (3, 512), "w")
    with pytest.raises(StagewiseError, match="not whole blocks of 256"):
        packed_from_blocks(blocks, "Q4_K", (6, 256 + 32), "w")
    bad = blocks.reshape(3, 2, 144).copy()
    bad[1, 0, 2:4] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # dmin = inf
    with pytest.raises(StagewiseError, match="Q4_K mins hold NaN or infinite"):
        packed_from_blocks(bad.reshape(3, -1), "Q4_K", (3, 512), "w")
    q6 = random_blocks(2, 256, "Q6_K").reshape(2, 210).copy()
    q6[0, 208:210] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    with pytest.raises(StagewiseError, match="Q6_K scales hold NaN"):
        packed_from_blocks(q6, "Q6_K", (2, 256), "w")
    with pytest.raises(StagewiseError, match="must be raw bytes"):
        packed_from_blocks(blocks.astype(np.int16), "Q4_K", (3, 512), "w")


def test_wrong_layouts_are_refused():
    w, _ = packed("Q6_K")
    with pytest.raises(PackedWeightError, match="groups are 16 values"):
        type(w)("q6_k", w.codes, w.scales, group_size=32)
    with pytest.raises(PackedWeightError, match="scales must be torch.float32"):
        type(w)("q6_k", w.codes, w.scales.half())
    x = torch.randn(1, 512)
    with pytest.raises(KernelInputError, match="mins must be torch.float32"):
        q4, _ = packed("Q4_K")
        dequant_matmul(x, q4.codes, q4.scales, q4.mins.half(), bits=4, offset=0)
    with pytest.raises(KernelInputError, match="group_size 24"):
        dequant_matmul(x, w.codes, w.scales, None, bits=8, offset=0, group_size=24)
