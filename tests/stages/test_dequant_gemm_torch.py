"""The torch tier of the dequantize-GEMM (PyTorch's int4pack CPU kernel for 4-bit weights, a bfloat16
copy for 8-bit ones) against the naive tier, on small irregular shapes.

The torch tier rounds the activations and the output to bfloat16, whose 8-bit significand is good to a
relative 2**-9 (0.2 %) per value; summed over K products the error stays within a few tenths of a percent
of the output's largest value. The bound below, 1 % of max |naive|, leaves room for that and still fails
a wrong mapping (a missing + 8d zero point, swapped groups or scales shift outputs by tens of percent).
"""

import pytest
import torch

from stagewise.stages import dequant_gemm, dequant_gemm_torch
from stagewise.stages.quantize import quantize


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 5])
def test_torch_tier_matches_naive_to_bfloat16_rounding(kind, m):
    gen = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(96, 40, generator=gen) / 96**0.5, kind)  # K = 96: three groups of 32
    x = torch.randn(m, 96, generator=gen)
    ref = dequant_gemm.naive(x, w)  # [m, 40]
    out = dequant_gemm_torch.gemm(x, dequant_gemm_torch.prepare(w))
    assert out.shape == ref.shape
    worst = (out.float() - ref).abs().max().item()
    assert worst <= 1e-2 * ref.abs().max().item(), (kind, m, worst, ref.abs().max().item())
