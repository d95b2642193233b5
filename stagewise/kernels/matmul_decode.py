"""Split-K GEMM for decode shapes (M <= 16 rows): `c = a @ b` when the weights are the whole cost.

    a [M, K] @ b [K, N] -> c [M, N]        M = running sequences (1..16), K x N = a weight matrix

In decode every weight element is used by only M rows: the GEMM is a
matrix-vector product, timed by how fast K x N weights stream from memory,
which needs many loads in flight on every SM. One program per [16, BLOCK_N]
tile of c (kernels/matmul.py) gives too few programs (N = 4096: 64 on 132
SMs). Split-K cuts K into SPLIT_K ranges, one program per (tile of N, range):

    partial[s] = a[:, K_s] @ b[K_s, :]        c = partial[0] + ... + partial[SPLIT_K - 1]

in fp32, into a small buffer [SPLIT_K, M, N]. The sum needs no second kernel:
each program stores its partial, then adds 1 to its tile's arrival counter
(an atomic); the program that sees SPLIT_K - 1 arrived before it is the last
of its tile, and it reads the SPLIT_K partials back and adds them in the fixed
order 0, 1, ..., whichever split finished first, so the same inputs always give
the same bits, then sets the counter back to 0 for the next launch (and for
every replay of a CUDA graph). The config depends on (N, K, dtype, layout), never on M, and rows do
not see each other: a sequence's logits are the same bits alone or batched.
With enough tiles of N, SPLIT_K = 1 and the program stores c itself.

The tile: `tl.dot` needs 16 rows, so M <= 16 rows are padded to one BLOCK_M =
16 tile (masked loads read zeros; free in a memory-bound kernel). The
interpreter uses one fixed config; a GPU times a few candidates once per shape
class (`decode_config`; the tuner's story: benchmarks/README.md, "Kernel
notes"). Dots follow precision.py, bf16 stores are rounded by hand in the
interpreter.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import KernelInputError, check_contiguous, check_shape
from stagewise.kernels.plan_cache import plan_cache
from stagewise.kernels.precision import DotPolicy, dot_policy, round_to_bf16
from stagewise.kernels.split_k import num_sms

DECODE_MAX_M = 16  # M up to this is a "decode" shape (kernels/matmul.py sends it here)
BLOCK_M = DECODE_MAX_M  # one tile-row of 16 covers every decode batch; tl.dot's minimum
MAX_SPLIT_K = 16  # bounds the partial buffer [SPLIT_K, M, N] and the reduce's work
SMEM_BUDGET = (
    96 * 1024
)  # bytes of shared memory per program when the GPU's limit is unknown: fits sm_89 (99 KB)
SMEM_HEADROOM = 8 * 1024  # kept free under the GPU's opt-in limit
PROGRAMS_PER_SM = (2, 4)  # GPU candidates aim at these many programs per SM
REDUCE_BLOCK = 1024  # output elements per program of the reduce kernel


@triton.jit
def _decode_kernel(
    a_ptr,  # [M_in, K] input rows, any strides
    b_ptr,  # [K, N] weights, any strides (row-major, or a transposed view)
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or c [M, N] itself when there is one split
    c_ptr,  # [M, N] output (read only when FUSED_SUM: the last split of a tile writes it)
    counter_ptr,  # [tiles of N] int32 arrivals per tile, 0 between launches (when FUSED_SUM)
    # [M] int rows of a to use when GATHER (c[i] = a[row_index[i]] @ b); unused otherwise
    row_index_ptr,
    M,  # rows of c (<= BLOCK_M)
    N,  # columns of b and c
    K,  # reduction length
    K_PER_SPLIT,  # depth of K each split walks: a multiple of BLOCK_K (the last split may get less)
    stride_am,  # elements between rows of a
    stride_ak,  # elements between columns of a
    stride_bk,  # elements between rows of b
    stride_bn,  # elements between columns of b
    stride_os,  # elements between the partials of consecutive splits (0 when out is c)
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    stride_cm,  # elements between rows of c (when FUSED_SUM)
    stride_cn,  # elements between columns of c (when FUSED_SUM)
    GATHER: tl.constexpr,  # True: read the rows of a through row_index_ptr
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 stores rounded by hand
    # convert tiles to fp32 after the load (fp32 inputs; bf16 in the interpreter)
    FP32_DOTS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 tiles: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSED_SUM: tl.constexpr,  # split: the tile's last split sums the partials into c
):
    tile_n = tl.program_id(0)  # which BLOCK_N columns of c
    split = tl.program_id(1)  # which range of K
    k_start = split * K_PER_SPLIT
    k_stop = tl.minimum(K, k_start + K_PER_SPLIT)

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] all rows of c (M <= BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of c
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N
    if GATHER:
        rows_a = tl.load(row_index_ptr + offs_m, mask=mask_m, other=0).to(
            tl.int64
        )  # [BLOCK_M] rows of a
    else:
        rows_a = offs_m.to(tl.int64)
    cols_b = offs_n.to(tl.int64)  # int64: col * stride may pass 2**31 for a transposed LM head
    ks = k_start.to(tl.int64) + offs_k  # [BLOCK_K] positions along K of the first step

    a_ptrs = a_ptr + rows_a[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols_b[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # fp32 partial of this K range
    for k in range(k_start, k_stop, BLOCK_K):
        k_left = k_stop - k  # valid depth in this step (the last step of K may be partial)
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(
            a, b, acc, input_precision=INPUT_PRECISION
        )  # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)
    tile_mask = mask_m[:, None] & mask_n[None, :]
    out_tile = offs_m[:, None] * stride_om + cols_b[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    tl.store(out_ptr + split.to(tl.int64) * stride_os + out_tile, acc.to(out_ptr.dtype.element_ty),
             mask=tile_mask)  # fmt: skip
    if FUSED_SUM:
        num_splits = tl.num_programs(1)
        tl.debug_barrier()  # every thread's share of the partial is stored before we count it
        # acq_rel: our partial is visible before the count; the last one sees everyone's after it
        arrived = tl.atomic_add(counter_ptr + tile_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last split of this tile: sum the partials in order
            total = tl.load(out_ptr + out_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, num_splits):  # .cg: from L2, where the other SMs' stores landed
                total += tl.load(out_ptr + s * stride_os + out_tile, mask=tile_mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            if INTERPRETED and c_ptr.dtype.element_ty == tl.bfloat16:
                total = round_to_bf16(total)
            c_tile = offs_m[:, None] * stride_cm + cols_b[None, :] * stride_cn
            tl.store(c_ptr + c_tile, total.to(c_ptr.dtype.element_ty), mask=tile_mask)
            tl.atomic_xchg(counter_ptr + tile_n, 0)  # ready for the next launch


@triton.jit
def _split_k_sum_kernel(
    partials_ptr,  # [SPLIT_K, M, N] fp32 partial products, contiguous
    c_ptr,  # [M, N] output, contiguous
    NUMEL,  # M * N
    SPLIT_K: tl.constexpr,  # partials to add, always in the order 0, 1, ..., SPLIT_K - 1
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 rounded by hand
    BLOCK: tl.constexpr,  # output elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(
        0, BLOCK
    )  # [BLOCK] flat positions in c
    mask = offs < NUMEL
    total = tl.load(partials_ptr + offs, mask=mask, other=0.0)  # [BLOCK] partial 0
    for s in range(
        1, SPLIT_K
    ):  # fixed order: the same bits every run, whichever split finished first
        total += tl.load(partials_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    if INTERPRETED and c_ptr.dtype.element_ty == tl.bfloat16:
        total = round_to_bf16(total)
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


def matmul_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    policy: DotPolicy | None = None,
    config: "DecodeConfig | None" = None,
    fused_sum: bool = True,
) -> torch.Tensor:
    """c = a @ b (or a[row_index] @ b) for M <= 16 rows, written into c [M, N] (contiguous); returns
    c.

    a and b are checked by `kernels.matmul.matmul`, which calls this for decode shapes: a [M_in, K]
    and b [K, N] of one float dtype, any strides. policy: the dot precision (default:
    `dot_policy(a.dtype)`, what matmul passes). config: a fixed config (default: `decode_config`).
    fused_sum: the last split of each tile sums the partials (one kernel); False: a second kernel
    sums them (`split_k_sum`). Both add in the same order: the same bits.
    """
    m = c.shape[0]
    if m > BLOCK_M:
        raise KernelInputError(
            f"matmul_decode: {m} rows; the decode kernel takes at most {BLOCK_M}"
        )
    if (
        not c.is_contiguous() or c.dim() != 2 or c.shape[1] != b.shape[1]
    ):  # cheap test first: this runs per call
        check_contiguous("matmul_decode", "c", c)
        check_shape("matmul_decode", "c", c, (None, b.shape[1]))
    if m == 0 or c.shape[1] == 0:
        return c
    if a.shape[1] == 0:
        return c.zero_()
    policy = policy or dot_policy(a.dtype)
    cfg = config or decode_config(a, b, c, row_index, policy)
    _launch(a, b, c, row_index, cfg, policy, fused_sum)
    return c


def split_k_sum(partials: torch.Tensor, c: torch.Tensor) -> None:
    """c = partials[0] + partials[1] + ... in fp32, in that order, cast to c's dtype; c written in
    place.

    partials [SPLIT_K, M, N] fp32 contiguous, c [M, N] contiguous.
    """
    check_contiguous("matmul_decode", "partials", partials)
    check_contiguous("matmul_decode", "c", c)
    if partials.dtype != torch.float32 or partials.dim() != 3:
        raise KernelInputError(
            f"matmul_decode: partials must be 3-D float32, got {partials.dtype} {partials.shape}"
        )
    check_shape("matmul_decode", "c", c, tuple(partials.shape[1:]))
    _sum_partials(partials, c)


def _sum_partials(partials: torch.Tensor, c: torch.Tensor) -> None:
    """split_k_sum without the checks, for launchers that made both tensors (decode, dequant)."""
    numel = c.numel()
    _split_k_sum_kernel[(_cdiv(numel, REDUCE_BLOCK),)](
        partials_ptr=partials,
        c_ptr=c,
        NUMEL=numel,
        SPLIT_K=partials.shape[0],
        INTERPRETED=INTERPRETER,
        BLOCK=REDUCE_BLOCK,
    )


def _launch(a, b, c, row_index, cfg: "DecodeConfig", policy: DotPolicy, fused_sum=True) -> None:
    """One decode GEMM with a given config: the split kernel, and (if split) the ordered sum, fused
    into it or (fused_sum False, or no counters to be had) a second kernel."""
    m, n, k = c.shape[0], c.shape[1], a.shape[1]
    grid, k_per_split, options = decode_launch(n, k, cfg, policy)
    splits = grid[1]
    out, stride_os, counters = split_outputs(c, splits, grid[0], fused_sum)
    _decode_kernel[grid](
        a_ptr=a,
        b_ptr=b,
        out_ptr=out,
        c_ptr=c,
        counter_ptr=c if counters is None else counters,  # unread without FUSED_SUM
        row_index_ptr=a if row_index is None else row_index,
        M=m,
        N=n,
        K=k,
        K_PER_SPLIT=k_per_split,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_bk=b.stride(0),
        stride_bn=b.stride(1),
        stride_os=stride_os,
        stride_om=out.stride(-2),
        stride_on=out.stride(-1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        GATHER=row_index is not None,
        FUSED_SUM=counters is not None,
        **options,
    )
    if splits > 1 and counters is None:
        _sum_partials(out, c)


@plan_cache
def decode_launch(n: int, k: int, cfg: "DecodeConfig", policy: DotPolicy) -> tuple:
    """(grid, K_PER_SPLIT, launch kwargs) of one decode GEMM, kept per (N, K, config, precision).

    The grid is (tiles of N, splits): N = 960, K = 576 with the interpreter's 256-wide, 64-deep
    tiles and split 2 is (cdiv(960, 256), 2) = (4, 2), each split walking 5 x 64 = 320 of K.
    """
    k_per_split, splits = split_plan(k, cfg.block_k, cfg.split_k)
    options = dict(
        INTERPRETED=INTERPRETER,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,
        BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return (_cdiv(n, cfg.block_n), splits), k_per_split, options


def split_outputs(
    c: torch.Tensor, splits: int, tiles: int, fused_sum: bool = True
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """Where a split-K launch writes, for c [M, N]: (out, its split stride, counters).

    One split: c itself. More: fp32 partials [SPLIT_K, M, N] and the fused sum's arrival counters
    for `tiles` tiles of N, or None (fused_sum False, or a CUDA-graph capture that would have to
    grow them): then the caller sums the partials with the second kernel (`split_k_sum`).
    """
    if splits == 1:
        return c, 0, None
    m, n = c.shape
    out = torch.empty((splits, m, n), device=c.device, dtype=torch.float32)  # [SPLIT_K, M, N]
    return out, out.stride(0), arrival_counters(c.device, tiles) if fused_sum else None


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # per device: int32 zeros, one per tile of N


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The fused sum's per-tile arrival counters on `device` (>= `tiles` int32, all 0).

    Kept across launches: every launch leaves its counters at 0 again, so launches one after
    another on a stream share them. (Two split GEMMs running at once on two streams of one device
    would not: this project launches its GEMMs on one stream per device.) None while a CUDA graph
    is being captured and the buffer is too small: a tensor allocated inside a capture belongs to
    the graph's memory pool, so that launch sums with the second kernel instead.
    """
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        size = max(tiles, 2 * counters.numel() if counters is not None else 1024)
        counters = _COUNTERS[device] = torch.zeros(size, dtype=torch.int32, device=device)
    return counters


def _time_ms(a, b, c, row_index, cfg: "DecodeConfig", policy: DotPolicy) -> float:
    """GPU milliseconds of one decode GEMM with cfg, reduce included (do_bench flushes L2 between
    runs)."""
    return triton.testing.do_bench(
        lambda: _launch(a, b, c, row_index, cfg, policy), warmup=5, rep=25
    )


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # columns of b (and of c) per program; power of two >= 16
    block_k: int  # depth of one step along K; power of two >= 16
    split_k: int  # K ranges (programs per tile of N); 1 = no split, the program stores c itself
    num_warps: int = 4  # GPU only: warps per program
    num_stages: int = (
        3  # GPU only: software-pipelining depth (num_stages - 1 tiles of b loading ahead)
    )

    def __post_init__(self) -> None:
        blocks = (self.block_n, self.block_k)
        if any(b < 16 or b & (b - 1) for b in blocks) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise KernelInputError(
                f"matmul_decode: blocks {blocks} must be powers of two >= 16 (tl.dot), "
                f"split_k {self.split_k} in [1, {MAX_SPLIT_K}]"
            )


def _cdiv(x: int, y: int) -> int:
    """Ceil division on the host (triton.cdiv is a constexpr_function in triton 3.9: ~100x slower to
    call)."""
    return -(-x // y)


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(k_per_split, num_splits): each split walks k_per_split (a multiple of block_k) of K, the
    last one less.

    Asking for split_k ranges can give fewer: K = 4096 in 128-deep steps is 32 steps; 9 ranges of 4
    steps would leave the 9th empty, so it becomes 8 ranges of 4 steps. No split is ever empty.
    """
    steps = _cdiv(k, block_k)
    k_per_split = _cdiv(steps, min(split_k, steps)) * block_k
    return k_per_split, _cdiv(k, k_per_split)


# Under the interpreter: 256-wide tiles (few programs, each ~1 ms) and a split of 2 where K has 2
# steps.
INTERPRETER_CONFIG = DecodeConfig(block_n=256, block_k=64, split_k=2)


# On a GPU: (block_n, block_k, num_warps, num_stages) tiles; each gets SPLIT_K for every
# PROGRAMS_PER_SM.
# at most this many stages; bf16 shared memory (see shared_memory_bytes): 80, 108, 72, 50 KB
GPU_TILES = [
    (64, 128, 4, 5),
    (128, 128, 4, 4),  # 3 stages (72 KB) on sm_89
    (32, 256, 4, 4),
    (64, 64, 2, 6),  # small: many programs resident per SM
]


# Before sm_80 (T4) dots run on FMA units, which keep each thread's operand rows in registers: the
# tiles above spill there (compile gate), short K steps do not.
FMA_TILES = [(128, 32, 4, 4), (64, 32, 4, 4)]


def shared_memory_bytes(cfg: DecodeConfig, element_size: int) -> int:
    """(num_stages - 1) buffers (at least 1) of a b tile [BLOCK_K, BLOCK_N] and an a tile [BLOCK_M,
    BLOCK_K]."""
    buffers = max(1, cfg.num_stages - 1)
    return buffers * (cfg.block_k * cfg.block_n + BLOCK_M * cfg.block_k) * element_size


def smem_budget(device: torch.device) -> int:
    """Shared memory one program may use on this GPU, bytes: its opt-in limit less SMEM_HEADROOM."""

    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return optin - SMEM_HEADROOM if optin else SMEM_BUDGET


def gpu_candidates(
    n: int, k: int, element_size: int, sms: int, budget: int = SMEM_BUDGET, fma: bool = False
) -> list[DecodeConfig]:
    """The configs the GPU tuner times for one shape: each tile, split for ~2 and ~4 programs per
    SM.

    Stages are cut until the estimate fits `budget` bytes (fp32 inputs get about half). A split
    never exceeds MAX_SPLIT_K or the number of BLOCK_K steps, and shapes with enough tiles of N get
    1.
    """
    found: dict[tuple, DecodeConfig] = {}
    for block_n, block_k, warps, stages in FMA_TILES if fma else GPU_TILES:
        per_stage = shared_memory_bytes(DecodeConfig(block_n, block_k, 1, warps, 1), element_size)
        stages = max(1, min(stages, 1 + budget // per_stage))
        tiles_n = _cdiv(n, block_n)
        for per_sm in PROGRAMS_PER_SM:
            wanted = min(MAX_SPLIT_K, max(1, _cdiv(per_sm * sms, tiles_n)))
            _, splits = split_plan(k, block_k, wanted)
            cfg = DecodeConfig(block_n, block_k, splits, warps, stages)
            found[(block_n, block_k, splits, warps, stages)] = cfg
    return list(found.values())


_TUNED: dict[tuple, DecodeConfig] = {}  # GPU: (N, K, dtype, b layout, precision) -> fastest config


def decode_config(a, b, c, row_index, policy: DotPolicy) -> DecodeConfig:
    """The config for this shape: fixed under the interpreter; timed once per shape class on a GPU.

    The key leaves out M on purpose: every decode batch size uses the same split and tile, so a
    row's result does not depend on how many other rows share the step.
    """
    if INTERPRETER or c.device.type != "cuda":
        return INTERPRETER_CONFIG
    n, k = c.shape[1], a.shape[1]
    key = (n, k, a.dtype, b.stride(1) == 1, policy.input_precision, row_index is not None)
    cfg = _TUNED.get(key)
    if cfg is None:
        fma = (
            torch.cuda.get_device_capability(c.device)[0] < 8
        )  # pre-Ampere: no tensor cores for these dots
        candidates = gpu_candidates(
            n, k, a.element_size(), num_sms(c.device), smem_budget(c.device), fma
        )
        times = [_time_ms(a, b, c, row_index, cand, policy) for cand in candidates]
        cfg = _TUNED[key] = candidates[times.index(min(times))]
    return cfg


def tuned_configs() -> dict[tuple, DecodeConfig]:
    """What the GPU tuner chose so far: (N, K, dtype, b row-major, precision, gather) -> config."""
    return dict(_TUNED)
