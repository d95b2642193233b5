"""The integer-dot GEMM (stagewise/cpu/int8_dot.py): the kernel's bits are the reference's, in every
build (AVX-512 VNNI or AVX-VNNI, AVX2, plain C), and a row's bits are the same for every M, slot and
thread count (the sweep of DESIGN.md's "Batch invariance"); the torch tier routes packed weights to
it and falls back to PyTorch's kernels without a compiler."""

import platform

import pytest
import torch

from stagewise.cpu import build, int8_dot
from stagewise.errors import StagewiseError
from stagewise.quant import rows8
from stagewise.quant.dequantize import dequantize
from stagewise.quant.packed_weight import PackedWeight
from stagewise.quant.quantize import quantize
from stagewise.stages import dequant_gemm_torch
from tests.stages.test_batch_invariance_ops import (
    SWEEP_M,
    assert_invariant,
    distinct_results,
    probe_of,
    rows_with_probe,
)

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the kernel is not built"),
    pytest.mark.usefixtures("int8_kernels"),  # opt-in: STAGEWISE_CPU_KERNELS=1
]
KINDS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k")


def weight(kind: str, k: int, n: int, seed: int = 0) -> PackedWeight:
    """A packed [K, N] weight: quantized from random numbers, or random K-quant codes and scales."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("q4_0", "q4_1", "q8_0"):
        return quantize(torch.randn(k, n, generator=gen) / k**0.5, kind)
    if kind == "q4_k":  # 4-bit codes, float32 scales and minimums (expanded super-blocks)
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    else:  # q5_k: one 5-bit code per byte
        codes = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // 32, generator=gen) / k
    return PackedWeight(kind, codes, scales, -torch.rand(n, k // 32, generator=gen) / k)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 64), (5, 96, 40), (3, 320, 17), (13, 64, 3), (4, 2048, 24)])
def test_the_kernel_computes_the_references_bits(kind, m, k, n):
    """K not a multiple of 256, N not a multiple of 8 or 16, M around the 4-row tiles: torch.equal."""
    w = weight(kind, k, n)
    x = 2 * torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0  # a block of zeros: dx = 0
    out = int8_dot.gemm(x, w)
    assert torch.equal(out, int8_dot.reference(x, w))
    exact = x @ dequantize(w)  # the float formula: int8 activations are within ~1 % of its range
    assert (out - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86 builds")
@pytest.mark.parametrize("variant", ["avx2", "plain"])
def test_every_build_gives_the_same_bits(variant):
    """The integer sums are exact and the float part is the same operations in every path: a build
    for an older CPU (AVX2, no VNNI) and plain C give the native build's bits."""
    if not int8_dot.available(variant):  # plain C builds wherever the native one does: only AVX2 may be missing
        assert variant == "avx2", f"the {variant} build failed"
        pytest.skip("this compiler cannot build for -march=haswell (AVX2)")
    x = torch.randn(6, 320, generator=torch.Generator().manual_seed(2))
    for kind in KINDS:
        w = weight(kind, 320, 24, seed=3)
        assert torch.equal(int8_dot.gemm(x, w, variant), int8_dot.gemm(x, w)), (kind, variant)


@pytest.mark.parametrize(
    ("kind", "k", "n", "ms"),
    [
        ("q4_0", 576, 64, SWEEP_M),  # 18 blocks
        ("q4_1", 2048, 40, SWEEP_M),  # 5 octets: an odd one at each thread's end
        ("q8_0", 576, 64, SWEEP_M),
        ("q4_k", 256, 64, SWEEP_M),
        ("q8_0", 576, 49152, (1, 2, 3, 4, 5)),  # the LM head's width
    ],
)
def test_a_row_is_the_same_bits_for_every_m_slot_and_thread_count(kind, k, n, ms):
    w = weight(kind, k, n, seed=5)
    form = dequant_gemm_torch.prepare(w).prepared["torch"]
    assert len(form) == 1, "the torch tier holds the rows8 form"
    probe = probe_of(k)
    run = lambda m, s: dequant_gemm_torch.gemm(rows_with_probe(m, s, probe, 60), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run, ms), f"int8-dot {kind} [{k}, {n}]")


def test_the_torch_tier_holds_the_rows8_form_and_rebuilds_the_codes_exactly():
    w = weight("q4_0", 96, 40)
    codes = w.codes.clone()
    dequant_gemm_torch.prepare(w)
    assert dequant_gemm_torch.form_name(w) == "rows8" and not w.codes_held  # released
    assert torch.equal(w.code_rows(torch.tensor([39, 0, 17])), codes[[39, 0, 17]])
    assert torch.equal(w.codes, codes)  # all rows, cut back from 5 octets to 40 rows
    assert not dequant_gemm_torch.takes_bfloat16(w)


def test_without_a_compiler_the_tier_keeps_pytorchs_kernels(monkeypatch, capsys):
    monkeypatch.delenv("STAGEWISE_QUIET", raising=False)
    monkeypatch.setattr(build, "compiler", lambda: None)
    build._library.cache_clear()
    try:
        w = weight("q4_1", 96, 48)
        assert not int8_dot.available()
        assert dequant_gemm_torch.form_name(w) == "int4pack"
        x = torch.randn(2, 96)
        exact = x @ dequantize(w)  # bfloat16 activations, scale and zero (8-bit mantissa): ~1 % of the range
        assert (dequant_gemm_torch.gemm(x, w) - exact).abs().max() <= 0.02 * exact.abs().max()
        err = capsys.readouterr().err
        assert "no C++ compiler found" in err and "int4 CPU kernel" in err and len(err.splitlines()) == 1
    finally:
        build._library.cache_clear()


def test_bad_inputs_get_one_line():
    w = weight("q4_0", 96, 16)
    with pytest.raises(StagewiseError, match=r"x must be \[M, 96\]"):
        int8_dot.gemm(torch.randn(2, 64), w)
    with pytest.raises(StagewiseError, match="rows8 form for N = 17"):
        int8_dot.gemm_form(torch.randn(2, 96), rows8.pack(w), "q4_0", 17)


def test_the_read_probe_reports_a_bandwidth():
    assert int8_dot.stream_read_bandwidth(1 << 20, threads=2, repeats=2) > 0
