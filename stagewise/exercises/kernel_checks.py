"""Checks for the kernels the student writes in notebook 12a, against the naive stages.

The student's function is a launcher of their own Triton kernel (interpreted on a CPU, compiled on
a GPU); the check feeds it small tensors of irregular sizes, so every mask matters, and compares
with the stage's naive path:

    12a.silu_and_mul   element-wise with a mask: gate_up [T, 2*inter] -> silu(gate) * up
    12a.rmsnorm        a row reduction: x [T, hidden] -> x / rms(x) * weight
    12a.online_softmax the online-softmax tile step: softmax(scores) @ values, key tile by key tile
"""

import torch

from stagewise.exercises.core import call, close
from stagewise.stages import STAGES
from stagewise.stages.ffn import silu_and_mul_naive


def _inputs(seed: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check_silu_and_mul(fn) -> str:
    """my_silu_and_mul(gate_up [T, 2*inter]) -> [T, inter], rows possibly strided."""
    cases = [(1, 4), (5, 24), (3, 100)]  # inter: a power of two, a multiple of 8, neither
    for i, (tokens, inter) in enumerate(cases):
        gate_up = 3 * _inputs(i, tokens, 2 * inter)
        close(call(fn, gate_up), silu_and_mul_naive(gate_up), f"T={tokens}, inter={inter}", atol=1e-5)
    wide = 3 * _inputs(9, 4, 2 * 40 + 7)[:, :80]  # rows 87 elements apart: pass the stride, do not assume it
    close(call(fn, wide), silu_and_mul_naive(wide), "rows of a wider tensor (row stride 87)", atol=1e-5)
    return f"{len(cases)} shapes and a strided view agree with the ffn stage's silu_and_mul"


def check_rmsnorm(fn) -> str:
    """my_rmsnorm(x [T, hidden], weight [hidden], eps) -> [T, hidden]."""
    cases = [(1, 16), (4, 48), (3, 100)]  # hidden 48 and 100: the block has masked lanes
    for i, (tokens, hidden) in enumerate(cases):
        x, weight = 2 * _inputs(i, tokens, hidden), 1 + 0.1 * _inputs(10 + i, hidden)
        want, _ = STAGES["rmsnorm"].naive(x=x, weight=weight, eps=1e-5)
        close(call(fn, x, weight, 1e-5), want, f"T={tokens}, hidden={hidden}", atol=1e-5)
    x = _inputs(7, 2, 24) * 1e-3  # tiny values: eps matters
    want, _ = STAGES["rmsnorm"].naive(x=x, weight=torch.ones(24), eps=1e-2)
    close(call(fn, x, torch.ones(24), 1e-2), want, "eps = 1e-2 on values near 1e-3", atol=1e-5)
    return f"{len(cases) + 1} shapes agree with the rmsnorm stage (naive)"


def check_online_softmax(fn) -> str:
    """my_online_softmax(scores [M, N], values [N, d], block_n) -> softmax(scores) @ values [M, d]."""
    cases = [(3, 37, 8, 16), (2, 50, 5, 4), (4, 20, 16, 64)]  # (M, N, d, block_n): 3, 13 and 1 key tiles
    for i, (rows, keys, dim, block_n) in enumerate(cases):
        scores = 4 * _inputs(i, rows, keys)
        scores[0] = torch.linspace(-8, 8, keys)  # a row whose max keeps growing: every tile rescales
        values = _inputs(20 + i, keys, dim)
        want = torch.softmax(scores.double(), dim=-1) @ values.double()  # needs the whole row at once
        got = call(fn, scores, values, block_n)
        close(got, want.float(), f"M={rows}, N={keys}, d={dim}, tiles of {block_n} keys", atol=1e-5)
    return f"{len(cases)} shapes (one tile, several, a masked last tile) equal softmax(scores) @ values"


CHECKS = {
    "12a.silu_and_mul": check_silu_and_mul,
    "12a.rmsnorm": check_rmsnorm,
    "12a.online_softmax": check_online_softmax,
}
