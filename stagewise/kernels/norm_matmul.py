"""RMSNorm fused into the projection that follows it, for decode shapes (M <= 16 rows).

    x [M, K] (+ residual [M, K]), norm_weight [K], w [K, N]
        -> c [M, N] = rmsnorm(x + residual) @ w,   residual_out [M, K] = x + residual

A Llama block normalises the residual stream and immediately multiplies the
result by W_qkv. Run as two kernels, the normalised rows go to memory and come
straight back: one launch, one write and one read of [M, K] more than needed.
Here the GEMM's A-operand load does the norm: each program loads the rows of
x (and residual), adds them, scales them by the row's 1 / rms and by the norm
weight, and feeds that tile to `tl.dot`. The normalised rows never exist in
memory and the rmsnorm launch is gone.

The catch: 1 / rms needs the sum of squares of the *whole* row, but a split-K
program (kernels/matmul_decode.py) sees only its own range of K. Two ways out:
(a) every program first walks the whole row and recomputes the statistic, or
(b) a tiny statistics kernel writes [M] values that the GEMM then reads. (b)
brings back one launch, the one this kernel exists to remove. (a) re-reads
rows instead, and for decode the rows are small: Llama-3-8B's qkv_proj (K =
4096, N = 6144, bf16) with 64-wide tiles and ~2 splits has ~190 programs, each
re-reading M x 4096 x 2 bytes (x and residual: twice that). At M = 1 that is
190 x 16 KB = 3 MB, against 48 MB of weights streamed; at M = 16, 48 MB, but
from L2 (the same 128 KB of rows for every program), which delivers several
times HBM's bandwidth. A launch costs ~2-4 us of a ~30 us decode GEMM at batch
1; the re-read, mostly L2 hits, costs less. So (a).

The new residual stream (x + residual) is written exactly once: by the
programs of the first tile of N, each for its own range of K. Rounding is the
unfused pair's: x + residual is rounded to the input dtype, the normalised row
is rounded to the input dtype before the norm weight multiplies it, that
product is rounded again (it is rmsnorm's output), and only then enters the
dot (fp32 accumulation, precision.py's policy). The sum of squares is added in
another order than the rmsnorm kernel's, so 1 / rms may differ in its last
bit: results agree within the GEMM's tolerance, not bit for bit.

Splits, tiles and the ordered in-kernel sum of partials are matmul_decode's;
its GPU candidates get fewer pipeline stages where the second A-side tile
(residual) would not fit shared memory, and are timed once per shape class
on a GPU (`norm_matmul_config`), never per M. Plain weights
only; more rows than 16 (prefill), quantized weights or mixed dtypes go
through the separate rmsnorm and GEMM kernels: the caller decides
(`fits_norm_matmul`).
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
)
from stagewise.kernels.matmul_decode import (
    BLOCK_M,
    DECODE_MAX_M,
    INTERPRETER_CONFIG,
    DecodeConfig,
    decode_launch,
    gpu_candidates,
    smem_budget,
    split_k_sum,
    split_outputs,
    store_split_tile,
)
from stagewise.kernels.precision import DotPolicy, dot_policy, round_to_bf16
from stagewise.kernels.split_k import num_sms
from stagewise.kernels.targets import checked_target

NAME = "norm_matmul"


@triton.jit
def _as_dtype(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x -> fp32 holding x rounded to `dtype` to nearest (the interpreter's bf16 cast
    truncates, so there it is rounded by hand first)."""
    if INTERPRETED and dtype == tl.bfloat16:
        x = round_to_bf16(x)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _residual_rows(
    x_ptrs,  # [BLOCK_M, BLOCK_K] pointers into x
    r_ptrs,  # [BLOCK_M, BLOCK_K] pointers into residual (read when HAS_RESIDUAL)
    mask,  # [BLOCK_M, BLOCK_K]
    HAS_RESIDUAL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """-> s = x + residual as fp32 values of the input dtype: [BLOCK_M, BLOCK_K]."""
    s = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = _as_dtype(s + r, x_ptrs.dtype.element_ty, INTERPRETED)  # rounded once, like x + r
    return s


@triton.jit
def _norm_matmul_kernel(
    x_ptr,  # [M, K] rows to normalise, last dim contiguous
    stride_xm,  # elements between rows of x
    residual_ptr,  # [M, K] residual rows (read when HAS_RESIDUAL), last dim contiguous
    stride_rm,  # elements between rows of residual
    residual_out_ptr,  # [M, K] x + residual, contiguous (written when HAS_RESIDUAL)
    norm_w_ptr,  # [K] the norm's learned scale, contiguous
    b_ptr,  # [K, N] projection weights, any strides
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or c [M, N] itself when there is one split
    c_ptr,  # [M, N] output (written here only when FUSED_SUM)
    counter_ptr,  # [tiles of N] int32 arrivals per tile, 0 between launches (when FUSED_SUM)
    M,  # rows (<= BLOCK_M)
    N,  # columns of w and c
    K,  # hidden: the normalised row's width, the reduction length
    K_PER_SPLIT,  # depth of K each split walks, a multiple of BLOCK_K
    eps,  # added to the mean square before rsqrt
    stride_bk,  # elements between rows of w
    stride_bn,  # elements between columns of w
    stride_os,  # elements between the partials of consecutive splits (0 when out is c)
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    stride_cm,  # elements between rows of c
    stride_cn,  # elements between columns of c
    HAS_RESIDUAL: tl.constexpr,  # add residual to x first (and write the sum)
    INTERPRETED: tl.constexpr,  # CPU interpreter: bf16 rounded by hand
    FP32_DOTS: tl.constexpr,  # dot fp32 tiles (fp32 inputs; bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED_SUM: tl.constexpr,  # split: the tile's last split sums the partials into c
):
    tile_n = tl.program_id(0)
    split = tl.program_id(1)
    k_start = split * K_PER_SPLIT
    k_stop = tl.minimum(K, k_start + K_PER_SPLIT)
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols_b = offs_n.to(tl.int64)

    # 1. The statistic: each row's sum of squares over all of K (every program recomputes it).
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + offs_k
        mask = mask_m[:, None] & (ks < K)[None, :]
        s = _residual_rows(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                           residual_ptr + rows[:, None] * stride_rm + ks[None, :], mask,
                           HAS_RESIDUAL, INTERPRETED)  # fmt: skip
        squares += tl.sum(s * s, axis=1)
    rstd = tl.rsqrt(squares / K + eps)  # [BLOCK_M]

    # 2. This split's range of K: normalise the A tile on the way into the dot.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k in range(k_start, k_stop, BLOCK_K):
        ks = k + offs_k  # [BLOCK_K]
        k_ok = ks < k_stop
        mask = mask_m[:, None] & k_ok[None, :]
        s = _residual_rows(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                           residual_ptr + rows[:, None] * stride_rm + ks[None, :], mask,
                           HAS_RESIDUAL, INTERPRETED)  # fmt: skip
        b = tl.load(b_ptr + ks.to(tl.int64)[:, None] * stride_bk + cols_b[None, :] * stride_bn,
                    mask=k_ok[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        if HAS_RESIDUAL:
            if tile_n == 0:  # the new residual stream: only the first tile of N writes it
                tl.store(residual_out_ptr + rows[:, None] * K + ks[None, :], s.to(dtype), mask=mask)
        g = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        normed = _as_dtype(s * rstd[:, None], dtype, INTERPRETED)  # rounded before the weight
        a = _as_dtype(normed * g[None, :], dtype, INTERPRETED)  # rmsnorm's output, [M, BLOCK_K]
        if FP32_DOTS:
            b = b.to(tl.float32)
        else:
            a = a.to(dtype)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    # 3. Store, and (split) the ordered sum of the partials by the tile's last split.
    store_split_tile(
        acc, out_ptr, c_ptr, counter_ptr, tile_n, split, offs_m, cols_b, mask_m, mask_n,
        stride_os, stride_om, stride_on, stride_cm, stride_cn, INTERPRETED, FUSED_SUM,
    )  # fmt: skip


def fits_norm_matmul(x: torch.Tensor, norm_weight: torch.Tensor, w) -> bool:
    """True when the fused kernel takes this call: a decode batch (M <= 16), plain float weights,
    one dtype for x, the norm weight and w. Otherwise the caller runs rmsnorm, then the GEMM."""
    return (
        isinstance(w, torch.Tensor)
        and 0 < x.shape[0] <= DECODE_MAX_M
        and x.dtype in FLOAT_DTYPES
        and x.dtype == norm_weight.dtype == w.dtype
    )


def norm_matmul(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    w: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (+ residual [M, K]), norm_weight [K], w [K, N] -> (c [M, N], residual_out [M, K]).

    c = rmsnorm(x + residual, norm_weight, eps) @ w. Without `residual`, residual_out is x itself
    (the same object), as the rmsnorm kernel returns it. M <= 16 (`fits_norm_matmul`).
    """
    check_dim(NAME, "x", x, 2)
    check_dim(NAME, "w", w, 2)
    for name, t in (("x", x), ("norm_weight", norm_weight), ("w", w)):
        check_dtype(NAME, name, t, FLOAT_DTYPES)
    check_last_dim_contiguous(NAME, "x", x)
    m, k = x.shape
    check_shape(NAME, "norm_weight", norm_weight, (k,))
    check_contiguous(NAME, "norm_weight", norm_weight)
    check_shape(NAME, "w", w, (k, None))
    if not x.dtype == norm_weight.dtype == w.dtype:
        raise KernelInputError(
            f"{NAME}: x {x.dtype}, norm_weight {norm_weight.dtype} and w {w.dtype} must share one "
            "dtype; run rmsnorm and the GEMM separately"
        )
    if m > DECODE_MAX_M:
        raise KernelInputError(
            f"{NAME}: {m} rows; the fused kernel takes decode batches of at most {DECODE_MAX_M}"
        )
    if residual is not None:
        check_shape(NAME, "residual", residual, (m, k))
        check_last_dim_contiguous(NAME, "residual", residual)
        check_dtype(NAME, "residual", residual, (x.dtype,))
        check_same_device(NAME, x=x, norm_weight=norm_weight, w=w, residual=residual)
    else:
        check_same_device(NAME, x=x, norm_weight=norm_weight, w=w)
    n = w.shape[1]
    c = torch.empty((m, n), device=x.device, dtype=x.dtype)
    residual_out = x if residual is None else torch.empty((m, k), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return c, residual_out
    checked_target(NAME, x)
    policy = dot_policy(x.dtype)
    cfg = norm_matmul_config(x, residual, norm_weight, w, c, policy)
    _launch(x, residual, residual_out, norm_weight, w, c, eps, cfg, policy)
    return c, residual_out


def _launch(x, residual, residual_out, norm_weight, w, c, eps, cfg: DecodeConfig, policy) -> None:
    """One fused launch with a given config (and the second sum kernel when no counters)."""
    (m, k), n = x.shape, w.shape[1]
    grid, k_per_split, options = decode_launch(n, k, cfg, policy)
    splits = grid[1]
    out, stride_os, counters = split_outputs(c, splits, grid[0])
    _norm_matmul_kernel[grid](
        x_ptr=x,
        stride_xm=x.stride(0),
        residual_ptr=x if residual is None else residual,  # unread without HAS_RESIDUAL
        stride_rm=x.stride(0) if residual is None else residual.stride(0),
        residual_out_ptr=residual_out,  # unwritten without HAS_RESIDUAL
        norm_w_ptr=norm_weight,
        b_ptr=w,
        out_ptr=out,
        c_ptr=c,
        counter_ptr=c if counters is None else counters,  # unread without FUSED_SUM
        M=m,
        N=n,
        K=k,
        K_PER_SPLIT=k_per_split,
        eps=float(eps),
        stride_bk=w.stride(0),
        stride_bn=w.stride(1),
        stride_os=stride_os,
        stride_om=out.stride(-2),
        stride_on=out.stride(-1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        HAS_RESIDUAL=residual is not None,
        FUSED_SUM=counters is not None,
        **options,
    )
    if splits > 1 and counters is None:  # no counters during a CUDA-graph capture: second kernel
        split_k_sum(out, c)


def shared_memory_bytes(cfg: DecodeConfig, element_size: int) -> int:
    """(num_stages - 1) buffers (at least 1) of a w tile [BLOCK_K, BLOCK_N] and two A-side tiles
    [BLOCK_M, BLOCK_K] (x and residual)."""
    buffers = max(1, cfg.num_stages - 1)
    return buffers * (cfg.block_k * cfg.block_n + 2 * BLOCK_M * cfg.block_k) * element_size


def candidates(n: int, k: int, element_size: int, sms: int, budget: int, fma: bool) -> list:
    """The decode GEMM's GPU candidates, each with stages cut until `shared_memory_bytes` fits."""
    out = []
    for c in gpu_candidates(n, k, element_size, sms, budget, fma):
        stages = c.num_stages
        while (
            stages > 1
            and shared_memory_bytes(
                DecodeConfig(c.block_n, c.block_k, c.split_k, c.num_warps, stages), element_size
            )
            > budget
        ):
            stages -= 1
        out.append(DecodeConfig(c.block_n, c.block_k, c.split_k, c.num_warps, stages))
    return out


_TUNED: dict[tuple, DecodeConfig] = {}  # GPU: (N, K, dtype, w layout, precision) -> fastest config


def norm_matmul_config(x, residual, norm_weight, w, c, policy: DotPolicy) -> DecodeConfig:
    """Fixed under the interpreter; on a GPU the fastest candidate, timed once per (N, K, dtype,
    w layout, precision): the key leaves out M, so a row's result does not depend on the batch."""
    if INTERPRETER or c.device.type != "cuda":
        return INTERPRETER_CONFIG
    n, k = c.shape[1], x.shape[1]
    key = (n, k, x.dtype, w.stride(1) == 1, policy.input_precision)
    cfg = _TUNED.get(key)
    if cfg is None:
        fma = torch.cuda.get_device_capability(c.device)[0] < 8
        found = candidates(n, k, x.element_size(), num_sms(c.device), smem_budget(c.device), fma)
        scratch = torch.empty_like(x)  # the residual output of the timing runs

        def run(cand):
            _launch(x, residual, scratch, norm_weight, w, c, 1e-5, cand, policy)

        times = [
            triton.testing.do_bench(lambda cand=cand: run(cand), warmup=5, rep=25) for cand in found
        ]
        cfg = _TUNED[key] = found[times.index(min(times))]
    return cfg
