"""The device check's fused-vs-unfused FFN row (devtools/gpu/ffn_fusion.py) on the CPU dry run's shapes."""

import torch

from stagewise.devtools.gpu.ffn_fusion import silu_down_cases
from stagewise.devtools.gpu.kernel_bench import DRY_SIZES, summary_line


def test_dry_run_rows_name_both_paths_and_check_the_fused_output():
    rows = silu_down_cases(DRY_SIZES, torch.device("cpu"), torch.float32)
    decode_sizes = [m for m in DRY_SIZES.gemm_m if m <= 16]  # (1, 37): only M=1 is a decode shape
    assert [r["shape"] for r in rows] == [f"tiny down M={m} K=256 N=96" for m in decode_sizes]
    for r in rows:
        assert r["kernel"] == "silu_down" and r["stock"] == "silu_and_mul + matmul"
        assert r["rel_err"] < 1e-6 and r["triton_ms"] > 0 and r["stock_ms"] > 0
        assert "silu_down" in summary_line(r)
