"""Compile the decode GEMM's GPU candidates ahead of time for sm_80, sm_89 and sm_90, without a GPU.

    .venv/bin/python scripts/compile_matmul_decode.py

For every dtype and Llama-3-8B decode shape, each config `gpu_candidates` offers
on that architecture (its shared-memory limit less the headroom) is compiled
with the specialisation the JIT sees at run time (unit strides constant, the
rest divisible by 16), and the script prints the compiled shared memory (and
the launcher's estimate), registers, spills (cuobjdump's LOCAL) and whether
the K loop was software-pipelined. Exit status 1 if any config exceeds its
architecture's shared memory or spills.
"""

import os
import re
import subprocess
import sys
import tempfile

import torch

os.environ.pop("TRITON_INTERPRET", None)  # compile for a GPU: keep stagewise.kernels off the interpreter
torch.cuda.is_available = lambda: True

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from stagewise.kernels import matmul_decode as md  # noqa: E402

SHARED_LIMIT_KB = {80: 163, 89: 99, 90: 227}
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # (N, K) of Llama-3-8B
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")


def resources(kernel) -> tuple[int, int]:
    """(registers, local memory bytes: > 0 means spills) of a compiled kernel, from its cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1)), int(re.search(r"LOCAL:(\d+)", out).group(1))


def compile_decode(cfg: md.DecodeConfig, dtype: str, arch: int, precision: str, gather: bool):
    unit = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1, "stride_cn": 1}  # ints equal to 1: constants
    signature = {
        "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*fp32", "c_ptr": f"*{dtype}", "counter_ptr": "*i32",
        "row_index_ptr": "*i64",
        "M": "i32", "N": "i32", "K": "i32", "K_PER_SPLIT": "i32", "stride_am": "i32", "stride_ak": "constexpr",
        "stride_bk": "i32", "stride_bn": "constexpr", "stride_os": "i32", "stride_om": "i32", "stride_on": "constexpr",
        "stride_cm": "i32", "stride_cn": "constexpr",
        "GATHER": "constexpr", "INTERPRETED": "constexpr", "FP32_DOTS": "constexpr", "INPUT_PRECISION": "constexpr",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "FUSED_SUM": "constexpr",
    }  # fmt: skip
    constants = {
        **unit, "GATHER": gather, "INTERPRETED": False, "FP32_DOTS": dtype == "fp32", "INPUT_PRECISION": precision,
        "BLOCK_M": md.BLOCK_M, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "FUSED_SUM": cfg.split_k > 1,
    }  # fmt: skip
    names = list(signature)
    divisible = [names.index(n) for n in names if signature[n] in ("i32",) and n not in ("M", "K")] + [0, 1, 2, 3, 4, 5]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = ASTSource(md._decode_kernel, signature, constants, attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main() -> int:
    failures, seen = 0, set()
    for dtype, size, precision in [("bf16", 2, "tf32"), ("fp16", 2, "tf32"), ("fp32", 4, "ieee"), ("fp32", 4, "tf32")]:
        for arch, limit_kb in SHARED_LIMIT_KB.items():
            budget = limit_kb * 1024 - md.SMEM_HEADROOM
            for n, k in SHAPES:
                for cfg in md.gpu_candidates(n, k, size, 132, budget):
                    key = (dtype, precision, arch, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
                    if key in seen:
                        continue
                    seen.add(key)
                    kernel = compile_decode(cfg, dtype, arch, precision, gather=False)
                    regs, local = resources(kernel)
                    shared = kernel.metadata.shared
                    pipelined = "async_copy_global_to_local" in kernel.asm["ttgir"]
                    ok = shared <= limit_kb * 1024 and local == 0
                    failures += not ok
                    print(
                        f"{dtype} {precision} sm_{arch} BLOCK_N={cfg.block_n:3d} BLOCK_K={cfg.block_k:3d} "
                        f"warps={cfg.num_warps} stages={cfg.num_stages}: shared {shared / 1024:5.1f} KB "
                        f"(estimate {md.shared_memory_bytes(cfg, size) / 1024:5.1f}), {regs} registers, "
                        f"{local} B spilled, pipelined {pipelined}  {'ok' if ok else 'FAIL'}",
                        flush=True,
                    )
    print(f"{len(seen)} configs compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
