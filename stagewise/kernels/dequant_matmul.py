"""Fused dequantize-GEMM: `c = a @ w` with w read as 4- or 8-bit group codes plus float16 scales.

    a [M, K] @ w [K, N] -> c [M, N]       w stored out-major: codes [N, K/2] uint8 (4-bit, two
                                          per byte) or [N, K] int8, scales (and mins) [N, K/G]

Every program loads a [BLOCK_K, BLOCK_N] tile of *codes* (a quarter of the
bytes of float16 weights for 4 bits), the scale of each code's group, expands
the tile in registers by the block formula

    w[k, n] = d[n, k // G] * (q[n, k] - OFFSET) + m[n, k // G]

and feeds it to `tl.dot`, accumulating in fp32. Only packed bytes leave
memory: that is the whole point for decode, where a step's time is the time
to stream the weights (4-bit: ~0.6 bytes per weight instead of 2).

The 4-bit nibble order is GGUF's (byte i of a group holds value i in its low
nibble and value i + G/2 in its high one), so code k sits in byte
(k // G) * G/2 + k % (G/2), shifted by 4 when k % G >= G/2.

The K-quants kept by the loader (`quant/packed_weight.py`) run here too:
q4_k is q4_1's layout with float32 scales and minimums, q5_k 8-bit storage
of codes 0..31 with a minimum, q6_k signed 8-bit codes in groups of
16 (G is a launch constant; BLOCK_K stays a multiple of it).

Decode (M <= 16): one BLOCK_M = 16 tile of rows and split-K as in
`kernels/matmul_decode.py` (programs per (tile of N, range of K), fp32
partials summed in a fixed order by its reduce kernel); prefill: tiles of M
too and no split. BLOCK_K and G divide one another (groups of 64 or 128 span
several steps), and each code reads the scale of its own group.

Batch-invariant (`batch_invariant=True`, the stages' default): the decode
config for every M, so each output element is the same chain of steps alone
or among hundreds of rows (the reasons are the plain GEMM's:
kernels/matmul_decode.py). Past one tile of rows a program walks every split
of its tile and adds the partials in registers in the order 0, 1, ... (SERIAL),
the additions the reduce kernel makes: the same bits, no [SPLIT_K, M, N]
buffer.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.matmul_decode import DECODE_MAX_M, _sum_partials, split_plan
from stagewise.kernels.plan_cache import plan_cache
from stagewise.kernels.precision import DotPolicy, dot_policy, round_to_bf16
from stagewise.kernels.split_k import num_sms

GROUP_SIZE = 32  # values per group (the packed format's G)


@triton.jit
def _dequant_range(
    a_ptr,  # [M, K] activations, any strides
    codes_ptr,  # [N, K/2] uint8 (BITS = 4) or [N, K] int8 (BITS = 8), rows contiguous
    scales_ptr,  # [N, K/G] d per group
    mins_ptr,  # [N, K/G] m per group (read when HAS_MINS)
    offs_m,  # [BLOCK_M] rows of the tile
    rows_w,  # [BLOCK_N] int64 storage rows of codes / scales: the tile's output features
    mask_m,  # [BLOCK_M]
    mask_n,  # [BLOCK_N]
    k_start,  # first position along K of this range
    k_stop,  # end of this range
    stride_am,  # elements between rows of a
    stride_ak,  # elements between columns of a
    stride_codes,  # bytes between rows of codes
    stride_scales,  # elements between rows of scales and mins
    BITS: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr,
    GROUP: tl.constexpr,
    FP32_DOTS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """a[tile, k_start:k_stop] @ w[k_start:k_stop, tile]: fp32 [BLOCK_M, BLOCK_N], the K steps
    folded into one accumulator from 0, in order."""
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks = k0 + offs_k  # [BLOCK_K] positions along K
        mask_k = ks < k_stop
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        tile_mask = mask_k[:, None] & mask_n[None, :]  # [BLOCK_K, BLOCK_N]
        if BITS == 4:
            j = ks % GROUP  # position inside the group
            byte = (ks // GROUP) * (GROUP // 2) + j % (GROUP // 2)  # [BLOCK_K] byte in the row
            shift = (j // (GROUP // 2)) * 4  # 0: low nibble, 4: high nibble
            raw = tl.load(
                codes_ptr + rows_w[None, :] * stride_codes + byte[:, None], mask=tile_mask, other=0
            )  # [BLOCK_K, BLOCK_N] uint8, each byte read for its two codes
            q = (raw.to(tl.int32) >> shift[:, None]) & 0xF
        else:
            q = tl.load(
                codes_ptr + rows_w[None, :] * stride_codes + ks[:, None], mask=tile_mask, other=0
            ).to(tl.int32)  # [BLOCK_K, BLOCK_N] signed codes
        groups = rows_w[None, :] * stride_scales + (ks // GROUP)[:, None]  # [BLOCK_K, BLOCK_N]
        d = tl.load(scales_ptr + groups, mask=tile_mask, other=0.0).to(tl.float32)
        w = d * (q - OFFSET).to(tl.float32)  # [BLOCK_K, BLOCK_N] the weights, fp32
        if HAS_MINS:
            w += tl.load(mins_ptr + groups, mask=tile_mask, other=0.0).to(tl.float32)
        if FP32_DOTS:
            a = a.to(tl.float32)
        else:
            w = w.to(a.dtype)  # 16-bit tensor-core dot (W4A16): the expanded tile in a's dtype
        acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
    return acc


@triton.jit
def _dequant_matmul_kernel(
    a_ptr,  # [M, K] activations, any strides
    codes_ptr,  # [N, K/2] uint8 (BITS = 4) or [N, K] int8 (BITS = 8), rows contiguous
    scales_ptr,  # [N, K/G] float16 or float32 (K-quants): d per group
    mins_ptr,  # [N, K/G] like scales: m per group (HAS_MINS), else any pointer
    out_ptr,  # c [M, N], or [SPLIT_K, M, N] fp32 partials when K is split (and not SERIAL)
    M,  # rows of a and c
    N,  # output features
    K,  # input features (a multiple of GROUP)
    K_PER_SPLIT,  # depth of K each split walks, a multiple of BLOCK_K
    NUM_SPLITS,  # ranges of K (read when SERIAL; otherwise the grid's third axis)
    stride_am,  # elements between rows of a
    stride_ak,  # elements between columns of a
    stride_codes,  # bytes between rows of codes
    stride_scales,  # elements between rows of scales and mins
    stride_os,  # elements between consecutive splits' partials (0: out is c)
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    BITS: tl.constexpr,  # 4 or 8
    OFFSET: tl.constexpr,  # subtracted from every code (q4_0: 8)
    HAS_MINS: tl.constexpr,  # True: + m per group (q4_1)
    GROUP: tl.constexpr,  # values per group
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 stores rounded by hand
    FP32_DOTS: tl.constexpr,  # dot in fp32 (fp32 activations, or bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot input precision for fp32 tiles
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a multiple of GROUP
    SERIAL: tl.constexpr,  # one program walks its tile's NUM_SPLITS ranges, adds them in order
):
    tile_m = tl.program_id(0)  # which BLOCK_M rows of c
    tile_n = tl.program_id(1)  # which BLOCK_N columns of c
    split = tl.program_id(2)  # which range of K (0 when SERIAL)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_w = offs_n.to(tl.int64)  # storage rows of codes / scales: one per output feature
    if SERIAL:  # the splits' partials, added in the order 0, 1, ... as _split_k_sum_kernel does
        acc = _dequant_range(
            a_ptr, codes_ptr, scales_ptr, mins_ptr, offs_m, rows_w, mask_m, mask_n,
            0, tl.minimum(K, K_PER_SPLIT), stride_am, stride_ak, stride_codes, stride_scales,
            BITS, OFFSET, HAS_MINS, GROUP, FP32_DOTS, INPUT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        for s in range(1, NUM_SPLITS):
            k_start = s * K_PER_SPLIT
            acc += _dequant_range(
                a_ptr, codes_ptr, scales_ptr, mins_ptr, offs_m, rows_w, mask_m, mask_n,
                k_start, tl.minimum(K, k_start + K_PER_SPLIT), stride_am, stride_ak, stride_codes,
                stride_scales, BITS, OFFSET, HAS_MINS, GROUP, FP32_DOTS, INPUT_PRECISION,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        k_start = split * K_PER_SPLIT
        acc = _dequant_range(
            a_ptr, codes_ptr, scales_ptr, mins_ptr, offs_m, rows_w, mask_m, mask_n,
            k_start, tl.minimum(K, k_start + K_PER_SPLIT), stride_am, stride_ak, stride_codes,
            stride_scales, BITS, OFFSET, HAS_MINS, GROUP, FP32_DOTS, INPUT_PRECISION,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip

    if INTERPRETED and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = round_to_bf16(acc)
    out_ptrs = (
        out_ptr
        + split.to(tl.int64) * stride_os
        + offs_m[:, None].to(tl.int64) * stride_om
        + offs_n[None, :] * stride_on
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class DequantConfig:
    block_m: int  # rows of c per program (16 for decode: tl.dot's minimum)
    block_n: int  # output features per program
    block_k: int  # depth of one step along K: a multiple of GROUP_SIZE
    split_k: int  # K ranges per tile (1: the program stores c itself)
    num_warps: int = 4  # GPU only
    num_stages: int = 3  # GPU only


# Under the interpreter: few, small programs (tests use tiny shapes); split in two where K allows.
INTERPRETER_DECODE = DequantConfig(block_m=16, block_n=32, block_k=32, split_k=2)
INTERPRETER_PREFILL = DequantConfig(block_m=32, block_n=32, block_k=32, split_k=1)
# On a GPU, by element size of the activations: tiles that compile without register spills for
# sm_80/89/90 (the compile gate): the expanded [BLOCK_K, BLOCK_N] fp32 tile and its 64-bit
# pointers live in registers, so fp32 activations get smaller tiles.
GPU_PREFILL = {
    2: DequantConfig(block_m=64, block_n=64, block_k=32, split_k=1, num_warps=4, num_stages=3),
    4: DequantConfig(block_m=32, block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2),
}
# 16-bit decode: 8 warps for the expanded 64 x 64 tile: with 4, triton 3.6 (an older GPU machine's
# version) spills ~330 bytes a thread at 255 registers on sm_90; 8 warps compile at ~190, no spills
GPU_DECODE_TILE = {2: (64, 64, 8, 3), 4: (32, 32, 4, 2)}  # (block_n, block_k, warps, stages)
# 8-bit codes with a minimum (q5_k) load a second [BLOCK_K, BLOCK_N] tile per step: at 3 stages the
# 16-bit decode tile spills 12 bytes a thread on sm_90 (the compile gate); 2 stages do not (92 regs)
MINS_8BIT_DECODE_STAGES = 2
# ... and a SERIAL walk (batch-invariant, more than 16 rows) carries one more [16, BLOCK_N] partial:
# at 2 stages SmolLM2's q5_k gate_up spills 52 bytes a thread on sm_90 in 16-bit; 1 stage does not.
# Stages only pipeline the loads: no sum changes order, so the row keeps the decode launch's bits
MINS_8BIT_SERIAL_STAGES = 1
PROGRAMS_PER_SM = 2  # decode: split K until about this many programs per SM


def dequant_config(
    m: int,
    n: int,
    k: int,
    sms: int | None,
    element_size: int = 2,
    mins_8bit: bool = False,
    batch_invariant: bool = False,
) -> DequantConfig:
    """The launch for this shape: decode (M <= 16) splits K to fill the GPU, prefill tiles M;
    batch-invariant, the decode config for every M (it depends on N, K and the format only)."""
    size = 4 if element_size >= 4 else 2
    if m > DECODE_MAX_M and not batch_invariant:
        return INTERPRETER_PREFILL if sms is None else GPU_PREFILL[size]
    if sms is None:
        return INTERPRETER_DECODE
    block_n, block_k, warps, stages = GPU_DECODE_TILE[size]
    if mins_8bit:
        stages = min(stages, MINS_8BIT_DECODE_STAGES)
    wanted = max(1, min(16, -(-PROGRAMS_PER_SM * sms // -(-n // block_n))))
    _, splits = split_plan(k, block_k, wanted)
    return DequantConfig(16, block_n, block_k, splits, warps, stages)


def launch_stages(cfg: DequantConfig, serial: bool, mins_8bit: bool) -> int:
    """The pipeline depth of a launch: the config's, fewer for a SERIAL walk over 8-bit codes with
    a minimum (MINS_8BIT_SERIAL_STAGES)."""
    return min(cfg.num_stages, MINS_8BIT_SERIAL_STAGES) if serial and mins_8bit else cfg.num_stages


def dequant_matmul(
    a: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    *,
    bits: int,
    offset: int,
    group_size: int = GROUP_SIZE,
    config: DequantConfig | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """a [M, K] float @ packed w [K, N] -> c [M, N] in a's dtype (see the module docstring).

    batch_invariant: the decode config for every M, so a row's bits do not depend on the others."""
    _check(a, codes, scales, mins, bits, group_size)
    m, k = a.shape
    n = codes.shape[0]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    if m == 0 or n == 0:
        return c
    policy = dot_policy(a.dtype)  # per call: it follows PyTorch's TF32 switch
    grid, k_per_split, options = dequant_launch(
        m, n, k, a.dtype, a.device, bits, offset, mins is not None, group_size, config, policy,
        batch_invariant,
    )  # fmt: skip
    splits, serial = k_per_split[1], options["SERIAL"]
    k_per_split = k_per_split[0]
    partials = splits > 1 and not serial
    out = torch.empty((splits, m, n), device=a.device, dtype=torch.float32) if partials else c
    _dequant_matmul_kernel[grid](
        a_ptr=a,
        codes_ptr=codes,
        scales_ptr=scales,
        mins_ptr=scales if mins is None else mins,
        out_ptr=out,
        M=m,
        N=n,
        K=k,
        K_PER_SPLIT=k_per_split,
        NUM_SPLITS=splits,
        stride_am=a.stride(0),
        stride_ak=a.stride(1),
        stride_codes=codes.stride(0),
        stride_scales=scales.stride(0),
        stride_os=out.stride(0) if partials else 0,
        stride_om=out.stride(-2),
        stride_on=out.stride(-1),
        **options,
    )
    if partials:
        _sum_partials(out, c)  # fixed order 0, 1, ...: the same bits every run
    return c


@plan_cache
def dequant_launch(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    bits: int,
    offset: int,
    has_mins: bool,
    group_size: int,
    config: DequantConfig | None,
    policy: DotPolicy,
    batch_invariant: bool = False,
) -> tuple[tuple, tuple[int, int], dict]:
    """(grid, (K_PER_SPLIT, splits), launch kwargs) of one dequantize-GEMM, kept per shape, format
    and device.

    The grid is (tiles of M, tiles of N, splits): a decode row at N = 960, K = 576 under the
    interpreter's 16 x 32 x 32 tiles, split 2, is (1, 30, 2), each split walking 9 x 32 of K. With
    more than one tile of M and a split K, each program walks its tile's splits (SERIAL): the grid
    is (tiles of M, tiles of N, 1) and no partials are written; the sums are the same.
    """
    mins_8bit = bits == 8 and has_mins
    cfg = config or dequant_config(
        m, n, k, num_sms(device), dtype.itemsize, mins_8bit, batch_invariant
    )
    if cfg.block_k % group_size and group_size % cfg.block_k:  # a step holds whole groups,
        raise KernelInputError(  # or a group whole steps (every code finds its own scale)
            f"dequant_matmul: block_k {cfg.block_k} cuts groups of {group_size}"
        )
    k_per_split, splits = split_plan(k, cfg.block_k, cfg.split_k)
    options = dict(
        BITS=bits,
        OFFSET=offset,
        HAS_MINS=has_mins,
        GROUP=group_size,
        INTERPRETED=INTERPRETER,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    tiles_m = -(-m // cfg.block_m)
    options["SERIAL"] = serial = tiles_m > 1 and splits > 1
    if config is None:
        options["num_stages"] = launch_stages(cfg, serial, mins_8bit)
    grid = (tiles_m, -(-n // cfg.block_n), 1 if serial else splits)
    return grid, (k_per_split, splits), options


def _check(a, codes, scales, mins, bits: int, group_size: int) -> None:
    """Shapes and dtypes of one call, each wrong one a one-line KernelInputError."""
    if a.dim() != 2 or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise KernelInputError(f"dequant_matmul: a must be 2-D float, got {a.dtype} {a.shape}")
    code_dtype = torch.uint8 if bits == 4 else torch.int8
    per_byte = 2 if bits == 4 else 1
    k = a.shape[1]
    if bits not in (4, 8) or codes.dtype != code_dtype or codes.dim() != 2:
        raise KernelInputError(f"dequant_matmul: {bits}-bit codes must be 2-D {code_dtype}")
    if group_size % 16 or (bits == 4 and group_size % 2):
        raise KernelInputError(f"dequant_matmul: group_size {group_size} is not a multiple of 16")
    if codes.shape[1] * per_byte != k or k % group_size:
        raise KernelInputError(
            f"dequant_matmul: codes {tuple(codes.shape)} do not hold K = {k} "
            f"in groups of {group_size}"
        )
    groups = (codes.shape[0], k // group_size)
    if scales.dtype not in (torch.float16, torch.float32):
        raise KernelInputError(
            f"dequant_matmul: scales must be float16 or float32, got {scales.dtype}"
        )
    for name, t in (("scales", scales), ("mins", mins)):
        if t is not None and (t.dtype != scales.dtype or tuple(t.shape) != groups):
            raise KernelInputError(
                f"dequant_matmul: {name} must be {scales.dtype} {list(groups)} "
                "(float16, or float32 for K-quants)"
            )
    for name, t in (("codes", codes), ("scales", scales), ("mins", mins)):
        if t is not None and (t.stride(-1) != 1 or t.device != a.device):
            raise KernelInputError(f"dequant_matmul: {name} rows must be contiguous, on a's device")
