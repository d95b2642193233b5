"""The fused Triton `silu_and_mul` (`kernels/activation.py`) against the naive ffn reference."""

import math

import pytest
import torch

import stagewise.kernels.activation as activation
from stagewise.kernels.activation import silu_and_mul
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.row_tiles import TileConfig
from stagewise.stages.ffn import silu_and_mul_naive
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Kernel vs an fp32 reference from the same inputs: the kernel computes in fp32 and rounds once at the
# store (half an ulp: 2**-9 relative in bf16, 2**-12 in fp16); allow two ulps for GPU math differences.
ROUNDING_TOL = {  # (atol, rtol)
    torch.float32: TOLERANCES[torch.float32],
    torch.bfloat16: (1e-4, 2**-7),
    torch.float16: (1e-5, 2**-10),
}


def test_worked_example():
    # gate = [0, 1, -1], up = [2, 3, 4]; silu(g) = g / (1 + e^-g)
    gate_up = torch.tensor([[0.0, 1.0, -1.0, 2.0, 3.0, 4.0]], device=DEVICE)
    sig1 = 1 / (1 + math.exp(-1))  # 0.7310586
    expected = torch.tensor([[0.0, 1 * sig1 * 3, -1 * (1 - sig1) * 4]], device=DEVICE)  # [0, 2.1931758, -1.0757656]
    assert_close(silu_and_mul(gate_up), expected, 1e-6, 1e-6, what="worked example")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("inter", [24, 100, 1100])  # 1100: a 2048-column tile, 948 columns masked off
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_matches_naive_reference(num_tokens, inter, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + inter)
    gate_up = (3 * torch.randn(num_tokens, 2 * inter, generator=gen)).to(DEVICE, dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype and out.is_contiguous()
    expected = silu_and_mul_naive(gate_up.float())
    assert_close(out, expected, *ROUNDING_TOL[dtype], what=f"silu_and_mul T={num_tokens} inter={inter} {dtype}")


def test_tiles():
    # Llama-3-8B: 2048 columns divide inter = 14336 (7 blocks), 2 rows per program: 8 KB of gate + 8 KB of up.
    assert activation.silu_and_mul_tiles(9362, 14336, interpreter=True) == (TileConfig(2, 4, 2048),)
    assert activation.silu_and_mul_tiles(9362, 1536, interpreter=True)[0].block_c == 512  # SmolLM2: 3 x 512
    assert activation.silu_and_mul_tiles(5, 100, interpreter=True)[0].block_c == 128  # no divisor >= 256: masked
    candidates = activation.silu_and_mul_tiles(9362, 14336, interpreter=False)
    assert TileConfig(2, 4, 2048) in candidates and len(candidates) > 1  # a GPU autotunes around it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ragged_row_and_column_tiles(monkeypatch, dtype):
    # 4 rows x 32 columns per program: 7 rows -> tiles of 4 + 3; inter 100 -> 3 x 32 + 4 columns; rows strided.
    monkeypatch.setattr(activation, "MAX_BLOCK", 32)
    monkeypatch.setattr(activation, "TOKEN_TILE", 4 * 32)
    assert activation.silu_and_mul_tiles(7, 100, interpreter=True) == (TileConfig(4, 4, 32),)
    gen = torch.Generator().manual_seed(7)
    wide = (3 * torch.randn(7, 2 * 100 + 5, generator=gen)).to(DEVICE, dtype)
    gate_up = wide[:, 5:]  # rows strided by 205
    expected = silu_and_mul_naive(gate_up.float())
    assert_close(silu_and_mul(gate_up), expected, *ROUNDING_TOL[dtype], what="ragged tiles")


def test_strided_rows():
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(9, 2 * 100 + 13, generator=gen).to(DEVICE)
    gate_up = wide[:, 7 : 7 + 200]  # rows strided by 213, starting 7 columns in; last dim contiguous
    assert not gate_up.is_contiguous()
    assert_close(silu_and_mul(gate_up), silu_and_mul_naive(gate_up), *TOLERANCES[torch.float32], what="strided")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(200) = inf
def test_saturates_without_nan():
    # exp(200) overflows fp32: sigmoid must still be 0 or 1
    gate_up = torch.tensor([[-200.0, 200.0, 0.5, 2.0]], device=DEVICE)
    out = silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    assert_close(out, torch.tensor([[-0.0, 400.0]], device=DEVICE), 1e-6, 1e-6, what="saturation")


def test_empty():
    assert silu_and_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.randn(4, 7), r"last dimension must be even"),
        (lambda: torch.randn(8, 4).t(), r"must have a contiguous last dimension"),
        (lambda: torch.randn(4, 16)[:, ::2], r"must have a contiguous last dimension"),
        (lambda: torch.randn(2, 4, 8), r"gate_up must be 2-D"),
        (lambda: torch.ones(4, 8, dtype=torch.int64), r"gate_up has dtype int64"),
    ],
    ids=["odd", "transposed", "step-2", "3d", "int"],
)
def test_launcher_errors(make, message):
    with torch.device(DEVICE):
        bad = make()
    with pytest.raises(KernelInputError, match=message) as err:
        silu_and_mul(bad)
    assert str(err.value).startswith("silu_and_mul:")
