"""The split-K decode GEMM (`kernels/matmul_decode.py`) against the naive reference, on tiny irregular shapes.

Under the CPU interpreter (~1 ms per program instance) the shapes stay small; explicit configs with
16-wide blocks and a split of 3 leave partial tiles in N, a partial last step in K and a short last
split, so every mask and every split boundary is exercised. On a GPU the same tests run on CUDA.
"""

import pytest
import torch

import stagewise.kernels.matmul as matmul_module
import stagewise.kernels.matmul_decode as decode
from stagewise.kernels import INTERPRETER
from stagewise.stages import qkv_proj
from tests.helpers import TOLERANCES, assert_close

DecodeConfig, KernelInputError, split_plan = decode.DecodeConfig, decode.KernelInputError, decode.split_plan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPLIT3 = DecodeConfig(block_n=16, block_k=16, split_k=3)  # many small programs: 3 K ranges per 16 columns
ROUNDING_TOL = {  # (atol, rtol): the output rounding, plus a flip where the GPU sums in another order
    torch.float32: TOLERANCES[torch.float32],
    torch.bfloat16: (1e-4, 2**-7),
    torch.float16: (1e-5, 2**-10),
}


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """a [m, k], b [k, n] on DEVICE, scaled so outputs are O(1) whatever k."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen)
    b = torch.randn(k, n, generator=gen) / k**0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The naive stage reference (`x @ w`) in fp32 on the CPU, from the same (possibly rounded) inputs."""
    return qkv_proj.naive(a.float().cpu(), b.float().cpu())


def _run(a, b, config=None, row_index=None, out_dtype=None) -> torch.Tensor:
    m = a.shape[0] if row_index is None else row_index.shape[0]
    c = torch.empty(m, b.shape[1], device=a.device, dtype=out_dtype or a.dtype)
    return decode.matmul_decode(a, b, c, row_index=row_index, config=config)


def test_split_plan_worked_examples():
    assert split_plan(k=4096, block_k=128, split_k=8) == (512, 8)  # 32 steps: 8 ranges of 4 steps
    assert split_plan(k=4096, block_k=128, split_k=9) == (512, 8)  # 9 ranges of 4 would leave one empty
    assert split_plan(k=100, block_k=16, split_k=3) == (48, 3)  # 7 steps: 3 + 3 + 1 (K 96..100)
    assert split_plan(k=37, block_k=16, split_k=3) == (16, 3)  # 3 steps, the last one 5 deep
    assert split_plan(k=20, block_k=16, split_k=4) == (16, 2)  # only 2 steps to share out
    assert split_plan(k=100, block_k=64, split_k=1) == (128, 1)


def test_worked_example_three_splits():
    # a = [1, 1, ..., 1] (K = 48), column j of b holds (k + j) at row k: c[j] = sum_k (k + j) = 1128 + 48 j.
    # With 16-deep splits the program partials are 120 + 16 j, 376 + 16 j, 632 + 16 j: they add to c.
    a = torch.ones(1, 48, device=DEVICE)
    b = torch.arange(48.0, device=DEVICE)[:, None] + torch.arange(3.0, device=DEVICE)[None, :]  # [48, 3]
    expected = torch.tensor([[1128.0, 1176.0, 1224.0]])
    assert split_plan(48, 16, 3) == (16, 3)
    for config in (SPLIT3, DecodeConfig(block_n=16, block_k=16, split_k=1), None):
        assert torch.equal(_run(a, b, config).cpu(), expected), config


def test_split_k_sum_adds_in_fixed_order_and_rounds_to_nearest():
    # fp32: 1 + 2**-24 rounds back to 1 (a tie, to even), so partials [1, 2**-24, 2**-24] summed in the
    # order 0, 1, 2 give exactly 1.0; summed from the end (or with atomics in finishing order) they can
    # give 1 + 2**-23. The kernel always adds 0, 1, 2, ...: the same bits every run.
    partials = torch.tensor([1.0, 2**-24, 2**-24], device=DEVICE).view(3, 1, 1)
    c = torch.empty(1, 1, device=DEVICE)
    decode.split_k_sum(partials, c)
    assert c.item() == 1.0
    assert (2**-24 + 2**-24) + 1.0 != 1.0  # the other order really differs
    # bf16 output: 1 + 3 * 2**-9 is 0.75 of a bf16 step (2**-7) above 1: nearest is 1 + 2**-7, truncation 1.
    partials = torch.tensor([1.0, 2**-9, 2**-8], device=DEVICE).view(3, 1, 1)
    c16 = torch.empty(1, 1, device=DEVICE, dtype=torch.bfloat16)
    decode.split_k_sum(partials, c16)
    assert c16.float().item() == 1.0 + 2**-7


def test_fused_sum_is_one_kernel_adding_in_fixed_order(monkeypatch):
    # The partials of c[0, 0] are 1, 2**-24, 2**-24 (b's rows 0, 16, 32; 16-deep splits): added in the
    # order 0, 1, 2 they give exactly 1.0 (see the test above). The last split of the tile sums them;
    # the separate sum kernel never runs, and the arrival counters are back at 0 for the next launch.
    monkeypatch.setattr(decode, "_sum_partials", lambda *args: pytest.fail("the second kernel ran"))
    a = torch.ones(1, 48, device=DEVICE)
    b = torch.zeros(48, 20, device=DEVICE)  # 20 columns: 2 tiles of 16
    b[0, 0], b[16, 0], b[32, 0], b[5, 19] = 1.0, 2**-24, 2**-24, 3.0
    c = _run(a, b, SPLIT3)
    assert c[0, 0].item() == 1.0 and c[0, 19].item() == 3.0 and c[0, 1:19].eq(0).all()
    assert decode.arrival_counters(DEVICE, 2)[:2].tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_sum_gives_the_two_kernel_path_bits(dtype):
    a, b = _operands(5, 130, 70, dtype, seed=2)
    fused = _run(a, b, SPLIT3)
    c = torch.empty(5, 70, device=DEVICE, dtype=dtype)
    two_kernels = decode.matmul_decode(a, b, c, config=SPLIT3, fused_sum=False)
    assert torch.equal(fused, two_kernels)
    assert_close(fused, _reference(a, b), *ROUNDING_TOL[dtype], what=f"fused split-K {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("k,n", [(37, 50), (100, 70), (130, 33)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_split_matches_naive_reference(m, k, n, dtype):
    assert split_plan(k, SPLIT3.block_k, SPLIT3.split_k)[1] == 3  # really split, with a short last range
    a, b = _operands(m, k, n, dtype)
    c = _run(a, b, SPLIT3)
    assert c.shape == (m, n) and c.dtype == dtype and c.is_contiguous()
    assert_close(c, _reference(a, b), *ROUNDING_TOL[dtype], what=f"split-K {m}x{k}x{n} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 16])
def test_matmul_dispatches_decode_shapes(m, dtype):
    # Through the public matmul with its default config (on a GPU: the tuner's choice).
    a, b = _operands(m, 150, 90, dtype, seed=1)
    assert_close(matmul_module.matmul(a, b), _reference(a, b), *ROUNDING_TOL[dtype], what=f"matmul M={m} {dtype}")


def test_only_decode_shapes_without_a_fixed_config_take_the_split_kernel(monkeypatch):
    calls = []
    real = decode.matmul_decode
    monkeypatch.setattr(
        matmul_module, "matmul_decode", lambda *args, **kw: calls.append(args[2].shape) or real(*args, **kw)
    )
    a, b = _operands(17, 40, 24, torch.float32)
    matmul_module.matmul(a[:16], b)
    matmul_module.matmul(a, b)  # 17 rows: the tiled GEMM
    matmul_module.matmul(a[:4], b, config=matmul_module.gemm_config(4, 24, 40))  # a fixed GEMM config
    matmul_module.matmul(a, b, row_index=torch.tensor([16, 0], device=DEVICE))  # 2 gathered rows: decode
    assert calls == [(16, 24), (2, 24)]


@pytest.mark.parametrize("config", [SPLIT3, DecodeConfig(block_n=32, block_k=16, split_k=1)], ids=["split3", "split1"])
def test_out_dtype_with_and_without_split(config):
    a, b = _operands(3, 100, 40, torch.bfloat16)
    c = _run(a, b, config, out_dtype=torch.float32)
    assert c.dtype == torch.float32
    assert_close(c, _reference(a, b), *TOLERANCES[torch.float32], what=f"bf16 in, fp32 out, {config}")


def test_strided_and_transposed_a():
    gen = torch.Generator().manual_seed(1)
    _, b = _operands(3, 100, 40, torch.float32)
    a = torch.randn(3, 137, generator=gen).to(DEVICE)[:, 5:105]  # [3, 100] column slice, row stride 137
    assert a.stride() == (137, 1)
    assert_close(_run(a, b, SPLIT3), _reference(a, b), *TOLERANCES[torch.float32], what="column-slice a")
    a_t = torch.randn(100, 3, generator=gen).to(DEVICE).t()  # [3, 100] with strides (1, 3)
    assert_close(_run(a_t, b, SPLIT3), _reference(a_t, b), *TOLERANCES[torch.float32], what="transposed a")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transposed_b(dtype):
    a, _ = _operands(5, 100, 1, dtype)
    weight = (torch.randn(70, 100, generator=torch.Generator().manual_seed(2)) / 10).to(DEVICE, dtype)
    b = weight.t()  # [100, 70] view of a [70, 100] matrix: strides (1, 100), as a tied LM head passes it
    assert b.stride() == (1, 100)
    assert_close(_run(a, b, SPLIT3), _reference(a, b), *ROUNDING_TOL[dtype], what="transposed b")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_row_gather_repeated_and_out_of_order(index_dtype):
    a, b = _operands(33, 100, 40, torch.float32)
    row_index = torch.tensor([5, 0, 5, 32, 1, 17, 32], dtype=index_dtype, device=DEVICE)
    c = _run(a, b, SPLIT3, row_index=row_index)
    assert c.shape == (7, 40)
    assert_close(c, _reference(a[row_index.long()], b), *TOLERANCES[torch.float32], what="row gather")


def test_lm_head_like_gather_with_transposed_b_bf16():
    hidden, _ = _operands(20, 100, 1, torch.bfloat16)
    weight = (torch.randn(70, 100) / 10).to(DEVICE, torch.bfloat16)  # [vocab, hidden]
    last = torch.tensor([4, 12, 19], device=DEVICE)
    expected = _reference(hidden[last], weight.t())
    c = matmul_module.matmul(hidden, weight.t(), row_index=last)
    assert_close(c, expected, *ROUNDING_TOL[torch.bfloat16], what="lm_head")


def test_a_rows_result_does_not_depend_on_its_batch():
    # Batch invariance: row i alone (M = 1) and row i among 16 rows give the same bits, because the
    # config never depends on M and each row's dot products see only that row. It is what lets a
    # sequence decode to the same greedy tokens whether it runs alone or in a full batch.
    # fp32 output, so a change in summation order shows in the low bits instead of rounding away.
    # Under the CPU interpreter `tl.dot` is numpy's matmul of the whole [16, K] tile, and some BLAS
    # builds (OpenBLAS on AMD EPYC, seen here) sum a row in an order that depends on the tile's
    # other rows: there the rows agree to float32 rounding (a few ulp), bits only on a GPU.
    a, b = _operands(16, 130, 50, torch.bfloat16, seed=4)
    together = matmul_module.matmul(a, b, out_dtype=torch.float32)
    for i in (0, 7, 15):
        alone = matmul_module.matmul(a[i : i + 1], b, out_dtype=torch.float32)
        if INTERPRETER:
            assert_close(alone, together[i : i + 1], 1e-6, 1e-6, what=f"row {i}")
        else:
            assert torch.equal(alone, together[i : i + 1]), f"row {i}"
    assert torch.equal(matmul_module.matmul(a, b, out_dtype=torch.float32), together)  # same bits on a second run


def test_gpu_candidates_fit_shared_memory_and_fill_the_gpu():
    sms = 132  # H200
    for budget in (99 * 1024 - decode.SMEM_HEADROOM, decode.SMEM_BUDGET, 227 * 1024 - decode.SMEM_HEADROOM):
        for element_size in (2, 4):
            for n, k in [(4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096), (128256, 4096), (200, 96)]:
                for cfg in decode.gpu_candidates(n, k, element_size, sms, budget):
                    assert decode.shared_memory_bytes(cfg, element_size) <= budget, (budget, n, k, cfg)
                    assert split_plan(k, cfg.block_k, cfg.split_k)[1] == cfg.split_k  # no empty split
    # sm_89's 99 KB cuts the 128 x 128 tile (36 KB a stage in bf16) to 2 buffers; sm_90 keeps 3.
    stages = {
        b: {c.num_stages for c in decode.gpu_candidates(4096, 4096, 2, sms, b) if c.block_n == 128}
        for b in (91 * 1024, 219 * 1024)
    }
    assert stages == {91 * 1024: {3}, 219 * 1024: {4}}
    # Llama-3-8B o_proj (N = K = 4096): 64 tiles of 64 columns; ~4 programs per SM asks for 9 splits of
    # 32 steps, which become 8 ranges of 4 steps: 512 programs instead of the unsplit 64.
    o_proj = decode.gpu_candidates(4096, 4096, 2, sms)
    assert DecodeConfig(64, 128, 8, 4, 5) in o_proj
    assert max(-(-4096 // c.block_n) * c.split_k for c in o_proj) >= 2 * sms
    # The LM head's 128256 columns make >= 1002 tiles already: no split.
    assert {c.split_k for c in decode.gpu_candidates(128256, 4096, 2, sms)} == {1}


def test_more_than_16_rows_walk_their_splits_in_one_program():
    """M > 16: tiles of 16 rows, each program adding its tile's 3 splits in order (SERIAL), no partials."""
    a, b = _operands(37, 100, 40, torch.float32, seed=5)
    c = _run(a, b, config=SPLIT3)
    assert_close(c.cpu(), _reference(a, b), *ROUNDING_TOL[torch.float32], what="37 rows, 3 splits")
    rows = torch.tensor([36, 0, 17, 17, 5], device=DEVICE)
    gathered = _run(a, b, config=SPLIT3, row_index=torch.cat([rows] * 4))  # 20 rows read through an index
    assert_close(gathered.cpu(), _reference(a, b)[torch.cat([rows] * 4).cpu()], *ROUNDING_TOL[torch.float32])


def test_launcher_errors():
    a, b = _operands(17, 40, 24, torch.float32)
    with pytest.raises(KernelInputError, match=r"c must be contiguous"):
        decode.matmul_decode(a[:2], b, torch.empty(24, 2, device=DEVICE).t())
    with pytest.raises(KernelInputError, match=r"c has shape \[2, 23\], expected \[\*, 24\]"):
        decode.matmul_decode(a[:2], b, torch.empty(2, 23, device=DEVICE))
    with pytest.raises(KernelInputError, match=r"powers of two >= 16"):
        DecodeConfig(block_n=8, block_k=16, split_k=1)
    with pytest.raises(KernelInputError, match=r"split_k 17 in \[1, 16\]"):
        DecodeConfig(block_n=16, block_k=16, split_k=17)
