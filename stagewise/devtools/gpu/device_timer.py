"""Timing one kernel call honestly, on a GPU or (for a dry run) on the CPU.

Three rules make a kernel time mean something:

- **Events, not host clocks.** A launch returns before the kernel runs; CUDA
  events recorded on the stream before and after a batch of calls measure the
  GPU's time for them.
- **Bigger than the cache.** An H200 has 60 MB of L2. A weight matrix of 50 MB
  read over and over stays in L2 and "streams" at several times HBM speed. So
  each case builds enough *copies* of its inputs to fill at least
  `min_working_set` bytes (1 GB by default) and the timed loop walks through
  them: every call reads operands that the previous calls evicted.
- **Median of several rounds**, after warm-up calls that pay for Triton's
  compilation and autotuning.

`time_calls` returns milliseconds per call. `copy_bandwidth` and `matmul_peak`
measure the two ceilings every other number is compared with.
"""

import statistics
import time
from collections.abc import Callable, Sequence

import torch

GB = 1e9


def copies_for(bytes_per_copy: int, min_working_set: int, max_copies: int = 64) -> int:
    """How many copies of a case's inputs fill `min_working_set` bytes (at least 1)."""
    return max(1, min(max_copies, -(-min_working_set // max(1, bytes_per_copy))))


def time_calls(calls: Sequence[Callable[[], object]], device: torch.device, rounds: int = 5, warmup: int = 1) -> float:
    """Median milliseconds per call, launched from Python; each round runs every call once, in order.

    On a GPU this includes the host's cost of each launch whenever a kernel is shorter than it.
    """
    for _ in range(warmup):
        for call in calls:
            call()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for call in calls:
                call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / len(calls))
    else:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for call in calls:
                call()
            samples.append((time.perf_counter() - t0) * 1e3 / len(calls))
    return statistics.median(samples)


def time_kernels(calls: Sequence[Callable[[], object]], device: torch.device, rounds: int = 5) -> tuple[float, str]:
    """Median GPU milliseconds per call with the host out of the way: (ms, how it was timed).

    The calls are captured once in a CUDA graph (after warm-up calls, so Triton has compiled and
    autotuned) and the graph is replayed: launches cost the host nothing, so a 10 µs kernel is
    timed as 10 µs and not as the 30 µs its Python launch takes. A call that cannot be captured
    (one that reads a device value on the host, say) falls back to `time_calls`, and says so.
    """
    if device.type != "cuda":
        return time_calls(calls, device, rounds), "host clock (no GPU)"
    for call in calls:  # warm-up: compile, autotune, allocate
        call()
    torch.cuda.synchronize(device)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
    except Exception as err:  # not capturable: time it as launched
        torch.cuda.synchronize(device)
        reason = str(err).splitlines()[0][:100]
        return time_calls(calls, device, rounds, warmup=0), f"eager launches (graph capture failed: {reason})"
    graph.replay()  # one untimed replay
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(samples), "cuda graph replay"


def copy_bandwidth(device: torch.device, num_bytes: int, rounds: int = 5) -> dict:
    """Device-to-device copy of `num_bytes`: bytes read + bytes written per second (the HBM ceiling)."""
    src = torch.randn(num_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_calls([lambda: dst.copy_(src)], device, rounds=rounds, warmup=2)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes": moved, "ms": ms, "gb_per_s": moved / (ms * 1e-3) / GB}


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16, rounds: int = 5) -> dict:
    """torch.matmul of two random n x n matrices: the library's arithmetic ceiling in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_calls([lambda: a @ b], device, rounds=rounds, warmup=2)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never a pass)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
