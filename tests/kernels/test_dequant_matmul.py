"""The fused Triton dequantize-GEMM against the stage's naive tier (dequantize, then x @ w).

Tiny shapes under the interpreter: K = 64 (two groups, two split-K ranges in decode), N = 40
(a partial tile of columns), M = 1 and 3 (the split-K decode launch) and 33 (prefill tiles).
"""

import pytest
import torch

from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.dequant_matmul import dequant_matmul
from stagewise.quant.quantize import quantize
from stagewise.stages import dequant_gemm


def packed(kind: str, k: int = 64, n: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(k, n, generator=gen) / k**0.5, kind)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 3, 33])
def test_kernel_matches_naive(kind, m):
    w = packed(kind)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(1))
    ref = dequant_gemm.naive(x, w)
    out = dequant_gemm.triton(x, w)
    assert out.shape == (m, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strided_activations_are_read_in_place():
    w = packed("q4_1")
    x = torch.randn(64, 2)[:, :1].t()  # [1, 64] with a column stride of 2
    torch.testing.assert_close(dequant_gemm.triton(x, w), dequant_gemm.naive(x, w))


def test_bad_inputs_are_one_line_errors():
    w = packed("q4_1")
    with pytest.raises(KernelInputError, match="do not hold K"):
        dequant_matmul(torch.randn(1, 32), w.codes, w.scales, w.mins, bits=4, offset=0)
    with pytest.raises(KernelInputError, match="float16"):
        dequant_matmul(torch.randn(1, 64), w.codes, w.scales.float(), w.mins, bits=4, offset=0)
    with pytest.raises(KernelInputError, match="codes must be"):
        dequant_matmul(torch.randn(1, 64), w.codes, w.scales, w.mins, bits=8, offset=0)
