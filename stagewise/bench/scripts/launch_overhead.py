"""Host microseconds per kernel launcher call: the Python a launch costs before the GPU sees it.

A decode step of SmolLM2-135M makes ~10 launches per layer x 30 layers = ~300
launches. At 60 us of Python each that is 18 ms of host time a step, whatever
the GPU does: an eager step is host bound when its kernels are this small.
Most of that Python is *planning* (grid, block sizes, the tuned
`triton.Config`), which depends only on shapes and dtypes, so each launcher
computes it once per shape key and keeps it (`stagewise.kernels.plan_cache`);
what still runs on every call is the checks (dtype, layout, shape asserts:
a few attribute reads each), the output allocation and the launch itself.

This benchmark times a launcher with its `@triton.jit` kernels swapped for a
stand-in that only evaluates the grid, so the number is the launcher's own
host work: under the CPU interpreter the launch itself runs every program in
Python (~1 ms each), which would drown it. It runs each launcher at SmolLM2
decode shapes twice: *cold*, with every plan cache cleared before each call
(what the first call for a shape pays), and *cached* (every later call).
On a GPU the kernels really launch, so Triton's own launch (argument
binding, its specialisation key) is in the number: compare cold and cached.
"""

import time
from contextlib import contextmanager

import torch

from stagewise.kernels import (
    activation,
    dequant_matmul,
    embedding,
    flash_attention,
    kv_store,
    matmul,
    matmul_decode,
    paged_attention,
    rmsnorm,
    rope,
    split_k,
)
from stagewise.kernels.plan_cache import clear_plan_caches

KERNELS = {  # module -> the @triton.jit kernels its launcher may launch
    embedding: ("_embedding_kernel",),
    matmul: ("_matmul_kernel",),
    matmul_decode: ("_decode_kernel", "_split_k_sum_kernel"),
    dequant_matmul: ("_dequant_matmul_kernel",),
    rmsnorm: ("_rmsnorm_kernel",),
    rope: ("_rope_kernel",),
    activation: ("_silu_and_mul_kernel",),
    kv_store: ("_kv_store_kernel",),
    paged_attention: ("_paged_attention_kernel",),
    flash_attention: ("_flash_attention_kernel",),
    split_k: ("_split_k_reduce_kernel",),
}


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](**args)` evaluates the grid, runs nothing."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return grid(kwargs) if callable(grid) else grid

        return launch


@contextmanager
def kernels_stubbed():
    """Every launcher's kernels replaced by `_NoLaunch` inside the block (restored after)."""
    saved = {(m, n): getattr(m, n) for m, names in KERNELS.items() for n in names}
    try:
        for module, name in saved:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for (module, name), kernel in saved.items():
            setattr(module, name, kernel)


def decode_calls(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict:
    """One decode step's launcher calls at SmolLM2-135M shapes (hidden 576, 9 / 3 heads of 64,
    intermediate 1536, QKV width (9 + 2 * 3) * 64 = 960), one sequence of 100 cached tokens."""
    f = dict(dtype=dtype, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    hidden, heads, kv_heads, d, inter, qkv = 576, 9, 3, 64, 1536, 960
    x = torch.randn(1, hidden, **f)
    w = torch.randn(hidden, qkv, **f)
    prefill_x = torch.randn(37, hidden, **f)
    codes = torch.randint(0, 255, (qkv, hidden // 2), dtype=torch.uint8, device=device)
    scales = torch.rand(qkv, hidden // 32, dtype=torch.float16, device=device)
    norm_w = torch.ones(hidden, **f)
    q, k = torch.randn(1, heads, d, **f), torch.randn(1, kv_heads, d, **f)
    positions = torch.tensor([99], device=device)
    cos_sin = torch.randn(2048, d, device=device)
    gate_up = torch.randn(1, 2 * inter, **f)
    caches = torch.zeros(2, 64, 16, kv_heads, d, **f)  # [K/V, blocks, block_size, Hkv, d]
    slots = torch.tensor([99], device=device)
    block_table = torch.arange(8, **i32)[None, :]  # [1 sequence, 8 blocks]
    seq_lens = torch.tensor([100], **i32)
    cu_q = torch.tensor([0, 1], **i32)
    flat = caches.view(2, -1, kv_heads, d)  # [K/V, slots, Hkv, d]
    ids, table = torch.tensor([7], device=device), torch.randn(1000, hidden, **f)
    return {
        "embedding": lambda: embedding.embedding(ids, table),
        "matmul (decode, split-K)": lambda: matmul.matmul(x, w),
        "matmul (prefill, 37 rows)": lambda: matmul.matmul(prefill_x, w),
        "dequant_matmul (q4_1, decode)": lambda: dequant_matmul.dequant_matmul(
            x, codes, scales, scales, bits=4, offset=0
        ),
        "rmsnorm (+ residual)": lambda: rmsnorm.rmsnorm(x, norm_w, 1e-5, residual=x),
        "rope": lambda: rope.rope(positions, q, k, cos_sin),
        "silu_and_mul": lambda: activation.silu_and_mul(gate_up),
        "kv_store": lambda: kv_store.kv_store(k, k, flat[0], flat[1], slots),
        "paged_attention (decode)": lambda: paged_attention.paged_attention(
            q, caches[0], caches[1], block_table, seq_lens, cu_q, 0.125, max_q_len=1, max_seq_len=100
        ),
    }


def _us_per_call(call, calls: int, cold: bool) -> float:
    """Host microseconds per call: the least of 5 rounds' means (cache clearing excluded).

    Timed with the thread's CPU clock (`time.thread_time_ns`), not the wall clock: while other
    processes hold the cores this thread is not running, and that wait is no cost of the launcher.
    The least round is the one the rest of the machine disturbed least (caches, frequency).
    """
    rounds = []
    for _ in range(5):
        total = 0
        for _ in range(calls):
            if cold:
                clear_plan_caches()
            start = time.thread_time_ns()
            call()
            total += time.thread_time_ns() - start
        rounds.append(total / calls / 1e3)
    return min(rounds)


def launch_overhead(
    calls: int = 200,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> list[dict]:
    """Rows of {launcher, cold_us, cached_us, kernels_launched}: host microseconds per call.

    On the CPU the kernels are stubbed (the launcher's own work). On a GPU the real kernels are
    queued, so the numbers include Triton's launch too (stubbing there would leave the autotuners
    wrapping a stand-in); the GPU is synchronised after each launcher's rounds, never inside the
    timed calls, and the warm-up call compiles and tunes first.
    """
    device = torch.device(device)
    launch = device.type == "cuda"
    rows = []
    with _synchronizing(device) if launch else kernels_stubbed():
        for name, call in decode_calls(dtype, device).items():
            call()  # warm-up: first-use imports, the allocator, on a GPU compiling and tuning
            cold = _us_per_call(call, calls, cold=True)
            cached = _us_per_call(call, calls, cold=False)
            if launch:
                torch.cuda.synchronize(device)
            rows.append({"launcher": name, "cold_us": cold, "cached_us": cached, "kernels_launched": launch})
    return rows


@contextmanager
def _synchronizing(device):
    yield
    torch.cuda.synchronize(device)


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'launcher':32s} {'cold us':>9s} {'cached us':>10s}"]
    for r in rows:
        lines.append(f"{r['launcher']:32s} {r['cold_us']:9.1f} {r['cached_us']:10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """python -m stagewise.bench.scripts.launch_overhead [--device cuda] [--dtype bfloat16] [--calls N]"""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--calls", type=int, default=200, help="timed calls per round (5 rounds)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be >= 1, got {args.calls}")
    rows = launch_overhead(args.calls, getattr(torch, args.dtype), args.device)
    what = "kernels launched (Triton's launch included)" if rows[0]["kernels_launched"] else "kernels stubbed"
    print(format_rows(rows), f"\n({what}; thread CPU time, least of 5 rounds)")


if __name__ == "__main__":
    main()
