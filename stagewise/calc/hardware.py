"""What a machine can do: peak FLOP/s per dtype, memory bandwidth, memory capacity.

These three numbers are all a roofline needs. A step that does F FLOPs and
moves B bytes cannot finish faster than

    max(F / peak_flops, B / bandwidth)

and the *ridge point* `peak_flops / bandwidth` (FLOP per byte) says which of
the two wins: a step whose arithmetic intensity F/B is below the ridge is
memory-bound, above it compute-bound.

Presets are the vendors' datasheet numbers (dense, no sparsity; decimal units
as marketed: 1 TB/s = 1e12 B/s, 80 GB = 80e9 B). "h100-seeds" is the seeds'
rounded H100 (1 PFLOP/s, 3.3 TB/s) and reproduces their arithmetic exactly.
`probe_this_machine()` measures the machine it runs on with torch.
"""

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from stagewise.errors import StagewiseError

# Accepted spellings of a compute dtype -> canonical name used by Hardware.peak_flops().
DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8",
}
# Bytes per element of each canonical dtype (weights and KV cache are stored in it).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def canonical_dtype(name: str) -> str:
    """'bfloat16' -> 'bf16'; a one-line StagewiseError for anything unknown."""
    key = name.strip().lower()
    if key not in DTYPE_NAMES:
        raise StagewiseError(f"unknown dtype '{name}'; use one of fp32, bf16, fp16, fp8")
    return DTYPE_NAMES[key]


@dataclass(frozen=True)
class Hardware:
    name: str  # what to call it in tables and plots
    peak_flops_bf16: float  # dense bf16 tensor-core FLOP/s (multiply and add count as 2)
    peak_flops_fp16: float  # dense fp16 tensor-core FLOP/s
    peak_flops_fp32: float  # plain fp32 FLOP/s (no TF32 tensor cores)
    peak_flops_fp8: float | None  # dense fp8 FLOP/s; None where the chip has no fp8 math
    memory_bandwidth: float  # bytes/s between memory (HBM / DRAM) and the compute units
    memory_bytes: int  # memory capacity in bytes (weights + KV cache must fit here)
    notes: str = ""  # where the numbers come from

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype name ('bf16', 'fp32', ...)."""
        key = canonical_dtype(dtype)
        value = {
            "bf16": self.peak_flops_bf16,
            "fp16": self.peak_flops_fp16,
            "fp32": self.peak_flops_fp32,
            "fp8": self.peak_flops_fp8,
        }[key]
        if value is None:
            raise StagewiseError(f"{self.name} has no {key} math; choose another dtype")
        return value

    def ridge_point(self, dtype: str) -> float:
        """FLOP per byte at which compute time equals memory time: peak_flops / bandwidth."""
        return self.peak_flops(dtype) / self.memory_bandwidth

    def scaled(self, count: int) -> "Hardware":
        """`count` of these working as one ideal device (perfect tensor parallelism, no communication)."""
        if count < 1:
            raise StagewiseError(f"devices must be >= 1, got {count}")
        if count == 1:
            return self
        fp8 = None if self.peak_flops_fp8 is None else self.peak_flops_fp8 * count
        return replace(
            self,
            name=f"{count}x {self.name}",
            peak_flops_bf16=self.peak_flops_bf16 * count,
            peak_flops_fp16=self.peak_flops_fp16 * count,
            peak_flops_fp32=self.peak_flops_fp32 * count,
            peak_flops_fp8=fp8,
            memory_bandwidth=self.memory_bandwidth * count,
            memory_bytes=self.memory_bytes * count,
            notes=f"{self.notes}; x{count}, ideal scaling (no communication cost)",
        )


T = 1e12  # tera
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(
        name="H100 SXM",
        peak_flops_bf16=989 * T,
        peak_flops_fp16=989 * T,
        peak_flops_fp32=67 * T,
        peak_flops_fp8=1979 * T,
        memory_bandwidth=3.35 * T,
        memory_bytes=80 * 10**9,
        notes="NVIDIA H100 SXM5 80GB datasheet, dense",
    ),
    "h200": Hardware(
        name="H200 SXM",
        peak_flops_bf16=989 * T,
        peak_flops_fp16=989 * T,
        peak_flops_fp32=67 * T,
        peak_flops_fp8=1979 * T,
        memory_bandwidth=4.8 * T,
        memory_bytes=141 * 10**9,
        notes="NVIDIA H200 SXM 141GB datasheet, dense; same compute as H100, more and faster HBM",
    ),
    "a100": Hardware(
        name="A100 SXM 80GB",
        peak_flops_bf16=312 * T,
        peak_flops_fp16=312 * T,
        peak_flops_fp32=19.5 * T,
        peak_flops_fp8=None,
        memory_bandwidth=2.039 * T,
        memory_bytes=80 * 10**9,
        notes="NVIDIA A100 SXM4 80GB datasheet, dense",
    ),
    "h100-seeds": Hardware(
        name="H100 (seeds' round numbers)",
        peak_flops_bf16=1000 * T,
        peak_flops_fp16=1000 * T,
        peak_flops_fp32=67 * T,
        peak_flops_fp8=2000 * T,
        memory_bandwidth=3.3 * T,
        memory_bytes=80 * 10**9,
        notes="the seeds: 1 PFLOP/s fp16, 3.3 TB/s, 80 GB (fp32/fp8 not in the seeds: H100's)",
    ),
}


# ---------------------------------------------------------------- the probe


def median_seconds(fn: Callable[[], object], budget_s: float, sync: Callable[[], None], max_repeats=50) -> float:
    """Warm up once, then repeat `fn` until the budget is spent (at least 3 times); the median."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_flops(dtype: torch.dtype, device: str, budget_s: float, sync, max_n: int) -> float:
    """FLOP/s of an n x n x n matmul; n doubles from 256 while one product is quick (CPU fp16 is very slow)."""
    n = 256
    while True:
        a = torch.ones(n, n, dtype=dtype, device=device)
        a @ a  # the first call at a size pays for setup (thread pool, kernel choice)
        sync()
        t0 = time.perf_counter()
        a @ a
        sync()
        if n >= max_n or time.perf_counter() - t0 > budget_s / 20:
            break  # big enough to time, or too slow to grow (the next size costs 8x)
        n *= 2
    seconds = median_seconds(lambda: a @ a, budget_s, sync)
    return 2 * n**3 / seconds  # [n, n] @ [n, n]: n^3 multiply-adds = 2 n^3 FLOPs


def _gemv_bandwidth(device: str, budget_s: float, sync, weight_bytes: int) -> dict[str, float]:
    """Bytes/s of the ways decode can stream a weight matrix far larger than cache, and of a copy.

    "gemv": W @ x with one vector. "two_columns": W @ [x, x], the tall-skinny GEMM that
    `tuning/gemm_forms.py` asks for on a CPU, where the BLAS streams weights faster that way than
    through its GEMV. "read": W.sum(), a plain read, the ceiling for both. "copy": read + write.
    """
    cols = 4096
    rows = max(1, weight_bytes // (4 * cols))
    w = torch.ones(rows, cols, dtype=torch.float32, device=device)  # fp32 weights, e.g. 256 MiB
    x = torch.ones(cols, 1, dtype=torch.float32, device=device)
    x2 = torch.ones(2, cols, dtype=torch.float32, device=device).t()  # [cols, 2], column-major like x^T
    nbytes = w.numel() * 4
    out = torch.empty_like(w)
    out.copy_(w)  # touch the destination pages before timing
    forms = {
        "gemv": lambda: w @ x,  # [rows, cols] @ [cols, 1] reads all of W once
        "two_columns": lambda: w @ x2,  # [rows, cols] @ [cols, 2]: the same bytes, two outputs per row
        "read": lambda: w.sum(),
        "copy": lambda: out.copy_(w),  # reads W, writes out
    }
    seconds = {name: median_seconds(fn, budget_s / len(forms), sync) for name, fn in forms.items()}
    return {name: (2 if name == "copy" else 1) * nbytes / s for name, s in seconds.items()}


def last_level_cache_bytes() -> int:
    """The largest CPU cache the kernel reports (sysfs), or 0 when unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def _memory_capacity(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def probe_this_machine(seconds: float = 3.0, device: str = "cpu", weight_bytes: int | None = None) -> Hardware:
    """Measure this machine: GEMV/copy bandwidth and fp32/bf16/fp16 GEMM FLOP/s, in about `seconds`.

    Uses torch's configured thread count (`torch.get_num_threads()`), a warm-up
    call and the median of repeats. The bandwidth is the faster of the GEMV and
    the two-column GEMM (what decode does: stream every weight once per token,
    `_gemv_bandwidth`); plain-read and copy bandwidths are in `notes`.
    fp8 is not probed (None).
    """
    if seconds <= 0:
        raise StagewiseError(f"probe seconds must be > 0, got {seconds}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StagewiseError("probe on cuda asked for, but no CUDA device is available")
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    max_n = 8192 if on_gpu else 1024  # a GPU needs big GEMMs to approach its peak
    if weight_bytes is None:  # far larger than the last-level cache (CPU L3: tens to hundreds of MB; GPU L2: ~50 MB)
        weight_bytes = 2 * 2**30 if on_gpu else max(256 * 2**20, 4 * last_level_cache_bytes())
    bw = _gemv_bandwidth(device, 0.3 * seconds, sync, weight_bytes)
    stream_bw = max(bw["gemv"], bw["two_columns"])
    gemm_budget = 0.5 * seconds / 3  # the rest of `seconds` goes to allocations and warm-ups
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    flops = {dt: _gemm_flops(dt, device, gemm_budget, sync, max_n) for dt in dtypes}
    where = torch.cuda.get_device_name(device) if on_gpu else f"{torch.get_num_threads()} threads"
    return Hardware(
        name="this machine (measured)",
        peak_flops_bf16=flops[torch.bfloat16],
        peak_flops_fp16=flops[torch.float16],
        peak_flops_fp32=flops[torch.float32],
        peak_flops_fp8=None,
        memory_bandwidth=stream_bw,
        memory_bytes=_memory_capacity(device),
        notes=(
            f"{device}, {where}: fp32 weight streaming over {weight_bytes / 2**20:.0f} MiB: "
            f"GEMV {bw['gemv'] / 1e9:.1f} GB/s, two-column GEMM {bw['two_columns'] / 1e9:.1f} GB/s, "
            f"plain read {bw['read'] / 1e9:.1f} GB/s, copy {bw['copy'] / 1e9:.1f} GB/s; GEMM medians after warm-up"
        ),
    )
