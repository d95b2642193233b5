"""The Triton GEMM (`kernels/matmul.py`) against the naive stage references, on tiny irregular shapes.

Everything here runs in Triton's CPU interpreter when there is no GPU (~1 ms per
program instance), so shapes stay small but are chosen to leave partial tiles
in M, N and K.
"""

import pytest
import torch

import stagewise.kernels.matmul as matmul_module
from stagewise.config import PRESETS
from stagewise.stages import STAGES, o_proj, qkv_proj
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
matmul, GemmConfig, KernelInputError = matmul_module.matmul, matmul_module.GemmConfig, matmul_module.KernelInputError

# Kernel output vs an IEEE fp32 reference computed from the same low-precision inputs. fp32 assumes IEEE
# fp32 dots (the interpreter always; on a GPU tests/kernels/conftest.py keeps TF32 off). 16-bit inputs run
# 16-bit dots (fp16 in the interpreter too; bf16 is upcast there) whose products are exact in the fp32
# accumulator, so the only extra error is the final rounding to the output dtype (half an ulp, <= 2**-9
# relative in bf16, <= 2**-11 in fp16), plus a flipped rounding where a GPU sums in another order: two ulps.
ROUNDING_TOL = {  # (atol, rtol)
    torch.float32: TOLERANCES[torch.float32],
    torch.bfloat16: (1e-4, 2**-7),
    torch.float16: (1e-5, 2**-10),
}


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """a [m, k], b [k, n], scaled so outputs are O(1) whatever k (keeps fp32 absolute errors ~1e-7)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen) / k**0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The naive stage reference (`x @ w`) in fp32 from the same (possibly rounded) inputs."""
    return qkv_proj.naive(a.float(), b.float())


def test_worked_example_2x3_at_3x2():
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=DEVICE)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], device=DEVICE)
    # row 0: [1*1 + 2*0 + 3*1, 1*0 + 2*1 + 3*1] = [4, 5]; row 1: [4 + 6, 5 + 6] = [10, 11]
    expected = torch.tensor([[4.0, 5.0], [10.0, 11.0]], device=DEVICE)
    for dtype in (torch.float32, torch.bfloat16):
        c = matmul(a.to(dtype), b.to(dtype))
        assert c.dtype == dtype and c.is_contiguous()
        assert torch.equal(c.float(), expected)
    # gather rows 1, 1, 0 of a: [[10, 11], [10, 11], [4, 5]]
    gathered = matmul(a, b, row_index=torch.tensor([1, 1, 0], device=DEVICE))
    assert torch.equal(gathered, expected[[1, 1, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k,n", [(48, 24), (96, 160), (100, 200)])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_matches_naive_reference(m, k, n, dtype):
    a, b = _operands(m, k, n, dtype)
    c = matmul(a, b)
    assert c.shape == (m, n) and c.dtype == dtype and c.is_contiguous()
    assert_close(c, _reference(a, b), *ROUNDING_TOL[dtype], what=f"matmul {m}x{k}x{n} {dtype}")


@pytest.mark.skipif(not matmul_module.INTERPRETER, reason="pins the interpreter's bf16 rounding workaround")
def test_interpreter_bf16_store_rounds_to_nearest_even():
    # The interpreter's own fp32 -> bf16 cast truncates; the kernel rounds by hand, so it matches torch's
    # round-to-nearest-even of the fp32 result exactly.
    a, b = _operands(33, 100, 200, torch.bfloat16, seed=3)
    assert torch.equal(matmul(a, b), _reference(a, b).to(torch.bfloat16))


def test_out_dtype():
    a, b = _operands(7, 48, 24, torch.bfloat16)
    c = matmul(a, b, out_dtype=torch.float32)
    assert c.dtype == torch.float32
    assert_close(c, _reference(a, b), *TOLERANCES[torch.float32], what="bf16 in, fp32 out")


@pytest.mark.parametrize("m", [1, 33])
def test_strided_a_column_slice_and_transposed_a(m):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(m, 100 + 37, generator=gen).to(DEVICE)
    a = wide[:, 5:105]  # [m, 100], row stride 137: a column slice, read in place
    _, b = _operands(m, 100, 160, torch.float32)
    assert a.stride() == (137, 1)
    assert_close(matmul(a, b), _reference(a, b), *TOLERANCES[torch.float32], what="column-slice a")
    a_t = torch.randn(100, m, generator=gen).to(DEVICE).t()  # [m, 100] with strides (1, m)
    assert_close(matmul(a_t, b), _reference(a_t, b), *TOLERANCES[torch.float32], what="transposed a")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_transposed_b(dtype):
    a, _ = _operands(7, 96, 1, dtype)
    weight = (torch.randn(200, 96, generator=torch.Generator().manual_seed(2)) / 96**0.5).to(DEVICE, dtype)
    b = weight.t()  # [96, 200] view of a [200, 96] matrix: strides (1, 96), as the LM head passes it
    assert b.stride() == (1, 96)
    assert_close(matmul(a, b), _reference(a, b), *ROUNDING_TOL[dtype], what="transposed b")


def test_grouped_ordering_with_a_short_last_group():
    # 16x16 tiles on a 70x50 output: 5 tile-rows in groups of 2 (the last group has 1), 4 tile-columns,
    # K=40 in 3 steps (the last one partial). Every tile must be computed exactly once and in the right place.
    a, b = _operands(70, 40, 50, torch.float32)
    c = matmul(a, b, config=GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2))
    assert_close(c, _reference(a, b), *TOLERANCES[torch.float32], what="grouped ordering")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_row_gather_repeated_and_out_of_order(index_dtype):
    a, b = _operands(33, 100, 200, torch.float32)
    row_index = torch.tensor([5, 0, 5, 32, 1, 17, 32], dtype=index_dtype, device=DEVICE)
    c = matmul(a, b, row_index=row_index)
    assert c.shape == (7, 200)
    assert_close(c, _reference(a[row_index.long()], b), *TOLERANCES[torch.float32], what="row gather")


def test_row_gather_with_transposed_b_like_lm_head():
    hidden, _ = _operands(33, 96, 1, torch.bfloat16)
    weight = (torch.randn(200, 96) / 96**0.5).to(DEVICE, torch.bfloat16)  # [vocab, hidden]
    last = torch.tensor([4, 20, 32], device=DEVICE)
    expected = _reference(hidden[last], weight.t())
    assert_close(matmul(hidden, weight.t(), row_index=last), expected, *ROUNDING_TOL[torch.bfloat16], what="lm_head")


def test_empty_shapes():
    a, b = _operands(5, 48, 24, torch.float32)
    assert matmul(a, b, row_index=torch.tensor([], dtype=torch.long, device=DEVICE)).shape == (0, 24)
    assert matmul(a[:0], b).shape == (0, 24)
    assert torch.equal(matmul(a[:, :0], b[:0]), torch.zeros(5, 24, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("name", ["qkv_proj", "o_proj", "ffn", "lm_head"])
def test_stage_triton_matches_naive(name, num_tokens, dtype):
    stage = STAGES[name]
    assert stage.triton_kind.startswith("triton")
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    expected = stage.naive(**inputs)
    actual = stage.triton(**inputs)
    assert actual.dtype == expected.dtype
    assert_close(actual, expected, *TOLERANCES[dtype], what=f"{name} triton vs naive, T={num_tokens}, {dtype}")


def test_o_proj_reads_a_strided_attention_output():
    # o_proj may be handed a view: e.g. a [T, H*d] column slice of a wider buffer.
    inputs = o_proj.example_inputs(PRESETS["tiny"], 7, DEVICE, torch.float32)
    wide = torch.cat([inputs["x"], torch.ones(7, 5, device=DEVICE)], dim=1)
    view = wide[:, : inputs["x"].shape[1]]
    assert_close(o_proj.triton(view, inputs["w_o"]), o_proj.naive(**inputs), *TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: matmul(torch.randn(4, 8), torch.randn(9, 5)), r"inner dimensions differ: a \[4, 8\] @ b \[9, 5\]"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8, 5, dtype=torch.bfloat16)), r"a is torch.float32 but b"),
        (lambda: matmul(torch.randn(2, 4, 8), torch.randn(8, 5)), r"a must be 2-D, got shape \[2, 4, 8\]"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8)), r"b must be 2-D"),
        (lambda: matmul(torch.ones(4, 8, dtype=torch.int32), torch.ones(8, 5, dtype=torch.int32)), r"dtype int32"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8, 5), row_index=torch.tensor([0, 4])), r"spans \[0, 4\]"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8, 5), row_index=torch.tensor([-1])), r"a has 4 rows"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8, 5), row_index=torch.tensor([0.0])), r"row_index has dtype"),
        (lambda: matmul(torch.randn(4, 8), torch.randn(8, 5), row_index=torch.zeros(1, 1).long()), r"row_index must"),
        (lambda: GemmConfig(block_m=8, block_n=16, block_k=16, group_m=1), r"powers of two >= 16"),
    ],
    ids=[
        "k-mismatch",
        "dtype-mix",
        "3d-a",
        "1d-b",
        "int-dtype",
        "index-high",
        "index-negative",
        "index-float",
        "index-2d",
        "block-too-small",
    ],
)
def test_launcher_errors(make, message):
    with pytest.raises(KernelInputError, match=message) as err, torch.device(DEVICE):
        make()  # factory calls inside `make` create their tensors on DEVICE
    assert str(err.value).startswith("matmul:") and "\n" not in str(err.value)


def test_largest_prefill_tiles_are_sm90_candidates_only():
    """(128, 256, 64, 8 warps, 4 stages) and (256, 128, 64, 8, 3): autotune candidates on sm_90 in 16 bits, nowhere else
    (their compile, within 227 KB and without spilling, is benchmarks/compile_gate.md's)."""
    from stagewise.kernels.targets import gpu_target

    big = {(128, 256, 64, 8, 4), (256, 128, 64, 8, 3)}

    def tiles(dtype, capability):
        configs = matmul_module.gemm_configs(512, dtype, gpu_target(capability))
        return {(c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) for c in configs}

    assert big <= tiles(torch.bfloat16, 90) and big <= tiles(torch.float16, 90)
    assert not big & (tiles(torch.float32, 90) | tiles(torch.bfloat16, 80) | tiles(torch.bfloat16, 89))
    plan = matmul_module.gemm_plan(512, torch.bfloat16, gpu_target(90))
    assert plan.autotuned and {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in plan.configs} >= {
        (128, 256),
        (256, 128),
    }
