"""silu(gate) * up fused into the split-K down GEMM's input load (`kernels/silu_down.py`).

Against the naive ffn stages (fp32 from the same rounded inputs), against the unfused Triton pair
(`silu_and_mul`, then the decode GEMM) bit for bit with the same config (both round h to the
activation dtype before the dot), and the ffn stage's Triton tier against its naive tier on both
sides of the 16-row limit. Tiny irregular shapes: inter 37 and 100 leave a partial last step of K.
"""

import math

import pytest
import torch

from stagewise.kernels.activation import silu_and_mul
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.matmul_decode import INTERPRETER_CONFIG, DecodeConfig, matmul_decode
from stagewise.kernels.silu_down import candidates, fuses, shared_memory_bytes, silu_down
from stagewise.quant.quantize import quantize
from stagewise.stages import ffn
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPLIT3 = DecodeConfig(block_n=16, block_k=16, split_k=3)  # 3 K ranges per 16 columns: partial tiles
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


def _operands(m: int, inter: int, n: int, dtype: torch.dtype, seed: int = 0):
    """gate_up [m, 2*inter] of O(1) values, w_down [inter, n] scaled so outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = 2 * torch.randn(m, 2 * inter, generator=gen)
    w_down = torch.randn(inter, n, generator=gen) / inter**0.5
    return gate_up.to(DEVICE, dtype), w_down.to(DEVICE, dtype)


def _reference(gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The naive ffn's second half in fp32 on the CPU: silu_and_mul_naive, then `product`."""
    return ffn.product(ffn.silu_and_mul_naive(gate_up.float().cpu()), w_down.float().cpu())


def _unfused(gate_up: torch.Tensor, w_down: torch.Tensor, config: DecodeConfig) -> torch.Tensor:
    """The Triton pair the fusion replaces: h written by silu_and_mul, read by the decode GEMM."""
    c = torch.empty(gate_up.shape[0], w_down.shape[1], device=DEVICE, dtype=gate_up.dtype)
    return matmul_decode(silu_and_mul(gate_up), w_down, c, config=config)


def test_worked_example():
    # gate = [0, 1, -1], up = [2, 3, 4]: h = [0, 3 sigmoid(1), -4 sigmoid(-1)] = [0, 2.1931758, -1.0757656]
    # w_down = [[1, 0], [0, 1], [1, 1]]: out = [h0 + h2, h1 + h2] = [-1.0757656, 1.1174102]
    gate_up = torch.tensor([[0.0, 1.0, -1.0, 2.0, 3.0, 4.0]], device=DEVICE)
    w_down = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], device=DEVICE)
    sig1 = 1 / (1 + math.exp(-1))
    h1, h2 = 3 * sig1, -4 * (1 - sig1)
    expected = torch.tensor([[h2, h1 + h2]])
    assert_close(silu_down(gate_up, w_down), expected, 1e-6, 1e-6, what="worked example")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("inter, n", [(37, 24), (100, 40)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_naive_and_the_unfused_pair(m, inter, n, dtype):
    gate_up, w_down = _operands(m, inter, n, dtype, seed=m * 100 + inter)
    for config in (INTERPRETER_CONFIG, SPLIT3):  # one split; three with the fused ordered sum
        out = silu_down(gate_up, w_down, config=config)
        assert out.shape == (m, n) and out.dtype == dtype and out.is_contiguous()
        what = f"silu_down M={m} inter={inter} {dtype} {config}"
        assert_close(out, _reference(gate_up, w_down), *TOLERANCES[dtype], what=what)
        # h rounded to the activation dtype before the dot, as silu_and_mul's store rounds it
        assert torch.equal(out, _unfused(gate_up, w_down, config)), what + ": not the unfused bits"


def test_second_kernel_sum_gives_the_fused_sum_bits():
    gate_up, w_down = _operands(5, 100, 40, torch.bfloat16, seed=7)
    fused = silu_down(gate_up, w_down, config=SPLIT3)
    assert torch.equal(silu_down(gate_up, w_down, config=SPLIT3, fused_sum=False), fused)


def test_strided_rows_are_read_in_place():
    gate_up, w_down = _operands(3, 37, 24, torch.float32)
    wide = torch.cat([gate_up, torch.full((3, 5), 1e4, device=DEVICE)], dim=1)  # [3, 2*37 + 5]
    view = wide[:, : 2 * 37]  # rows 79 apart; the extra columns must never be read
    assert_close(silu_down(view, w_down), _reference(gate_up, w_down), *TOLERANCES[torch.float32])
    assert_close(silu_down(gate_up, w_down.t().contiguous().t()), _reference(gate_up, w_down), 1e-5, 1e-5)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda g, w: silu_down(g, w.to(torch.bfloat16)), r"gate_up is torch.float32, w_down torch.bfloat16"),
        (lambda g, w: silu_down(g[:, :-1], w), r"gate_up \[3, 73\] must be \[M, 2 \* inter\]"),
        (lambda g, w: silu_down(g[:, :72], w), r"for w_down \[inter, N\] = \[37, 24\]"),
        (lambda g, w: silu_down(g.repeat(6, 1)[:17], w), r"17 rows; the fused decode kernel takes <= 16"),
        (lambda g, w: silu_down(g.t().contiguous().t(), w), r"gate_up must have a contiguous last dimension"),
        (lambda g, w: silu_down(g[None], w), r"gate_up must be 2-D, got shape \[1, 3, 74\]"),
        (lambda g, w: silu_down(g.int(), w.int()), r"gate_up has dtype int32"),
    ],
    ids=["dtype-mix", "odd-width", "inter-mismatch", "17-rows", "column-major", "3d", "int"],
)
def test_launcher_refuses_wrong_layouts_in_one_line(make, message):
    gate_up, w_down = _operands(3, 37, 24, torch.float32)
    with pytest.raises(KernelInputError, match=message) as err:
        make(gate_up, w_down)
    assert str(err.value).startswith("silu_down:") and "\n" not in str(err.value)


def test_empty_shapes():
    gate_up, w_down = _operands(3, 37, 24, torch.float32)
    assert silu_down(gate_up[:0], w_down).shape == (0, 24)
    assert torch.equal(silu_down(gate_up[:, :0], w_down[:0]), torch.zeros(3, 24, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens", [3, 19])  # 19: past 16 rows, silu_and_mul then the tiled GEMM
def test_ffn_triton_tier_matches_naive(num_tokens, dtype):
    from stagewise.config import PRESETS

    inputs = ffn.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    gate_up = inputs["x"] @ inputs["w_gate_up"]
    assert fuses(gate_up, inputs["w_down"]) == (num_tokens <= 16)
    expected = ffn.naive(**inputs)
    assert_close(ffn.triton(**inputs), expected, *TOLERANCES[dtype], what=f"ffn T={num_tokens} {dtype}")


def test_packed_or_mismatched_weights_keep_the_unfused_path():
    gate_up, w_down = _operands(3, 64, 40, torch.float32)
    assert fuses(gate_up, w_down)
    assert not fuses(gate_up, quantize(w_down.cpu(), "q8_0"))  # the dequantize-GEMM's
    assert not fuses(gate_up, w_down.to(torch.bfloat16))  # the tiled GEMM says what is wrong


def test_shared_memory_estimate_and_stage_cut():
    # two [16, K] A-side tiles a stage: 3 x (128 x 128 + 2 x 16 x 128) x 2 B = 122880 B = 120 KB
    assert shared_memory_bytes(DecodeConfig(128, 128, 1, 4, 4), 2) == 122880
    budget = 99 * 1024 - 8 * 1024  # sm_89's opt-in limit less the decode GEMM's headroom
    found = candidates(4096, 14336, 2, 128, budget, fma=False)  # Llama-3-8B down_proj, bf16
    assert found and all(shared_memory_bytes(c, 2) <= budget for c in found)
    # the 64 x 128 tile keeps the plain GEMM's 5 stages there (4 x 20 KB = 80 KB); with the second A-side
    # tile 5 stages would be 4 x 24 KB = 96 KB > 91 KB, so it gets 4 (72 KB)
    assert {c.num_stages for c in found if (c.block_n, c.block_k) == (64, 128)} == {4}
