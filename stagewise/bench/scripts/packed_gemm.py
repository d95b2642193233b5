"""The packed-weight GEMM, A/B: the integer-dot kernel (cpu/int8_dot.py) vs PyTorch's int4 CPU kernel.

    python -m stagewise.bench.scripts.packed_gemm [--threads 1 2] [--shapes 4096x512,4096x14336]
        [--ms 1,2,4,16,128,512] [--repeats 7] [--json packed_gemm.json]

For each weight shape K x N (random Q4_0 blocks) and each number of rows M, both kernels multiply
the same activations, alternated call by call in one process; the median and the best time of
each are kept, with what they mean: GB/s of packed weight bytes (the decode view, M = 1) and
GFLOP/s (the prefill view). A weight smaller than the last-level cache measures the kernel's
arithmetic; a larger one (4096 x 14336: 33 MB) the memory. Before timing, each kernel's output is
checked against the float formula, and the integer-dot kernel's row 0 against its M = 1 result
(bit for bit: the batch-invariance property). On a shared machine the numbers are indicative.
"""

import argparse
import json
import statistics
import time

import torch

from stagewise.bench.harness.machine import machine_info
from stagewise.cpu import build, int8_dot
from stagewise.errors import StagewiseError
from stagewise.files import write_text_atomic
from stagewise.quant import rows8
from stagewise.quant.dequantize import dequantize
from stagewise.quant.packed_weight import PackedWeight
from stagewise.stages import dequant_gemm_torch


def random_q4_0(k: int, n: int, seed: int) -> PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.full((n, k // 32), 1.0 / (4.6 * k**0.5), dtype=torch.float16)
    return PackedWeight("q4_0", codes, scales)


def stock_form(w: PackedWeight) -> PackedWeight:
    """w with PyTorch's int4pack form (what the torch tier builds without the compiled kernel)."""
    stock = PackedWeight(w.kind, w.codes.clone(), w.scales, w.mins)
    stock.prepared["torch"] = dequant_gemm_torch._int4pack(stock)
    return stock


def measure(k: int, n: int, ms: list[int], repeats: int) -> list[dict]:
    w = random_q4_0(k, n, seed=k + n)
    form = rows8.pack(w)
    stock = stock_form(w)
    x = torch.randn(max(ms), k, generator=torch.Generator().manual_seed(1))
    ref = x[:2] @ dequantize(w)
    for name, out in (
        ("int8_dot", int8_dot.gemm_form(x[:2], form, "q4_0", n)),
        ("int4pack", dequant_gemm_torch.gemm(x[:2], stock)),
    ):
        worst = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        if worst > 0.03:
            raise StagewiseError(f"{name} [{k}, {n}] is off the float formula by {worst:.3f} of its range")
    alone = int8_dot.gemm_form(x[:1], form, "q4_0", n)
    rows = []
    for m in ms:
        if not torch.equal(int8_dot.gemm_form(x[:m], form, "q4_0", n)[:1], alone):
            raise StagewiseError(f"int8_dot [{k}, {n}]: row 0 of M = {m} differs from M = 1")
        times: dict[str, list[float]] = {"int8_dot": [], "int4pack": []}
        calls = {
            "int8_dot": lambda m=m: int8_dot.gemm_form(x[:m], form, "q4_0", n),
            "int4pack": lambda m=m: dequant_gemm_torch.gemm(x[:m], stock),
        }
        for fn in calls.values():
            fn()  # warm-up
        for _ in range(repeats):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        row = {"k": k, "n": n, "m": m}
        for name, ts in times.items():
            med, best = statistics.median(ts), min(ts)
            row[name] = {
                "median_ms": 1e3 * med,
                "best_ms": 1e3 * best,
                "GBps_median": w.nbytes / med / 1e9,
                "GFLOPs_median": 2 * m * k * n / med / 1e9,
            }
        row["int4pack_over_int8_dot"] = row["int4pack"]["median_ms"] / row["int8_dot"]["median_ms"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", default="4096x512,4096x14336", help="K x N weights, comma separated")
    ap.add_argument("--ms", default="1,2,4,16,128,512", help="rows per call, comma separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if not int8_dot.available():
        raise SystemExit(f"stagewise: {build.describe()}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    before = torch.get_num_threads()
    result = {"machine": machine_info(), "kernel": build.describe(), "runs": []}
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for k, n in shapes:
                for row in measure(k, n, ms, args.repeats):
                    row["threads"] = threads
                    result["runs"].append(row)
                    a, b = row["int8_dot"], row["int4pack"]
                    print(
                        f"{threads}t [{k:5d} x {n:5d}] M={row['m']:4d}: int8_dot {a['median_ms']:8.2f} ms "
                        f"({a['GBps_median']:5.1f} GB/s, {a['GFLOPs_median']:6.1f} GFLOP/s)  int4pack "
                        f"{b['median_ms']:8.2f} ms ({b['GFLOPs_median']:6.1f} GFLOP/s)  "
                        f"{row['int4pack_over_int8_dot']:.2f}x"
                    )
    finally:
        torch.set_num_threads(before)
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
