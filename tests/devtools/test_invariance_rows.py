"""The device check's batch-invariance rows (devtools/gpu/invariance.py) on the CPU dry run's shapes.

The interpreter's `tl.dot` is numpy's BLAS, which is not row-invariant by itself: the rows run under
the fixed-order dot the kernel invariance tests use, so a difference found is the kernels'.
"""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.devtools.device_report import _kernels
from stagewise.devtools.gpu.invariance import DECODE_M, invariance_cases
from stagewise.devtools.gpu.kernel_bench import DRY_SIZES, projection_shapes, summary_line
from tests.kernels.fixed_order_dot import fixed_order_dot  # noqa: F401  (a fixture)


@pytest.mark.usefixtures("fixed_order_dot")
def test_rows_cover_gemms_and_attention_and_the_invariant_paths_keep_a_rows_bits():
    rows = invariance_cases(DRY_SIZES, torch.device("cpu"), torch.float32)
    shapes = projection_shapes(PRESETS["tiny"])
    prefill_m = max(DRY_SIZES.gemm_m)
    expected = [
        f"tiny {p} {kind} M={m} K={shapes[p][0]} N={shapes[p][1]}"
        for p in ("qkv", "down")
        for kind in ("float32", "q4_1")
        for m in (DECODE_M, prefill_m)
    ]
    gemms = [r for r in rows if r["kernel"] != "paged_attention"]
    assert [r["shape"] for r in gemms] == expected
    attention = [r["shape"] for r in rows if r["kernel"] == "paged_attention"]
    assert [s.split(" H=")[0] for s in attention] == [
        f"tiny decode {DRY_SIZES.decode_seqs} seqs x {DRY_SIZES.decode_ctx}",
        f"tiny decode 1 seq x {DRY_SIZES.decode_ctx} (alone)",
        f"tiny prefill {DRY_SIZES.attn_batch} x {DRY_SIZES.attn_len}",
    ]
    for r in rows:
        assert "error" not in r and r["stock"] == "batch_invariant=False", r
        assert r["same_bits"] is True and r["passed"] is True, r  # a row alone = the same row in the batch
        assert r["triton_ms"] > 0 and r["stock_ms"] > 0
        assert r["ratio_vs_stock"] == pytest.approx(r["stock_ms"] / r["triton_ms"])
        assert r["rel_err"] < 1e-5  # invariant and variant paths differ by rounding only
        assert r["kernel"] in summary_line(r)
    # the negative control, in the same run: past one 16-row tile the variant GEMMs take the prefill
    # tiles, whose sums split K otherwise than the decode path a row alone takes
    assert not all(r["variant_same_bits"] for r in gemms if f"M={prefill_m}" in r["shape"])
    md = "\n".join(_kernels({"rows": rows}))
    assert "| same bits yes, variant no |" in md and "x batch_invariant=False |" in md
