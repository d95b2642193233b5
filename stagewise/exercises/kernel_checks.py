"""Checks for the kernels the student writes in notebook 12a, against the naive stages.

The student hands the check the `@triton.jit` kernel itself; the check launches it (interpreted on
a CPU, compiled on a GPU) with the stub's parameters on tensors of irregular sizes that it owns,
inside poisoned guard bands (`kernel_launch.py`), so every mask matters and an unmasked access
reads FAIL instead of crashing, and compares what the kernel wrote with the stage's naive path:

    12a.silu_and_mul   element-wise with a mask: gate_up [T, 2*inter] -> silu(gate) * up
    12a.rmsnorm        a row reduction: x [T, hidden] -> x / rms(x) * weight
    12a.online_softmax the online-softmax tile step: softmax(scores) @ values, key tile by key tile;
                       in the interpreter the check also sees every load: each score is read
                       once, at most BLOCK_N of them at a time
"""

import numpy as np
import torch

from stagewise.exercises.core import Mismatch, close
from stagewise.exercises.kernel_launch import Guarded, interpreted, kernel_function, launch, no_poison
from stagewise.stages import STAGES
from stagewise.stages.ffn import silu_and_mul_naive

SILU_PARAMS = ["gate_up_ptr", "out_ptr", "inter", "stride_in", "BLOCK"]
RMSNORM_PARAMS = ["x_ptr", "weight_ptr", "out_ptr", "hidden", "stride_x", "eps", "BLOCK"]
SOFTMAX_PARAMS = ["scores_ptr", "values_ptr", "out_ptr", "num_keys", "dim", "BLOCK_N", "BLOCK_D"]


def _inputs(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def run_silu_and_mul(kernel, gate_up: torch.Tensor, block: int, row_stride: int | None = None, watch=True):
    """Launch the kernel as 12a's launcher does, on a guarded copy of gate_up; -> out [T, inter] (CPU)."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    src = Guarded.of("gate_up_ptr", gate_up, poison=float("nan"), row_stride=row_stride)
    out = Guarded.output("out_ptr", (tokens, inter))
    grid = (tokens, -(-inter // block))
    launch(kernel, grid, [src], out, watch, inter=inter, stride_in=src.view.stride(0), BLOCK=block)
    return out.view.cpu()


def check_silu_and_mul(kernel) -> str:
    """my_silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, BLOCK): one program per (row, column block)."""
    kernel_function(kernel, SILU_PARAMS)
    cases = [(1, 4, 16, None), (5, 24, 16, None), (3, 100, 32, None), (4, 40, 16, 87)]  # (T, inter, BLOCK, stride)
    for i, (tokens, inter, block, stride) in enumerate(cases):
        gate_up = 3 * _inputs(i, tokens, 2 * inter)
        what = f"T={tokens}, inter={inter}, BLOCK={block}" + (f", rows {stride} elements apart" if stride else "")
        got = run_silu_and_mul(kernel, gate_up, block, stride)
        no_poison(got, what)
        close(got, silu_and_mul_naive(gate_up), what, atol=1e-5)
    return f"your kernel, launched on {len(cases)} guarded shapes (one strided), wrote the ffn stage's silu_and_mul"


def run_rmsnorm(kernel, x, weight, eps: float, row_stride: int | None = None, watch=True) -> torch.Tensor:
    src = Guarded.of("x_ptr", x, poison=float("nan"), row_stride=row_stride)
    w = Guarded.of("weight_ptr", weight, poison=float("nan"))
    out = Guarded.output("out_ptr", tuple(x.shape))
    hidden = x.shape[1]
    scalars = dict(hidden=hidden, stride_x=src.view.stride(0), eps=eps, BLOCK=_next_power_of_2(hidden))
    launch(kernel, (x.shape[0],), [src, w], out, watch, **scalars)
    return out.view.cpu()


def check_rmsnorm(kernel) -> str:
    """my_rmsnorm_kernel(x_ptr, weight_ptr, out_ptr, hidden, stride_x, eps, BLOCK): one program per row."""
    kernel_function(kernel, RMSNORM_PARAMS)
    cases = [(1, 16, None), (4, 48, None), (3, 100, None), (3, 24, 40)]  # 48, 100: masked lanes; 40: a strided x
    for i, (tokens, hidden, stride) in enumerate(cases):
        x, weight = 2 * _inputs(i, tokens, hidden), 1 + 0.1 * _inputs(10 + i, hidden)
        want, _ = STAGES["rmsnorm"].naive(x=x, weight=weight, eps=1e-5)
        what = f"T={tokens}, hidden={hidden}" + (f", rows {stride} elements apart" if stride else "")
        got = run_rmsnorm(kernel, x, weight, 1e-5, stride)
        no_poison(got, what)
        close(got, want, what, atol=1e-5)
    x = _inputs(7, 2, 24) * 1e-3  # tiny values: eps matters
    want, _ = STAGES["rmsnorm"].naive(x=x, weight=torch.ones(24), eps=1e-2)
    close(run_rmsnorm(kernel, x, torch.ones(24), 1e-2), want, "eps = 1e-2 on values near 1e-3", atol=1e-5)
    return f"your kernel, launched on {len(cases) + 1} guarded shapes (one strided), wrote the rmsnorm stage's output"


def run_online_softmax(kernel, scores, values, block_n: int, watch=True):
    """-> (out [M, d] on the CPU, the watch: which score elements each load read)."""
    (rows, keys), dim = scores.shape, values.shape[1]
    s = Guarded.of("scores_ptr", scores, poison=float("nan"))
    v = Guarded.of("values_ptr", values, poison=float("nan"))
    out = Guarded.output("out_ptr", (rows, dim))
    scalars = dict(num_keys=keys, dim=dim, BLOCK_N=block_n, BLOCK_D=_next_power_of_2(dim))
    watched = launch(kernel, (rows,), [s, v], out, watch, **scalars)
    return out.view.cpu(), watched.loads["scores_ptr"]


def _tiles_read_once(loads: list[np.ndarray], num_scores: int, block_n: int, where: str) -> None:
    """Every score read exactly once, at most block_n per load (the interpreter's record of loads)."""
    widest = max((len(x) for x in loads), default=0)
    if widest > block_n:
        raise Mismatch(f"{where}: one load reads {widest} scores; the kernel walks a row BLOCK_N = {block_n} at a time")
    reads = np.bincount(np.concatenate(loads) if loads else np.zeros(0, np.int64), minlength=1)
    read = reads[reads > 0]
    if len(read) != num_scores or (read != 1).any():
        raise Mismatch(
            f"{where}: your kernel reads {int(reads.sum())} scores for {num_scores} "
            f"({int((read > 1).sum())} more than once): the online softmax reads each score once, tile by tile"
        )


def check_online_softmax(kernel) -> str:
    """my_online_softmax_kernel(scores_ptr, values_ptr, out_ptr, num_keys, dim, BLOCK_N, BLOCK_D)."""
    kernel_function(kernel, SOFTMAX_PARAMS)
    cases = [(3, 37, 8, 16), (2, 50, 5, 4), (4, 20, 16, 64), (2, 300, 8, 32)]  # (M, N, d, BLOCK_N)
    for i, (rows, keys, dim, block_n) in enumerate(cases):
        scores = 4 * _inputs(i, rows, keys)
        scores[0] = torch.linspace(-8, 8, keys)  # a row whose max keeps growing: every tile rescales
        values = _inputs(20 + i, keys, dim)
        want = torch.softmax(scores.double(), dim=-1) @ values.double()  # needs the whole row at once
        what = f"M={rows}, N={keys}, d={dim}, tiles of {block_n} keys"
        got, loads = run_online_softmax(kernel, scores, values, block_n)
        no_poison(got, what)
        close(got, want.float(), what, atol=1e-5)
        if interpreted():
            _tiles_read_once(loads, rows * keys, block_n, what)
    tiles = "; each score read once, a tile at a time" if interpreted() else ""
    return f"your kernel, launched on {len(cases)} guarded shapes, wrote softmax(scores) @ values{tiles}"


CHECKS = {
    "12a.silu_and_mul": check_silu_and_mul,
    "12a.rmsnorm": check_rmsnorm,
    "12a.online_softmax": check_online_softmax,
}
