"""The torch tier of the dequantize-GEMM against the naive tier, on small irregular shapes: the
integer-dot kernel (cpu/int8_dot.py, tests/cpu/ proves its bits), and without it (`stock_kernels`)
PyTorch's int4pack CPU kernel for 4-bit weights and, split into two nibbles, for 8-bit ones; a
bfloat16 copy where N is not a multiple of 16.

The torch tier rounds the activations and the output to bfloat16, whose 8-bit significand is good to a
relative 2**-9 (0.2 %) per value; summed over K products the error stays within a few tenths of a percent
of the output's largest value. The bound below, 1 % of max |naive|, leaves room for that and still fails
a wrong mapping (a missing + 8d zero point, swapped groups or scales shift outputs by tens of percent).
"""

import pytest
import torch

from stagewise.quant.quantize import quantize
from stagewise.stages import dequant_gemm, dequant_gemm_torch


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("n", [40, 48])  # 48: the int4 kernel's forms; 40: the bf16 copy (q8_0)
@pytest.mark.parametrize("kernels", ["int8_dot", "stock"])
def test_torch_tier_matches_naive_to_bfloat16_rounding(kind, m, n, kernels, monkeypatch):
    """int8 activations per block of 32 (int8_dot) or bfloat16 ones (stock): both within 1 %."""
    monkeypatch.setenv("STAGEWISE_CPU_KERNELS", "1" if kernels == "int8_dot" else "0")
    gen = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(96, n, generator=gen) / 96**0.5, kind)  # K = 96: three groups of 32
    x = torch.randn(m, 96, generator=gen)
    ref = dequant_gemm.naive(x, w)  # [m, n]
    out = dequant_gemm_torch.gemm(x, dequant_gemm_torch.prepare(w))
    assert (dequant_gemm_torch.form_name(w) == "rows8") == (kernels == "int8_dot")
    assert out.shape == ref.shape
    worst = (out.float() - ref).abs().max().item()
    assert worst <= 1e-2 * ref.abs().max().item(), (kind, m, n, worst, ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 3])
def test_q8_0_split_into_nibbles_is_exact_but_for_the_output_rounding(m, stock_kernels):
    """q8_0 through the int4 kernel, each code split in two nibbles (q = 16 (h - 8) + l).

    Scales that are powers of two and small integer activations are exact in bfloat16, and
    float32 holds every partial sum exactly, so the only rounding left is the bfloat16 output
    (a relative 2**-9, below 2**-8 per value): every code's split must be right, value by value.
    """
    from stagewise.quant.packed_weight import PackedWeight

    gen = torch.Generator().manual_seed(5)
    n, k = 48, 96  # N a multiple of 16 (the int4 kernel's), K three groups of 32
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (2.0 ** -torch.randint(4, 9, (n, k // 32), generator=gen)).half()
    w = PackedWeight("q8_0", codes, scales)
    x = torch.randint(-3, 4, (m, k), generator=gen).float()
    assert dequant_gemm_torch.form_name(w) == "q8_nibbles"
    ref = dequant_gemm.naive(x, w)  # [m, 48]
    out = dequant_gemm_torch.gemm(x, dequant_gemm_torch.prepare(w))
    assert ((out - ref).abs() <= ref.abs() * 2**-8).all(), (out - ref).abs().max()
