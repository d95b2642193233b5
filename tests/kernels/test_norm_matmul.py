"""RMSNorm fused into the decode GEMM (`kernels/norm_matmul.py`) against the naive stages composed.

Reference: `rmsnorm.naive` then `qkv_proj.naive`, on the same inputs. Shapes are tiny and irregular
(K not a multiple of the 64-deep step, so the interpreter's split of 2 ends on a partial step; N over
256, so two tiles of N, and only the first may write the residual). Then the launcher's refusals.
"""

import pytest
import torch

from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.norm_matmul import fits_norm_matmul, norm_matmul
from stagewise.stages import qkv_proj, rmsnorm
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5
TOL = {  # the product is rounded once more than a GEMM's output: a 16-bit ulp on either rounding
    torch.float32: TOLERANCES[torch.float32],
    torch.bfloat16: (2e-2, 2**-6),
    torch.float16: (2e-3, 2**-9),
}


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    residual = torch.randn(m, k, generator=gen)
    norm_weight = 1.0 + 0.1 * torch.randn(k, generator=gen)
    w = torch.randn(k, n, generator=gen) / k**0.5
    return [t.to(DEVICE, dtype) for t in (x, residual, norm_weight, w)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("m", "k", "n", "with_residual"), [(1, 130, 300, True), (5, 96, 40, False), (16, 200, 33, True)]
)
def test_fused_equals_rmsnorm_then_gemm(m, k, n, with_residual, dtype):
    x, residual, norm_weight, w = _inputs(m, k, n, dtype, seed=m + k)
    residual = residual if with_residual else None
    normed, expected_residual = rmsnorm.naive(x, norm_weight, EPS, residual)
    expected = qkv_proj.naive(normed, w)  # [M, K] @ [K, N]
    c, residual_out = norm_matmul(x, norm_weight, EPS, residual, w)
    assert c.shape == (m, n) and c.dtype == dtype
    assert_close(c, expected, *TOL[dtype], f"norm_matmul {m}x{k}x{n} {dtype}")
    assert torch.equal(residual_out, expected_residual), "x + residual, rounded once, written once"
    if residual is None:
        assert residual_out is x


def test_transposed_weight_view():
    """Weights kept [N, K] and passed as their transpose (a strided [K, N] view) give the same c."""
    x, residual, norm_weight, w = _inputs(3, 100, 50, torch.float32, seed=3)
    c, _ = norm_matmul(x, norm_weight, EPS, residual, w.t().contiguous().t())
    expected = qkv_proj.naive(rmsnorm.naive(x, norm_weight, EPS, residual)[0], w)
    assert_close(c, expected, *TOL[torch.float32], "transposed w")


def test_fits_only_decode_batches_of_plain_weights():
    x, _, norm_weight, w = _inputs(17, 32, 16, torch.float32)
    assert fits_norm_matmul(x[:16], norm_weight, w)
    assert not fits_norm_matmul(x, norm_weight, w)  # 17 rows: prefill, separate kernels
    assert not fits_norm_matmul(x[:4], norm_weight.half(), w)  # mixed dtypes
    assert not fits_norm_matmul(x[:4], norm_weight, object())  # a packed weight is not a tensor


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, r, g, w: (x, r, g[:-1], w), "norm_weight has shape"),
        (lambda x, r, g, w: (x, r, g, w[:-1]), "w has shape"),
        (lambda x, r, g, w: (x, r, g.half(), w), "must share one dtype"),
        (lambda x, r, g, w: (x.repeat(6, 1), r.repeat(6, 1), g, w), "decode batches of at most 16"),
        (lambda x, r, g, w: (x, r[:, :-1], g, w), "residual has shape"),
        (lambda x, r, g, w: (x.t().contiguous().t(), r, g, w), "contiguous last dimension"),
    ],
)
def test_launcher_refuses_wrong_layouts(change, match):
    x, r, g, w = change(*_inputs(3, 24, 16, torch.float32))
    with pytest.raises(KernelInputError, match=match):
        norm_matmul(x, g, EPS, r, w)
