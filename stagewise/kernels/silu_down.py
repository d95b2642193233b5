"""The FFN's down projection with `silu(gate) * up` computed in its input load (decode, M <= 16).

    gate_up [M, 2*inter] -> h = silu(gate) * up [M, inter] -> h @ w_down [inter, N] -> [M, N]

Unfused, the Triton tier runs `silu_and_mul` (kernels/activation.py), which
writes h to memory, then the split-K decode GEMM (kernels/matmul_decode.py),
which reads it back. Here the GEMM's A-operand load reads the gate tile and
the up tile `inter` columns further along the same rows, computes
silu(gate) * up in fp32 with the activation kernel's formula, and hands the
result to `tl.dot`: h never exists in memory, and one launch per layer goes.

What that buys, Llama-3-8B at 8 decode rows in bf16: the weights are
14336 x 4096 x 2 B = 117 MB, about 24 us at an H200's 4.8 TB/s; h is
8 x 14336 x 2 B = 229 KB written and read again, 0.1 us of that bandwidth.
So the gain is the launch (a few us per layer on an eager step, one node of
a CUDA graph), not bytes. The price: each of the cdiv(4096, BLOCK_N) tiles
of N recomputes the sigmoids of its K range and reads gate and up (twice
the bytes of h, from L2). 64 tiles: 64 x 8 x 14336 = 7.3 M sigmoids, two
special-function ops each (exp, reciprocal) at 16 a clock per SM: 132 x 16
x 1.98 GHz = 4.2 T/s, so 3.5 us of those units against 24 us of streaming,
meant to hide under the weight loads (the GPU tuner times it, tile by tile).

Prefill keeps the two kernels for that reason. At 512 tokens and 32 tiles
of 128 columns the recomputation is 32 x 512 x 14336 = 235 M sigmoids =
112 us of special-function time, more than the down GEMM itself (2 x 512 x
14336 x 4096 = 60 GFLOP, ~75 us at ~800 TFLOP/s), to save a 29 MB round trip
of h (~6 us). Fusing there needs h computed once per row tile and kept on
chip, a different kernel.

Rounding: the unfused path stores h in the activation dtype (rounded to
nearest) and the GEMM loads that. This kernel rounds h the same way before
the dot, so in 16 bits the dot sees the very operand the unfused GEMM sees
and, with the same config, both give the same bits (tests/kernels/
test_silu_down.py checks that under the interpreter). fp32 keeps h in fp32.

Everything else is the split-K decode GEMM's: the grid, the split of K, the
fp32 partials and their fused sum in the fixed order 0, 1, ... by the last
split of each tile (`matmul_decode.decode_launch`, `arrival_counters`,
`_sum_partials`); a GPU times the same candidates once per shape class,
their stages cut to fit the second A-side tile (`candidates`). Precision is
precision.py's: 16-bit dots on tensor cores with fp32 accumulation; fp32 dots
TF32 exactly when torch.matmul may use it.
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import (
    FLOAT_DTYPES,
    KernelInputError,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from stagewise.kernels.matmul_decode import (
    BLOCK_M,
    INTERPRETER_CONFIG,
    DecodeConfig,
    _sum_partials,
    decode_launch,
    gpu_candidates,
    smem_budget,
    split_outputs,
    store_split_tile,
)
from stagewise.kernels.precision import DotPolicy, dot_policy, round_to_bf16
from stagewise.kernels.split_k import num_sms
from stagewise.kernels.targets import MIN_CAPABILITY, checked_target, launch_target


@triton.jit
def _silu_down_kernel(
    # [M, 2*inter] gate in columns [0, inter), up in [inter, 2*inter); last dim contiguous
    gate_up_ptr,
    b_ptr,  # [inter, N] down-projection weights, any strides
    out_ptr,  # [SPLIT_K, M, N] fp32 partials, or c [M, N] itself when there is one split
    c_ptr,  # [M, N] output (read only when FUSED_SUM: the last split of a tile writes it)
    counter_ptr,  # [tiles of N] int32 arrivals per tile, 0 between launches (when FUSED_SUM)
    M,  # rows of c (<= BLOCK_M)
    N,  # columns of b and c (hidden)
    K,  # reduction length: inter
    K_PER_SPLIT,  # depth of K each split walks: a multiple of BLOCK_K (the last split may get less)
    stride_gm,  # elements between rows of gate_up
    stride_bk,  # elements between rows of b
    stride_bn,  # elements between columns of b
    stride_os,  # elements between the partials of consecutive splits (0 when out is c)
    stride_om,  # elements between rows of out
    stride_on,  # elements between columns of out
    stride_cm,  # elements between rows of c (when FUSED_SUM)
    stride_cn,  # elements between columns of c (when FUSED_SUM)
    INTERPRETED: tl.constexpr,  # True under the CPU interpreter: bf16 rounded by hand
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
    cols_b = offs_n.to(tl.int64)
    ks = k_start.to(tl.int64) + offs_k  # [BLOCK_K] positions along K of the first step

    rows = offs_m.to(tl.int64)[:, None] * stride_gm
    gate_ptrs = gate_up_ptr + rows + ks[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols_b[None, :] * stride_bn  # [BLOCK_K, BLOCK_N]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # fp32 partial of this K range
    for k in range(k_start, k_stop, BLOCK_K):
        k_left = k_stop - k  # valid depth in this step (the last step of K may be partial)
        mask_a = mask_m[:, None] & (offs_k[None, :] < k_left)
        gate = tl.load(gate_ptrs, mask=mask_a, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        up = tl.load(gate_ptrs + K, mask=mask_a, other=0.0).to(tl.float32)  # up: K columns on
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
        # silu(gate) * up in fp32, activation.py's formula; masked lanes give 0 / (1 + 1) * 0 = 0
        a = gate / (1.0 + tl.exp(-gate)) * up
        # rounded to the activation dtype as silu_and_mul's store rounds it: the unfused GEMM's A
        if gate_up_ptr.dtype.element_ty != tl.float32:
            if INTERPRETED and gate_up_ptr.dtype.element_ty == tl.bfloat16:
                a = round_to_bf16(a)  # stays fp32 (FP32_DOTS): an exact bf16 value
            else:
                a = a.to(gate_up_ptr.dtype.element_ty)
        if FP32_DOTS:
            b = b.to(tl.float32)
        # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        gate_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk

    # store the partial (or c); the tile's last split sums (matmul_decode's epilogue)
    store_split_tile(
        acc, out_ptr, c_ptr, counter_ptr, tile_n, split, offs_m, cols_b, mask_m, mask_n,
        stride_os, stride_om, stride_on, stride_cm, stride_cn, INTERPRETED, FUSED_SUM,
    )  # fmt: skip


def fuses(gate_up: torch.Tensor, w_down) -> bool:
    """Whether `silu_down` takes this call: plain tensor weights of gate_up's dtype, M <= 16 rows,
    on the interpreter or a GPU of compute capability 8.0+ (sm_75 keeps the two gate-proven
    kernels)."""
    if not isinstance(w_down, torch.Tensor) or w_down.dtype != gate_up.dtype or gate_up.dim() != 2:
        return False
    if not 0 < gate_up.shape[0] <= BLOCK_M:
        return False
    target = launch_target(gate_up.device)
    return target.interpreter or target.capability >= MIN_CAPABILITY


def silu_down(
    gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    config: DecodeConfig | None = None,
    fused_sum: bool = True,
) -> torch.Tensor:
    """(silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w_down for M <= 16 rows -> new [M, N].

    gate_up [M, 2*inter] (rows may be strided, the last dimension contiguous), w_down [inter, N]
    of the same float dtype, any strides. config: a fixed split-K config (default: the
    interpreter's, or the GPU's timed choice). fused_sum: as `matmul_decode`'s.
    """
    check_dim("silu_down", "gate_up", gate_up, 2)
    check_dim("silu_down", "w_down", w_down, 2)
    check_dtype("silu_down", "gate_up", gate_up, FLOAT_DTYPES)
    check_same_device("silu_down", gate_up=gate_up, w_down=w_down)
    if w_down.dtype != gate_up.dtype:
        raise KernelInputError(f"silu_down: gate_up is {gate_up.dtype}, w_down {w_down.dtype}")
    m, width = gate_up.shape
    if width % 2 or width // 2 != w_down.shape[0]:
        raise KernelInputError(
            f"silu_down: gate_up {list(gate_up.shape)} must be [M, 2 * inter] for w_down "
            f"[inter, N] = {list(w_down.shape)}"
        )
    if m > BLOCK_M:
        raise KernelInputError(f"silu_down: {m} rows; the fused decode kernel takes <= {BLOCK_M}")
    if width:
        check_last_dim_contiguous("silu_down", "gate_up", gate_up)
    inter, n = w_down.shape
    c = torch.empty((m, n), device=gate_up.device, dtype=gate_up.dtype)
    if m == 0 or n == 0:
        return c
    if inter == 0:
        return c.zero_()
    checked_target("silu_down", gate_up)  # the pre-Ampere policy (targets.py): not proven on sm_75
    policy = dot_policy(gate_up.dtype)
    cfg = config or silu_down_config(gate_up, w_down, c, policy)
    _launch(gate_up, w_down, c, cfg, policy, fused_sum)
    return c


def _launch(gate_up, w_down, c, cfg: DecodeConfig, policy: DotPolicy, fused_sum=True) -> None:
    """One fused launch with a given config; split without counters, the ordered sum after it."""
    m, n, k = c.shape[0], c.shape[1], w_down.shape[0]
    grid, k_per_split, options = decode_launch(n, k, cfg, policy)  # the decode GEMM's own plan
    splits = grid[1]
    out, stride_os, counters = split_outputs(c, splits, grid[0], fused_sum)
    _silu_down_kernel[grid](
        gate_up_ptr=gate_up,
        b_ptr=w_down,
        out_ptr=out,
        c_ptr=c,
        counter_ptr=c if counters is None else counters,  # unread without FUSED_SUM
        M=m,
        N=n,
        K=k,
        K_PER_SPLIT=k_per_split,
        stride_gm=gate_up.stride(0),
        stride_bk=w_down.stride(0),
        stride_bn=w_down.stride(1),
        stride_os=stride_os,
        stride_om=out.stride(-2),
        stride_on=out.stride(-1),
        stride_cm=c.stride(0),
        stride_cn=c.stride(1),
        FUSED_SUM=counters is not None,
        **options,
    )
    if splits > 1 and counters is None:
        _sum_partials(out, c)


def shared_memory_bytes(cfg: DecodeConfig, element_size: int) -> int:
    """(num_stages - 1) buffers (at least 1) of a b tile [BLOCK_K, BLOCK_N] and two A-side tiles
    (gate and up) [BLOCK_M, BLOCK_K]: matmul_decode's estimate plus one [16, BLOCK_K] tile a stage.

    M16 N128 K128, 4 stages, bf16: 3 x (128 x 128 + 2 x 16 x 128) x 2 B = 120 KB (plain GEMM: 108).
    """
    buffers = max(1, cfg.num_stages - 1)
    return buffers * (cfg.block_k * cfg.block_n + 2 * BLOCK_M * cfg.block_k) * element_size


def candidates(
    n: int, k: int, element_size: int, sms: int, budget: int, fma: bool
) -> list[DecodeConfig]:
    """The GPU candidates: the decode GEMM's (`matmul_decode.gpu_candidates`), each with its stages
    cut until this kernel's larger A side (`shared_memory_bytes`) fits `budget` bytes too."""
    out = []
    for c in gpu_candidates(n, k, element_size, sms, budget, fma):
        stages = c.num_stages
        while stages > 1:
            cfg = DecodeConfig(c.block_n, c.block_k, c.split_k, c.num_warps, stages)
            if shared_memory_bytes(cfg, element_size) <= budget:
                break
            stages -= 1
        out.append(DecodeConfig(c.block_n, c.block_k, c.split_k, c.num_warps, stages))
    return out


_TUNED: dict[tuple, DecodeConfig] = {}  # GPU: (N, K, dtype, b layout, precision) -> fastest config


def silu_down_config(gate_up, w_down, c, policy: DotPolicy) -> DecodeConfig:
    """Fixed under the interpreter (the decode GEMM's); on a GPU the fastest candidate, timed once
    per (N, K, dtype, weight layout, precision), never per M: a row's result does not depend on the
    batch."""
    if INTERPRETER or c.device.type != "cuda":
        return INTERPRETER_CONFIG
    n, k = c.shape[1], w_down.shape[0]
    key = (n, k, gate_up.dtype, w_down.stride(1) == 1, policy.input_precision)
    cfg = _TUNED.get(key)
    if cfg is None:
        fma = torch.cuda.get_device_capability(c.device)[0] < 8
        sms, budget = num_sms(c.device), smem_budget(c.device)
        found = candidates(n, k, gate_up.element_size(), sms, budget, fma)
        times = [_time_ms(gate_up, w_down, c, cand, policy) for cand in found]
        cfg = _TUNED[key] = found[times.index(min(times))]
    return cfg


def _time_ms(gate_up, w_down, c, cfg: DecodeConfig, policy: DotPolicy) -> float:
    """GPU milliseconds of one fused launch with cfg, its sum included."""
    run = lambda: _launch(gate_up, w_down, c, cfg, policy)  # noqa: E731
    return triton.testing.do_bench(run, warmup=5, rep=25)


def tuned_configs() -> dict[tuple, DecodeConfig]:
    """What the GPU tuner chose so far: (N, K, dtype, weight row-major, precision) -> config."""
    return dict(_TUNED)
