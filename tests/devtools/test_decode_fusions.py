"""The device check's decode-fusion rows (devtools/gpu/decode_fusions.py) on the CPU dry run's shapes."""

import torch

from stagewise.devtools.gpu.decode_fusions import norm_matmul_cases, rope_kv_store_cases
from stagewise.devtools.gpu.kernel_bench import DRY_SIZES, summary_line

DECODE_SIZES = [m for m in DRY_SIZES.gemm_m if m <= 16]  # (1, 37): only M=1 is a decode shape


def test_norm_matmul_rows_name_both_paths_and_check_the_fused_output():
    rows = norm_matmul_cases(DRY_SIZES, torch.device("cpu"), torch.float32)
    assert [r["shape"] for r in rows] == [f"tiny attn_norm+qkv M={m} K=96 N=160" for m in DECODE_SIZES]
    for r in rows:
        assert "error" not in r and r["kernel"] == "norm_matmul" and r["stock"] == "rmsnorm + matmul"
        assert r["rel_err"] < 1e-6 and r["triton_ms"] > 0 and r["stock_ms"] > 0
        assert r["target"] == "ratio_vs_stock >= 1" and isinstance(r["passed"], bool)
        assert "norm_matmul" in summary_line(r)


def test_rope_kv_store_rows_name_both_paths_and_check_q_and_the_cache():
    rows = rope_kv_store_cases(DRY_SIZES, torch.device("cpu"), torch.float32)
    assert [r["shape"] for r in rows] == [f"tiny T={m} H=6 Hkv=2 d=16" for m in DECODE_SIZES]
    for r in rows:
        assert "error" not in r and r["kernel"] == "rope_kv_store" and r["stock"] == "rope + kv_store"
        assert r["rel_err"] < 1e-6 and r["triton_ms"] > 0 and r["stock_ms"] > 0
        assert "rope_kv_store" in summary_line(r)
