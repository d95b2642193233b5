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

Every M, batch-invariant (`matmul(..., batch_invariant=True)`, what the
stages run by default). A row's bits must not depend on how many rows share
the call, so one configuration serves every M: this kernel, its config keyed
on (N, K, dtype, layout), tiles of 16 rows. Each output element is the same
chain whatever M: per split, the K steps folded into an fp32 accumulator from
0 in BLOCK_K steps (one tensor-core instruction shape, the 16-row tile's);
then the splits added in the order 0, 1, ... With one tile-row (M <= 16) the
splits run in parallel programs and the last one adds the stored partials;
with more, each program walks the splits of its own tile and adds them in
registers (`SERIAL`: the grid is large enough, and no [SPLIT_K, M, N] buffer
is written). Which of the two runs changes where the partials wait, not one
addition, so the bits are the same (tests/kernels/test_gemm_invariance.py
sweeps M = 1..64 across the boundary).

Why this kernel for every M and not the prefill tiles (kernels/matmul.py)
for every M: decode, memory bound, is what a stream waits on at every token,
and without splitting K it gets N / BLOCK_N programs, a fraction of the SMs
(N = 4096: 32 on 132). Prefill runs once per prompt: it pays for 16-row tiles
(each weight tile read from L2 once per 16 rows instead of once per 64-128).
And why not two kernels sharing the split and BLOCK_K: a 16-row tile and a
64-row one use different tensor-core instructions on sm_90 (mma.sync, wgmma),
and nothing promises they round a row's sum alike. The cost of both choices is
the GPU device check's batch-invariance row (devtools/gpu/invariance.py).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import KernelInputError, check_contiguous, check_shape
from stagewise.kernels.plan_cache import cdiv, plan_cache
from stagewise.kernels.precision import DotPolicy, dot_policy, round_to_bf16
from stagewise.kernels.split_k import num_sms

DECODE_MAX_M = 16  # M up to this is a "decode" shape (kernels/matmul.py sends it here)
BLOCK_M = DECODE_MAX_M  # one tile-row of 16 covers every decode batch; tl.dot's minimum
MAX_SPLIT_K = 16  # bounds the partial buffer [SPLIT_K, M, N] and the reduce's work
# bytes of shared memory per program when the GPU's limit is unknown: fits sm_89 (99 KB)
SMEM_BUDGET = 96 * 1024
SMEM_HEADROOM = 8 * 1024  # kept free under the GPU's opt-in limit
PROGRAMS_PER_SM = (2, 4)  # GPU candidates aim at these many programs per SM
REDUCE_BLOCK = 1024  # output elements per program of the reduce kernel


@triton.jit
def _range_product(
    a_ptrs,  # [BLOCK_M, BLOCK_K] pointers: the tile's rows of a at k_start
    b_ptrs,  # [BLOCK_K, BLOCK_N] pointers: the tile's columns of b at k_start
    mask_m,  # [BLOCK_M] rows that exist
    mask_n,  # [BLOCK_N] columns that exist
    k_start,  # first position along K of this range
    k_stop,  # end of this range
    stride_ak,  # elements between columns of a
    stride_bk,  # elements between rows of b
    FP32_DOTS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """a[:, k_start:k_stop] @ b[k_start:k_stop, :] for one tile: fp32 [BLOCK_M, BLOCK_N], the K
    steps folded into one accumulator from 0, in order."""
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # fp32 partial of this K range
    for k in range(k_start, k_stop, BLOCK_K):
        k_left = k_stop - k  # valid depth in this step (the last step of K may be partial)
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        if FP32_DOTS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def store_split_tile(
    acc,  # [BLOCK_M, BLOCK_N] fp32: this program's product over its range of K
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or c [M, N] itself when there is one split
    c_ptr,  # [M, N] output (read only when FUSED_SUM: the last split of a tile writes it)
    counter_ptr,  # [tiles of N] int32 arrivals per tile, 0 between launches (when FUSED_SUM)
    tile_n,  # which BLOCK_N columns of c this program computed
    split,  # which range of K
    offs_m,  # [BLOCK_M] rows of c
    cols_b,  # [BLOCK_N] int64 columns of c
    mask_m,  # [BLOCK_M] rows that exist (< M)
    mask_n,  # [BLOCK_N] columns that exist (< N)
    stride_os,  # elements between the partials of consecutive splits (0 when out is c)
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    stride_cm,  # elements between rows of c (when FUSED_SUM)
    stride_cn,  # elements between columns of c (when FUSED_SUM)
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 stores rounded by hand
    FUSED_SUM: tl.constexpr,  # split: the tile's last split sums the partials into c
):
    """The split-K epilogue of every decode GEMM kernel (this one, norm_matmul, silu_down): store
    the tile's partial (or c itself), and with FUSED_SUM let the tile's last split add the
    partials in the fixed order 0, 1, ... into c."""
    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)
    tile_mask = mask_m[:, None] & mask_n[None, :]
    out_tile = offs_m[:, None] * stride_om + cols_b[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    own = out_ptr + split.to(tl.int64) * stride_os + out_tile  # this split's partial (or c)
    tl.store(own, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
    if FUSED_SUM:
        num_splits = tl.num_programs(1)
        tl.debug_barrier()  # every thread's share of the partial is stored before we count it
        # acq_rel: our partial is visible before the count; the last one sees everyone's after it
        arrived = tl.atomic_add(counter_ptr + tile_n, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # the last split of this tile: sum the partials in order
            total = tl.load(out_ptr + out_tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, num_splits):  # .cg: from L2, where the other SMs' stores landed
                partial = out_ptr + s * stride_os + out_tile
                total += tl.load(partial, mask=tile_mask, other=0.0, cache_modifier=".cg")
            if INTERPRETED and c_ptr.dtype.element_ty == tl.bfloat16:
                total = round_to_bf16(total)
            c_tile = offs_m[:, None] * stride_cm + cols_b[None, :] * stride_cn
            tl.store(c_ptr + c_tile, total.to(c_ptr.dtype.element_ty), mask=tile_mask)
            tl.atomic_xchg(counter_ptr + tile_n, 0)  # ready for the next launch


@triton.jit
def _decode_kernel(
    a_ptr,  # [M_in, K] input rows, any strides
    b_ptr,  # [K, N] weights, any strides (row-major, or a transposed view)
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or c [M, N] itself (one split, or SERIAL)
    c_ptr,  # [M, N] output (read only when FUSED_SUM: the last split of a tile writes it)
    counter_ptr,  # [tiles of M x N] int32 arrivals per tile, 0 between launches (when FUSED_SUM)
    # [M] int rows of a to use when GATHER (c[i] = a[row_index[i]] @ b); unused otherwise
    row_index_ptr,
    M,  # rows of c
    N,  # columns of b and c
    K,  # reduction length
    K_PER_SPLIT,  # depth of K each split walks: a multiple of BLOCK_K (the last split may get less)
    NUM_SPLITS,  # ranges of K (read when SERIAL; otherwise the grid's second axis)
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
    SERIAL: tl.constexpr,  # one program walks its tile's NUM_SPLITS ranges, adds them in order
):
    tile_n = tl.program_id(0)  # which BLOCK_N columns of c
    split = tl.program_id(1)  # which range of K (0 when SERIAL)
    tile_m = tl.program_id(2)  # which BLOCK_M rows of c

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of c
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of c
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    mask_n = offs_n < N
    if GATHER:
        # [BLOCK_M] rows of a
        rows_a = tl.load(row_index_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        rows_a = offs_m.to(tl.int64)
    cols_b = offs_n.to(tl.int64)  # int64: col * stride may pass 2**31 for a transposed LM head
    # [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] at k 0
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols_b[None, :] * stride_bn

    if SERIAL:  # every range of K here, summed in the order 0, 1, ...: the parallel splits' sums
        acc = _range_product(a_ptrs, b_ptrs, mask_m, mask_n, 0, tl.minimum(K, K_PER_SPLIT),
                             stride_ak, stride_bk, FP32_DOTS, INPUT_PRECISION,
                             BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
        for s in range(1, NUM_SPLITS):
            k_start = s * K_PER_SPLIT
            k0 = k_start.to(tl.int64)
            k_stop = tl.minimum(K, k_start + K_PER_SPLIT)
            acc += _range_product(a_ptrs + k0 * stride_ak, b_ptrs + k0 * stride_bk, mask_m, mask_n,
                                  k_start, k_stop, stride_ak, stride_bk, FP32_DOTS,
                                  INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    else:  # this program's range of K only
        k_start = split * K_PER_SPLIT
        k0 = k_start.to(tl.int64)
        acc = _range_product(a_ptrs + k0 * stride_ak, b_ptrs + k0 * stride_bk, mask_m, mask_n,
                             k_start, tl.minimum(K, k_start + K_PER_SPLIT), stride_ak, stride_bk,
                             FP32_DOTS, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip

    # the tile's arrivals: counters [tiles of M, tiles of N] (one row of them for one tile-row)
    counters = counter_ptr + tile_m * tl.num_programs(0)
    store_split_tile(
        acc, out_ptr, c_ptr, counters, tile_n, split, offs_m, cols_b, mask_m, mask_n,
        stride_os, stride_om, stride_on, stride_cm, stride_cn, INTERPRETED, FUSED_SUM,
    )  # fmt: skip


@triton.jit
def _split_k_sum_kernel(
    partials_ptr,  # [SPLIT_K, M, N] fp32 partial products, contiguous
    c_ptr,  # [M, N] output, contiguous
    NUMEL,  # M * N
    SPLIT_K: tl.constexpr,  # partials to add, always in the order 0, 1, ..., SPLIT_K - 1
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 rounded by hand
    BLOCK: tl.constexpr,  # output elements per program
):
    # [BLOCK] flat positions in c
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    total = tl.load(partials_ptr + offs, mask=mask, other=0.0)  # [BLOCK] partial 0
    # fixed order: the same bits every run, whichever split finished first
    for s in range(1, SPLIT_K):
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
    """c = a @ b (or a[row_index] @ b), written into c [M, N] (contiguous); returns c.

    a and b are checked by `kernels.matmul.matmul`, which calls this for decode shapes (M <= 16)
    and, batch-invariant, for every M: a [M_in, K] and b [K, N] of one float dtype, any strides.
    policy: the dot precision (default: `dot_policy(a.dtype)`, what matmul passes). config: a fixed
    config (default: `decode_config`). fused_sum: the last split of each tile sums the partials (one
    kernel); False: a second kernel sums them (`split_k_sum`). Both add in the same order: the same
    bits. More than 16 rows: tiles of 16 rows, each program walking all the splits of its tile in
    the same order (no partials in memory): the same bits again (see the module docstring).
    """
    m = c.shape[0]
    # cheap test first: this runs per call
    if not c.is_contiguous() or c.dim() != 2 or c.shape[1] != b.shape[1]:
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
    _split_k_sum_kernel[(cdiv(numel, REDUCE_BLOCK),)](
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
    (tiles_n, splits), k_per_split, options = decode_launch(n, k, cfg, policy)
    tiles_m = cdiv(m, BLOCK_M)
    serial = tiles_m > 1 and splits > 1  # enough programs without splitting K: no partials
    if serial:
        out, stride_os, counters = c, 0, None
    else:
        out, stride_os, counters = split_outputs(c, splits, tiles_n * tiles_m, fused_sum)
    _decode_kernel[(tiles_n, 1 if serial else splits, tiles_m)](
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
        NUM_SPLITS=splits,
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
        SERIAL=serial,
        **options,
    )
    if splits > 1 and not serial and counters is None:
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
    return (cdiv(n, cfg.block_n), splits), k_per_split, options


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
    # GPU only: software-pipelining depth (num_stages - 1 tiles of b loading ahead)
    num_stages: int = 3

    def __post_init__(self) -> None:
        blocks = (self.block_n, self.block_k)
        if any(b < 16 or b & (b - 1) for b in blocks) or not 1 <= self.split_k <= MAX_SPLIT_K:
            raise KernelInputError(
                f"matmul_decode: blocks {blocks} must be powers of two >= 16 (tl.dot), "
                f"split_k {self.split_k} in [1, {MAX_SPLIT_K}]"
            )


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(k_per_split, num_splits): each split walks k_per_split (a multiple of block_k) of K, the
    last one less.

    Asking for split_k ranges can give fewer: K = 4096 in 128-deep steps is 32 steps; 9 ranges of 4
    steps would leave the 9th empty, so it becomes 8 ranges of 4 steps. No split is ever empty.
    """
    steps = cdiv(k, block_k)
    k_per_split = cdiv(steps, min(split_k, steps)) * block_k
    return k_per_split, cdiv(k, k_per_split)


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
        tiles_n = cdiv(n, block_n)
        for per_sm in PROGRAMS_PER_SM:
            wanted = min(MAX_SPLIT_K, max(1, cdiv(per_sm * sms, tiles_n)))
            _, splits = split_plan(k, block_k, wanted)
            cfg = DecodeConfig(block_n, block_k, splits, warps, stages)
            found[(block_n, block_k, splits, warps, stages)] = cfg
    return list(found.values())


_TUNED: dict[tuple, DecodeConfig] = {}  # GPU: (N, K, dtype, b layout, precision) -> fastest config


def decode_config(a, b, c, row_index, policy: DotPolicy) -> DecodeConfig:
    """The config for this shape: fixed under the interpreter; timed once per shape class on a GPU.

    The key leaves out M on purpose: every batch size uses the same split and tile, so a row's
    result does not depend on how many other rows share the step. The candidates are timed on a
    decode shape (the first 16 rows) whatever M the first call has: decode is what this kernel is
    tuned for, and a batch-invariant prefill runs the same config.
    """
    if INTERPRETER or c.device.type != "cuda":
        return INTERPRETER_CONFIG
    n, k = c.shape[1], a.shape[1]
    key = (n, k, a.dtype, b.stride(1) == 1, policy.input_precision, row_index is not None)
    cfg = _TUNED.get(key)
    if cfg is None:
        # pre-Ampere: no tensor cores for these dots
        fma = torch.cuda.get_device_capability(c.device)[0] < 8
        candidates = gpu_candidates(
            n, k, a.element_size(), num_sms(c.device), smem_budget(c.device), fma
        )
        if row_index is None:
            a = a[:BLOCK_M]
        rows, c = (row_index if row_index is None else row_index[:BLOCK_M]), c[:BLOCK_M]
        times = [_time_ms(a, b, c, rows, cand, policy) for cand in candidates]
        cfg = _TUNED[key] = candidates[times.index(min(times))]
    return cfg


def tuned_configs() -> dict[tuple, DecodeConfig]:
    """What the GPU tuner chose so far: (N, K, dtype, b row-major, precision, gather) -> config."""
    return dict(_TUNED)
