"""The compile gate in CI: a representative subset of launches compiled for GPU targets, no GPU needed.

`scripts/compile_gate.py` runs the whole sweep and writes benchmarks/compile_gate.md; here the cases
that found real problems (sm_89's 99 KB, fp32 register pressure, Llama-3-8B's head_dim 128, split-K
decode on sm_90, sm_75 in fp16) run on every test run, with a fresh Triton cache (~2 minutes on 2 cores).
"""

import importlib.util

import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.kernels.targets import SM75_FP16, check_target, gpu_target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

CI_CASES = [  # the last field: the K-quant dequantize-GEMMs compiled (the full sweep has them all)
    ("llama-3-8b", "prefill", "bf16", 89, ()),  # the smallest shared memory of the supported targets
    ("llama-3-8b", "prefill", "fp32", 80, ()),  # fp32 tiles: registers and shared memory twice bf16's
    ("llama-3-8b", "decode", "bf16", 90, ("q6_k",)),  # split-K decode, wgmma; q6_k: int8, G 16, fp32 d
    ("smollm2-135m", "decode", "fp16", 75, ()),  # best effort: the SM75_FP16 kernels must pass
]


def test_ci_subset_compiles_clean_with_real_numbers():
    """One test, so the subset is compiled once: a module fixture is built again in every xdist
    worker that runs one of its tests (each build ~100 s on 2 cores)."""
    from stagewise.devtools.compile_gate import Case, run_gate

    rows = run_gate([Case(*c) for c in CI_CASES], workers=2)
    passes_the_gate(rows)
    sees_tensor_cores_and_real_numbers(rows)
    compiles_a_k_quant_dequantize_gemm(rows)


def passes_the_gate(gate_rows):
    from stagewise.devtools.compile_gate import findings

    assert gate_rows, "the gate compiled nothing"
    assert all(not r.result.get("error") or r.case.capability < 80 for r in gate_rows)
    problems = findings(gate_rows)
    assert not problems, "compile gate findings:\n" + "\n".join(problems)


def sees_tensor_cores_and_real_numbers(gate_rows):
    """The numbers come from ptxas and the compiled kernel: tensor-core dots in bf16, none in element-wise kernels."""
    by_kernel = {(r.kernel, r.case.capability): r for r in gate_rows}
    assert by_kernel[("matmul", 90)].result["tensor_cores"]
    assert by_kernel[("flash_attention", 89)].result["tensor_cores"]
    assert not by_kernel[("rmsnorm", 89)].result["tensor_cores"]
    assert by_kernel[("matmul", 89)].result["shared"] > 0
    sampling = [r for r in gate_rows if r.kernel == "sampling"]  # 6 passes + their combines, per case
    assert len(sampling) == 12 * len(CI_CASES) and not any(r.result["tensor_cores"] for r in sampling)
    assert all(0 < r.result["registers"] <= 255 for r in gate_rows if not r.result.get("error"))


def compiles_a_k_quant_dequantize_gemm(gate_rows):
    """q6_k's launch (int8 codes, float32 scales, groups of 16) builds for sm_90 in CI; the others
    are in the full sweep (benchmarks/compile_gate.md)."""
    k_rows = [r for r in gate_rows if r.kernel == "dequant_matmul" and "q6_k" in r.label]
    assert {r.label.split(" (")[0] for r in k_rows} == {"v_proj q6_k", "down_proj q6_k"}
    assert all(r.case.capability == 90 and r.clean for r in k_rows)
    assert not any("q4_k" in r.label or "q5_k" in r.label for r in gate_rows)


def test_gate_catches_the_old_paged_attention_tile():
    """The tile paged attention used before the gate (fp32, head_dim 128: 64 x 64, 2 stages) is over sm_89's 99 KB."""
    from stagewise.devtools.compile_gate import run_jobs
    from stagewise.devtools.compile_specs import PREFILL, launches

    all_launches = launches("llama-3-8b", PREFILL, torch.float32, gpu_target(90))
    # the variant launch: the batch-invariant one (labelled so) has its own, newer tile
    (launch,) = [x for x in all_launches if x.kernel == "paged_attention" and "batch-invariant" not in x.label]
    args = {**launch.args, "BLOCK_M": 64, "BLOCK_N": 64}
    job = dict(id=0, module=launch.module, kernel=launch.function, args=args, num_warps=4, num_stages=2, capability=89)
    (result,) = run_jobs([job], workers=1).values()
    assert result["error"] is None
    assert result["shared"] > gpu_target(89).shared_memory


def test_pre_ampere_policy():
    sm75, sm80 = gpu_target(75), gpu_target(80)
    check_target("matmul", sm80, torch.bfloat16)  # supported: no error
    with pytest.raises(StagewiseError, match="float16 only"):
        check_target("matmul", sm75, torch.bfloat16)
    kernel = sorted(SM75_FP16)[0]
    check_target(kernel, sm75, torch.float16)  # proven by the gate: best effort, a warning
    with pytest.raises(StagewiseError, match="float16 only"):
        check_target("not_a_proven_kernel", sm75, torch.float16)
    with pytest.raises(StagewiseError, match="7.5"):
        check_target("matmul", gpu_target(80).__class__(interpreter=False, capability=70), torch.float16)


HOPPER_CASE = ("llama-3-8b", "prefill", "bf16", 90)  # 16-bit, head_dim 128: K/V tiles in shared memory


def test_hopper_rule_catches_a_register_rule_that_counts_kv_on_sm90(monkeypatch):
    """With sm_80's register rule on sm_90 (K/V counted as registers) only 32-key tiles are offered: the gate fails."""
    from stagewise.devtools.compile_gate import Case, build_jobs, hopper_attention_findings
    from stagewise.kernels import attention_common

    kernels = {"flash_attention", "paged_attention"}
    monkeypatch.setattr(attention_common, "kv_tiles_in_shared_memory", lambda target: False)
    rows, _, _ = build_jobs([Case(*HOPPER_CASE)], kernels)
    # the variant tiles (the batch-invariant tile, 8 warps for 64 rows, still fits 64 keys: the gate
    # judges it on its own)
    variant = [r for r in rows if "batch-invariant" not in r.label]
    assert {r.tiles["BLOCK_N"] for r in variant} == {32}
    problems = hopper_attention_findings(variant)
    assert len(problems) == 2 and all("no tile of >= 64 keys offered" in p for p in problems)


def test_hopper_offers_64_key_attention_tiles_and_one_compiles_clean():
    """sm_90 offers >= 64-key tiles to both attention kernels (plans only); FlashAttention's smallest compiles
    without spilling (one compile: the full sweep, benchmarks/compile_gate.md, compiles them all)."""
    from stagewise.devtools.compile_gate import Case, build_jobs, hopper_attention_findings, run_jobs

    rows, jobs, row_job = build_jobs([Case(*HOPPER_CASE)], {"flash_attention", "paged_attention"})
    wide = [(r, j) for r, j in zip(rows, row_job) if r.tiles["BLOCK_N"] >= 64]
    assert {r.kernel for r, _ in wide} == {"flash_attention", "paged_attention"}
    cost = lambda rj: rj[0].tiles["BLOCK_M"] * rj[0].tiles["BLOCK_N"] * jobs[rj[1]]["num_stages"]
    row, job = min((rj for rj in wide if rj[0].kernel == "flash_attention"), key=cost)
    (row.result,) = run_jobs([jobs[job]], workers=1).values()
    assert row.clean, f"{row.kernel} [{row.config}]: {row.result}"
    assert hopper_attention_findings([row]) == []
