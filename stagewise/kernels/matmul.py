"""Tiled GEMM `c = a @ b` in Triton, with an optional row gather (the LM head).

    a [M, K] @ b [K, N] -> c [M, N]          fp32 accumulation, c in a's dtype
    a[row_index] @ b    -> c [len(row_index), N]   rows read through an index, no gather copy

Tiling. Each program owns one [BLOCK_M, BLOCK_N] tile of c and walks K in
BLOCK_K steps: a [BLOCK_M, BLOCK_K] tile of a and a [BLOCK_K, BLOCK_N] tile of
b into `tl.dot` (tensor cores on a GPU), an fp32 accumulator, one store at the
end. Every load is masked, so M, N, K need not be multiples of the blocks; a
and b may have any strides (a column slice; the LM head's `weight.t()`).

Grouped ordering. Program ids walk down GROUP_M tile-rows before moving one
tile-column right, so tiles running together share a few rows of a and
columns of b, re-read from L2 instead of fetched again from DRAM.

Decode vs prefill. With M <= DECODE_MAX_M rows (decode) each weight is used by
M rows only: the GEMM is memory bound, and `matmul` hands it to the split-K
kernel of kernels/matmul_decode.py. Prefill reuses each weight M times: compute
bound, large square-ish tiles. The interpreter (no driver, no autotune) uses
one config per shape class (`gemm_config`); a GPU autotunes prefill tiles.
That choice by M changes a row's bits (another kernel, another sum order), so
with `batch_invariant=True` every M goes to the split-K kernel and these tiles
are not used (why that kernel: kernels/matmul_decode.py).

Precision (precision.py): 16-bit tiles take tensor-core dots with fp32
accumulation, fp32 tiles TF32 exactly when torch.matmul may; in the interpreter
bf16 tiles are upcast before the dot and bf16 stores rounded by hand.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_dim,
    check_dtype,
    check_same_device,
)
from stagewise.kernels.matmul_decode import DECODE_MAX_M, matmul_decode
from stagewise.kernels.plan_cache import cdiv, launch_tuned, next_power_of_2, plan_cache
from stagewise.kernels.precision import dot_policy, round_to_bf16
from stagewise.kernels.targets import (
    INTERPRETER_TARGET,
    LaunchPlan,
    Target,
    checked_target,
    fma_dots,
    launch_target,
)
from stagewise.runtime import debug_checks

INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _matmul_kernel(
    a_ptr,  # [M_in, K] input rows, any strides
    b_ptr,  # [K, N] right-hand matrix, any strides (weights, or a transposed view)
    c_ptr,  # [M, N] output
    # [M] int rows of a to use when GATHER (c[i] = a[row_index[i]] @ b); unused otherwise
    row_index_ptr,
    M,  # rows of c (= len(row_index) when GATHER)
    N,  # columns of b and c
    K,  # reduction length
    M_BUCKET,  # next power of two >= M: only part of the GPU autotuner's cache key, unused here
    stride_am,  # elements between rows of a
    stride_ak,  # elements between columns of a
    stride_bk,  # elements between rows of b
    stride_bn,  # elements between columns of b
    stride_cm,  # elements between rows of c
    stride_cn,  # elements between columns of c
    GATHER: tl.constexpr,  # True: read the rows of a through row_index_ptr
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 stores rounded by hand
    # convert tiles to fp32 after the load (fp32 inputs; bf16 in the interpreter)
    FP32_DOTS: tl.constexpr,
    # tl.dot input precision of fp32 tiles: "ieee" or "tf32" (precision.py)
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Ceil divisions and tl.full are written out rather than calling tl.cdiv / tl.zeros: those are
    # @jit helpers, and under the interpreter every helper call re-patches triton.language (~0.5 ms
    # a call). Grouped ordering: consecutive pids walk down GROUP_M tile-rows, then move one
    # tile-column right.
    pid = tl.program_id(0)
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M  # tile-rows of c
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N  # tile-columns of c
    pids_per_group = GROUP_M * tiles_n
    first_tile_m = (pid // pids_per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_tile_m, GROUP_M)  # the last group may be short
    tile_m = first_tile_m + (pid % pids_per_group) % rows_in_group
    tile_n = (pid % pids_per_group) // rows_in_group

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of c
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of c
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N

    if GATHER:
        # [BLOCK_M] rows of a
        rows_a = tl.load(row_index_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows_a = offs_m.to(tl.int64)  # int64: row * stride may pass 2**31 on large inputs
    cols_b = offs_n.to(tl.int64)

    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # fp32 accumulator
    for k_step in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - k_step * BLOCK_K  # valid depth in this step (the last one may be partial)
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if INTERPRETED and c_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + cols_b[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: "GemmConfig | None" = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """c = a @ b, or a[row_index] @ b; fp32 accumulation; returns a new contiguous [M, N] tensor.

    a [M_in, K] and b [K, N] may be strided views (a column slice, a transposed weight).
    row_index [M] (int32/int64): output row i is a[row_index[i]] @ b, read in place. Never read on
    the host (that would wait for the GPU: a host-bound step, no CUDA graphs); its range is checked
    only with debug checks on (`stagewise.runtime.debug_checks`).
    out_dtype: the output dtype (default: a's). config: a fixed tile config (default: per shape
    class under the interpreter, autotuned per shape class on a GPU).
    batch_invariant: one configuration for every M (the split-K kernel of matmul_decode.py), so a
    row's bits do not depend on the other rows; False: decode and prefill shapes each take their
    fastest kernel, and a row's bits change where M crosses 16.
    """
    _check_inputs(a, b, row_index, out_dtype)
    m = a.shape[0] if row_index is None else row_index.shape[0]
    k, n = b.shape
    c = torch.empty((m, n), device=a.device, dtype=out_dtype or a.dtype)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    policy = dot_policy(a.dtype)
    # the pre-Ampere policy (targets.py), for the decode path too
    target = checked_target("matmul", a)
    if config is None and (batch_invariant or m <= DECODE_MAX_M):
        # decode, or every M batch-invariant: split-K over the weights (kernels/matmul_decode.py)
        return matmul_decode(a, b, c, row_index=row_index, policy=policy)
    args = dict(
        a_ptr=a,
        b_ptr=b,
        c_ptr=c,
        row_index_ptr=a if row_index is None else row_index,
        M=m,
        N=n,
        K=k,
        M_BUCKET=next_power_of_2(m),
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        GATHER=row_index is not None,
        INTERPRETED=INTERPRETER,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,  # fp32: TF32 exactly when torch.matmul may use it
    )
    if INTERPRETER or config is not None:
        grid, tiles = fixed_launch(m, n, a.dtype, target, config)
        _matmul_kernel[grid](**args, **tiles)
        return c
    # prefill (a decode shape without a fixed config went above): the autotuner picks the tiles
    # the first time a key is seen, later launches pass its choice straight to the kernel. The
    # key holds what the autotuner's does: M_BUCKET, N, K, the precision, every tensor's dtype.
    index_dtype = None if row_index is None else row_index.dtype
    key = ("matmul", args["M_BUCKET"], n, k, policy, a.dtype, c.dtype, index_dtype, a.device)
    grid = lambda meta: (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)
    launch_tuned(tuned_kernel(), _matmul_kernel, key, grid, args)
    return c


@plan_cache
def fixed_launch(
    m: int, n: int, dtype: torch.dtype, target: Target, config: "GemmConfig | None"
) -> tuple[tuple, dict]:
    """(grid, launch kwargs) of a one-config GEMM (the interpreter's, or a given config), kept per
    key: one program per [BLOCK_M, BLOCK_N] tile of c, cdiv(m, BLOCK_M) * cdiv(n, BLOCK_N) of
    them (m = 37, n = 960, 64 x 128 tiles: 1 x 8 = 8 programs)."""
    tiles = gemm_plan(m, dtype, target, config).launch_options()
    return (cdiv(m, tiles["BLOCK_M"]) * cdiv(n, tiles["BLOCK_N"]),), tiles


def _check_inputs(
    a: torch.Tensor, b: torch.Tensor, row_index: torch.Tensor | None, out_dtype
) -> None:
    check_dim("matmul", "a", a, 2)
    check_dim("matmul", "b", b, 2)
    check_dtype("matmul", "a", a, FLOAT_DTYPES)
    check_dtype("matmul", "b", b, FLOAT_DTYPES)
    if a.dtype != b.dtype:
        raise KernelInputError(f"matmul: a is {a.dtype} but b is {b.dtype}; cast one so they match")
    if a.shape[1] != b.shape[0]:
        raise KernelInputError(
            f"matmul: inner dimensions differ: a {list(a.shape)} @ b {list(b.shape)}"
        )
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise KernelInputError(
            f"matmul: out_dtype {out_dtype} is not one of float32, bfloat16, float16"
        )
    if row_index is None:
        check_same_device("matmul", a=a, b=b)
        return
    check_same_device("matmul", a=a, b=b, row_index=row_index)
    check_dim("matmul", "row_index", row_index, 1)
    check_dtype("matmul", "row_index", row_index, INDEX_DTYPES)
    # a value check reads row_index on the host: a sync, on request only
    if debug_checks() and row_index.numel():
        lo, hi = torch.stack(list(torch.aminmax(row_index))).tolist()
        if lo < 0 or hi >= a.shape[0]:
            raise KernelInputError(
                f"matmul: row_index spans [{lo}, {hi}] but a has {a.shape[0]} rows"
            )


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # rows of a (and of c) per tile; >= 16 for tl.dot
    block_n: int  # columns of b (and of c) per tile; >= 16
    block_k: int  # depth of one step along the reduction dimension; >= 16
    group_m: int  # tile-rows per group in the grouped program ordering
    num_warps: int = 4  # GPU only: warps per program
    num_stages: int = 3  # GPU only: software-pipelining depth of the K loop

    def __post_init__(self) -> None:
        blocks = (self.block_m, self.block_n, self.block_k)
        if any(b < 16 or b & (b - 1) for b in blocks) or self.group_m < 1:
            raise KernelInputError(
                f"matmul: blocks {blocks} must be powers of two >= 16 (tl.dot), group_m >= 1"
            )

    def triton_config(self) -> "triton.Config":
        meta = {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
        }
        return triton.Config(meta, num_warps=self.num_warps, num_stages=self.num_stages)

    def shared_memory(self, dtype: torch.dtype) -> int:
        """Bytes of shared memory: the pipeline keeps num_stages - 1 (a, b) tile pairs in flight."""
        tiles = self.block_m * self.block_k + self.block_k * self.block_n
        return max(self.num_stages - 1, 1) * tiles * dtype.itemsize


def _fits(config: GemmConfig, dtype: torch.dtype, target: Target) -> bool:
    """Whether a config is meant for this target and fits its shared memory.

    FMA dots (fp32 IEEE, and every dot before sm_80) hold whole operand rows per thread and spill on
    the tensor-core tiles: they get their own, smaller list. The largest tiles are for sm_90 only.
    Registers are the compile gate's to check.
    """
    if target.interpreter:
        return True
    if (config in _FMA_CONFIGS) != fma_dots(dtype, target):
        return False
    if config in _HOPPER_CONFIGS and target.capability != 90:
        return False
    return config.shared_memory(dtype) <= target.shared_memory


def gemm_configs(m: int, dtype: torch.dtype, target: Target) -> list[GemmConfig]:
    """The configs the GPU autotuner tries for this shape class on this target (those that fit)."""

    configs = _DECODE_CONFIGS if m <= DECODE_MAX_M else _PREFILL_CONFIGS
    return [c for c in configs if _fits(c, dtype, target)]


def gemm_config(
    m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, target: Target = INTERPRETER_TARGET
):
    """One fixed config per shape class: decode (m <= 16, memory bound) or prefill (compute bound).

    The interpreter always uses it; on a GPU the launcher autotunes instead, unless a config is
    passed (a benchmark can pass `gemm_config(m, n, k, dtype, launch_target(device))`, the first
    tuned candidate that fits that GPU, to compare a fixed choice with the tuned one).
    """
    if target.interpreter:
        if m <= DECODE_MAX_M:
            return GemmConfig(
                block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4
            )
        return GemmConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)
    return gemm_configs(m, dtype, target)[0]


def gemm_plan(
    m: int, dtype: torch.dtype, target: Target, config: GemmConfig | None = None
) -> LaunchPlan:
    """The launch's tile configs: a fixed one (interpreter, or `config`), else the autotuner's
    candidates."""
    if config is not None or target.interpreter:
        configs = [config or gemm_config(m, 0, 0, dtype, target)]
    else:
        configs = gemm_configs(m, dtype, target)
    return LaunchPlan("matmul", {}, tuple(c.triton_config() for c in configs))


# GPU tiles per shape class, by preference: gemm_config takes the first that fits a target, and the
# prefill autotuner tries those that fit (decode shapes autotune in matmul_decode.py; these decode
# tiles serve a fixed config passed in). Each config's shared memory is (num_stages - 1) *
# (BM*BK + BK*BN) * bytes; the compile gate checks that estimate and the register use.

_DECODE_CONFIGS = [
    GemmConfig(16, 128, 128, 1, num_warps=4, num_stages=4),  # bf16: 108 KB: sm_80, sm_90
    GemmConfig(16, 64, 128, 1, num_warps=4, num_stages=4),  # bf16: 60 KB: every target from sm_80
    GemmConfig(
        16, 32, 256, 1, num_warps=4, num_stages=3
    ),  # narrow N tiles: more programs for small N
    GemmConfig(16, 64, 64, 1, num_warps=4, num_stages=4),
    # FMA dots (fp32, sm_75): short K steps, so each thread's operand rows stay in registers
    GemmConfig(16, 128, 32, 1, num_warps=4, num_stages=4),
    GemmConfig(16, 64, 32, 1, num_warps=4, num_stages=4),
]


_PREFILL_CONFIGS = [
    GemmConfig(128, 128, 64, 8, num_warps=8, num_stages=3),
    GemmConfig(128, 256, 64, 8, num_warps=8, num_stages=3),
    GemmConfig(128, 64, 64, 8, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 64, 8, num_warps=4, num_stages=4),
    GemmConfig(64, 64, 32, 8, num_warps=4, num_stages=4),
    # FMA dots (fp32, sm_75)
    GemmConfig(64, 32, 32, 8, num_warps=4, num_stages=3),
    GemmConfig(32, 64, 32, 8, num_warps=4, num_stages=3),
    GemmConfig(128, 64, 16, 8, num_warps=8, num_stages=3),
    GemmConfig(64, 64, 16, 8, num_warps=8, num_stages=3),
]
_FMA_CONFIGS = _DECODE_CONFIGS[-2:] + _PREFILL_CONFIGS[-4:]

# sm_90 only: wgmma reads both tiles from shared memory and H100/H200 have 227 KB of it, so deeper
# pipelines of large tiles fit (144 KB and 96 KB of bf16 by the estimate above); on sm_80/89 their
# operands would sit in registers.
_HOPPER_CONFIGS = [
    GemmConfig(128, 256, 64, 8, num_warps=8, num_stages=4),
    GemmConfig(256, 128, 64, 8, num_warps=8, num_stages=3),
]
_PREFILL_CONFIGS += _HOPPER_CONFIGS


def _prune(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune: drop the configs that do not fit this device (they would fail or
    spill)."""
    a = {**named_args, **kwargs}["a_ptr"]
    target = launch_target(a.device)
    keep = [c for c in configs if _fits(_from_triton(c), a.dtype, target)]
    return keep or configs[-1:]


def _from_triton(c: "triton.Config") -> GemmConfig:
    meta = c.kwargs
    return GemmConfig(
        meta["BLOCK_M"],
        meta["BLOCK_N"],
        meta["BLOCK_K"],
        meta["GROUP_M"],
        c.num_warps,
        c.num_stages,
    )


@functools.cache
def tuned_kernel():
    """The prefill GEMM under `triton.autotune`, built on first use (autotuning needs a GPU driver).

    Keyed on M_BUCKET, not M, so prefill steps of every length in a bucket reuse one tuning result;
    and on the dot precision (Triton adds the dtypes itself), so a TF32 tuning is never reused for
    IEEE fp32. The prune drops the configs that do not fit the device (`_fits`).
    """
    return triton.autotune(
        [c.triton_config() for c in _PREFILL_CONFIGS],
        key=["M_BUCKET", "N", "K", "FP32_DOTS", "INPUT_PRECISION"],
        prune_configs_by={"early_config_prune": _prune},
    )(_matmul_kernel)
