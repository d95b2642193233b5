"""Triton RMSNorm (with the fused residual add) vs the naive reference.

Chain: a hand-checkable worked example -> irregular shapes, both dtypes, with and
without residual -> return semantics -> the registry stage -> the launcher's errors.
"""

import math

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.rmsnorm import rmsnorm
from stagewise.stages import STAGES
from stagewise.stages.rmsnorm import naive
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-5

# bf16: the naive reference runs on the same bf16 inputs, so only rounding differs. The kernel
# rounds three times (x + residual, normed, weight * normed), as the reference does, but
# Triton's interpreter casts fp32 -> bf16 by truncation while PyTorch rounds to nearest: up to
# 1 ulp (<= 2^-7 relative) per rounding, and a 1-ulp residual difference carries through the
# norm. Hence 2^-7 for residual_out (one rounding) and 4 * 2^-7 for out. A GPU rounds to
# nearest and lands well inside these.
TOL = {
    torch.float32: {"out": TOLERANCES[torch.float32], "residual_out": (0.0, 0.0)},
    torch.bfloat16: {"out": (1e-3, 4 * 2**-7), "residual_out": (0.0, 2**-7)},
}


def random_rows(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3.0 * torch.randn(num_tokens, hidden, generator=gen)).to(DEVICE, dtype)


def check_against_naive(x, weight, residual):
    out, residual_out = rmsnorm(x, weight, EPS, residual)
    ref_out, ref_residual_out = naive(x, weight, EPS, residual)
    assert out.dtype == ref_out.dtype and residual_out.dtype == ref_residual_out.dtype
    tol = TOL[x.dtype]
    assert_close(out, ref_out, *tol["out"], what="out")
    assert_close(residual_out, ref_residual_out, *tol["residual_out"], what="residual_out")
    return out, residual_out


def test_worked_example():
    # Row [3, 4]: mean square (9 + 16) / 2 = 12.5, so out = weight * [3, 4] / sqrt(12.5 + eps).
    # With residual [1, -2] the row is first [4, 2]: mean square 10, out = weight * [4, 2] / sqrt(10 + eps).
    x = torch.tensor([[3.0, 4.0]], device=DEVICE)
    weight = torch.tensor([1.0, 2.0], device=DEVICE)
    out, _ = rmsnorm(x, weight, EPS)
    s = 1 / math.sqrt(12.5 + EPS)
    assert_close(out, torch.tensor([[3 * s, 8 * s]]), 1e-6, 1e-6, what="no residual")
    out, residual_out = rmsnorm(x, weight, EPS, residual=torch.tensor([[1.0, -2.0]], device=DEVICE))
    s = 1 / math.sqrt(10 + EPS)
    assert residual_out.tolist() == [[4.0, 2.0]]
    assert_close(out, torch.tensor([[4 * s, 4 * s]]), 1e-6, 1e-6, what="with residual")


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 100])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_matches_naive(num_tokens, hidden, dtype, with_residual):
    x = random_rows(num_tokens, hidden, dtype, seed=1)
    residual = random_rows(num_tokens, hidden, dtype, seed=2) if with_residual else None
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(DEVICE, dtype)
    x_before = x.clone()
    check_against_naive(x, weight, residual)
    assert torch.equal(x, x_before), "the inputs must not be modified"


def test_residual_out_is_x_itself_without_residual():
    x = random_rows(7, 96, torch.float32, seed=1)
    _, residual_out = rmsnorm(x, torch.ones(96, device=DEVICE), EPS)
    assert residual_out is x  # the same object, as the naive reference returns


def test_strided_rows():
    # x and residual as column slices of wider buffers: row stride 128, not hidden.
    x = random_rows(7, 128, torch.float32, seed=1)[:, 10:106]
    residual = random_rows(7, 128, torch.float32, seed=2)[:, :96]
    check_against_naive(x, torch.ones(96, device=DEVICE), residual)


def test_bf16_input_with_fp32_weight_promotes_like_pytorch():
    x = random_rows(7, 100, torch.bfloat16, seed=1)
    weight = torch.linspace(0.5, 1.5, 100, device=DEVICE)  # float32
    out, _ = rmsnorm(x, weight, EPS)
    assert out.dtype == torch.float32
    # fp32 out of a bf16-rounded normed row: the only difference is that one (truncating) rounding.
    assert_close(out, naive(x, weight, EPS)[0], 1e-3, 2**-7, what="mixed dtypes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage(num_tokens, dtype):
    stage = STAGES["rmsnorm"]
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    out, residual_out = stage.triton(**inputs)
    ref_out, ref_residual_out = stage.naive(**inputs)
    assert_close(out, ref_out, *TOL[dtype]["out"], what="out")
    assert_close(residual_out, ref_residual_out, *TOL[dtype]["residual_out"], what="residual_out")
    assert stage.triton_kind.startswith("triton")


def t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)  # views of it keep their strides on any device


@pytest.mark.parametrize(
    "x, weight, residual, message",
    [
        (t(4, 8, dtype=torch.int32), t(8), None, "x has dtype int32"),
        (t(4, 8), t(8, dtype=torch.int64), None, "weight has dtype int64"),
        (t(4, 8), t(9), None, r"weight has shape \[9\], expected \[8\]"),
        (t(2, 4, 8), t(8), None, "x must be 2-D"),
        (t(8, 4).t(), t(4), None, "x must have a contiguous last dimension"),
        (t(4, 8), t(8), t(3, 8), r"residual has shape \[3, 8\], expected \[4, 8\]"),
        (t(4, 8), t(8), t(4, 8, dtype=torch.bfloat16), "residual has dtype .* they must match"),
        (t(4, 8), t(16)[::2], None, "weight must be contiguous"),
    ],
)
def test_launcher_errors(x, weight, residual, message):
    residual = None if residual is None else residual.to(DEVICE)
    with pytest.raises(KernelInputError, match=message):
        rmsnorm(x.to(DEVICE), weight.to(DEVICE), EPS, residual)
