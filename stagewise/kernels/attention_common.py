"""What the two attention kernels share: the online-softmax step and the input checks.

The online softmax (Milakov & Gimelshein 2018; the heart of FlashAttention)
---------------------------------------------------------------------------
softmax needs the row maximum (for stability) and the row sum before any
probability is known. Computed naively that means: all scores S = Q K^T of a
row, then max, then sum, then P V — the whole [Lq, Lk] matrix S (and P) lives
in memory: O(N^2) extra memory per head, written to HBM and read back.

The online version walks the keys tile by tile (BLOCK_N keys at a time) and
keeps, per query row, three running values:

    m    the largest score seen so far
    l    sum of exp(s - m) over the keys seen so far
    acc  sum of exp(s - m) * v over the keys seen so far          [d]

For a new tile of scores s_j:

    m_new = max(m, max_j s_j)
    alpha = exp(m - m_new)                  # rescales what was summed under the old max
    p_j   = exp(s_j - m_new)
    l     = alpha * l + sum_j p_j
    acc   = alpha * acc + sum_j p_j v_j

and after the last tile `out = acc / l`. Every term carries the same factor
exp(-m_final) in the end, so the result is exactly softmax(s) v — only the
order of the additions differs. A tile of S exists only in registers, so the
extra memory is O(N) (m and l per row) instead of O(N^2).

The HBM *traffic* is not O(N): a tile holds BLOCK_M query rows, and K and V
stream past every tile, so they are read N / BLOCK_M times per head:
Theta(N^2 d / BLOCK_M) elements. A tile must fit in the on-chip memory M
(BLOCK_M ~ M / d), which gives FlashAttention's Theta(N^2 d^2 / M) (Dao et al.
2022, Theorem 2) against the naive path's Theta(N d + N^2): fewer bytes
whenever d^2 < M, e.g. d = 128 and ~200 KB of shared memory per SM.

`online_softmax_reference` below is that loop in plain PyTorch, for reading and
for the test that proves it equals the full softmax.

The kernels use base 2: scores are multiplied by scale * log2(e), so
exp(x) = exp2(x * log2(e)) costs one `exp2` (a single GPU instruction).
Masked scores are -inf and give p = 0. The running max starts at a large
*finite* negative number, so a row that sees no key at all keeps m finite,
alpha = exp2(0) = 1, p = exp2(-inf) = 0, l = 0 — no NaN from (-inf) - (-inf) —
and the kernels write 0 for rows with l == 0.
"""

import math

import torch
import triton
import triton.language as tl

from stagewise.kernels.checks import (
    KernelInputError,
    check_dim,
    check_dtype,
    check_head_dim,
    check_last_dim_contiguous,
    check_shape,
)
from stagewise.kernels.targets import Target

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
M_INIT_VALUE = (
    -1.0e30
)  # the running max's start: finite, so a row with no visible key never computes -inf - -inf
M_INIT = tl.constexpr(
    M_INIT_VALUE
)  # the same for kernels (@triton.jit code may read constexpr globals only)


def online_softmax_reference(
    scores: torch.Tensor, values: torch.Tensor, block_n: int
) -> torch.Tensor:
    """softmax(scores) @ values, walking the keys `block_n` at a time; never holds a full row of P.

    scores [M, N] (-inf = masked), values [N, d] -> [M, d]. Rows with no finite score give 0.
    """
    scores, values = scores.double(), values.double()
    m = torch.full((scores.shape[0],), M_INIT_VALUE, dtype=torch.float64)  # [M] running max
    row_sum = torch.zeros(scores.shape[0], dtype=torch.float64)  # [M] running sum of exp(s - m)
    acc = torch.zeros(
        scores.shape[0], values.shape[1], dtype=torch.float64
    )  # [M, d] running sum of exp(s - m) v
    for start in range(0, scores.shape[1], block_n):
        s = scores[:, start : start + block_n]  # [M, block_n]: one tile of scores
        m_new = torch.maximum(m, s.max(dim=1).values)  # [M]
        alpha = torch.exp(m - m_new)  # [M] rescale factor for everything summed so far
        p = torch.exp(s - m_new[:, None])  # [M, block_n]
        row_sum = alpha * row_sum + p.sum(dim=1)
        acc = (
            alpha[:, None] * acc + p @ values[start : start + block_n]
        )  # [M, block_n] @ [block_n, d]
        m = m_new
    return torch.where(row_sum[:, None] > 0, acc / row_sum.clamp_min(1e-300)[:, None], 0.0)


@triton.jit
def attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running sum of p * v
    m_i,  # [BLOCK_M] fp32 running max of the scores (base-2 units)
    l_i,  # [BLOCK_M] fp32 running sum of p
    q,  # [BLOCK_M, HEAD_DIM] query tile (fp32 when FP32_DOTS, else the input dtype)
    k,  # [BLOCK_N, HEAD_DIM] key tile
    v,  # [BLOCK_N, HEAD_DIM] value tile
    visible,  # [BLOCK_M, BLOCK_N] bool: may this row see this key (read only when MASKED)
    qk_scale,  # softmax scale * log2(e)
    MASKED: tl.constexpr,  # False for tiles that every row sees whole: no mask work at all
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 tiles; 16-bit tiles ignore it (precision.py)
):
    """One step of the online softmax: fold one K/V tile into (acc, m, l).

    q, k, v are all fp32 (fp32 dots) or all 16-bit (tensor-core dots, fp32 accumulation).
    """
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    s = s * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
    alpha = tl.math.exp2(m_i - m_new)  # [BLOCK_M] rescales the old sums to the new max
    p = tl.math.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]; masked -> exp2(-inf) = 0
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc += tl.dot(
        p.to(v.dtype), v, input_precision=INPUT_PRECISION
    )  # 16-bit v: P rounded to 16 bits, as in FA
    return acc, m_new, l_i


def check_qkv(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_ndim: int,
    kv_names=("k", "v"),
) -> tuple[int, int, int]:
    """q [T, H, d] and K/V [..., Hkv, d] of one dtype and head_dim, H a multiple of Hkv -> (H, Hkv, d)."""
    k_name, v_name = kv_names
    check_dim(kernel, "q", q, 3)
    check_dim(kernel, k_name, k, kv_ndim)
    check_dtype(kernel, "q", q, FLOAT_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelInputError(
            f"{kernel}: q, {k_name}, {v_name} must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_shape(kernel, v_name, v, tuple(k.shape))
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        check_last_dim_contiguous(kernel, name, t)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise KernelInputError(
            f"{kernel}: {k_name} has head_dim {k.shape[-1]}, but q has {head_dim}"
        )
    check_head_dim(kernel, head_dim)
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise KernelInputError(
            f"{kernel}: {num_heads} query heads cannot share {num_kv_heads} KV heads (GQA needs H % Hkv == 0)"
        )
    return num_heads, num_kv_heads, head_dim


def check_index(kernel: str, name: str, t: torch.Tensor, length: int | None) -> None:
    """A 1-D int32 index tensor (cu_seqlens, seq_lens) of the given length."""
    check_dtype(kernel, name, t, (torch.int32,))
    check_shape(kernel, name, t, (length,))


def check_cu_seqlens_q(kernel: str, cu_q: list[int], num_tokens: int) -> None:
    """cu_seqlens_q must start at 0, never decrease and end at the number of query rows."""
    if cu_q[0] != 0 or cu_q[-1] != num_tokens or any(b < a for a, b in zip(cu_q, cu_q[1:])):
        raise KernelInputError(
            f"{kernel}: cu_seqlens_q {cu_q} must rise from 0 to the {num_tokens} query rows, never decreasing"
        )


def qk_scale_log2(scale: float) -> float:
    """The softmax scale in base-2 units: exp(s * scale) == exp2(s * scale * log2(e))."""
    if not math.isfinite(scale) or scale <= 0:
        raise KernelInputError(f"attention: scale must be a positive finite number, got {scale}")
    return float(scale) * LOG2E


def fma_dots(dtype: torch.dtype, target: Target) -> bool:
    """Whether tl.dot runs on FMA units, not tensor cores: fp32 with IEEE precision, and any dot before sm_80."""
    return dtype == torch.float32 or target.capability < 80


def tile_fits(
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    head_dim: int,
    dtype,
    target: Target,
):
    """Whether an attention tile fits a GPU: its shared memory, and registers without spilling.

    Shared memory (bytes): num_stages - 1 pairs of K and V tiles [BLOCK_N, d] in flight, the Q tile
    [BLOCK_M, d], the P tile [BLOCK_M, BLOCK_N] staged for the second dot, the row statistics; the
    compile gate checks this stays at or above what Triton allocates.

    Registers: on tensor cores each thread holds its share of the fp32 accumulator [BLOCK_M, d] and
    scores [BLOCK_M, BLOCK_N] (plus their 16-bit copies for the dots) and of the K/V tiles; past ~160
    32-bit words of that ptxas spills (measured: 152 clean, 176 spills). FMA dots (fp32, pre-Ampere)
    keep whole operand rows per thread: they need BLOCK_M * BLOCK_N * d <= 512 per thread (256 on sm_90, sm_75).
    """
    if target.interpreter:
        return True
    size, threads = dtype.itemsize, 32 * num_warps
    kv = 2 * block_n * head_dim * size
    shared = (
        max(num_stages - 1, 1) * kv + (block_m * head_dim + block_m * block_n) * size + block_m * 4
    )
    if fma_dots(
        dtype, target
    ):  # measured: sm_90 (ptxas 13) and sm_75 spill at half what sm_80/89 hold
        registers_ok = (
            block_m * block_n * head_dim <= (512 if 80 <= target.capability < 90 else 256) * threads
        )
    else:
        words = (block_m * head_dim * (4 + size) + block_m * block_n * (4 + size) + kv) // (
            4 * threads
        )
        registers_ok = words <= 160
    return shared <= target.shared_memory and registers_ok
