"""FlashAttention for a packed, variable-length batch: prefill, or decode on a contiguous cache.

    q [Tq, H, d], k/v [Tk, Hkv, d], cu_seqlens_q/k [B+1], seqused_k [B] or None -> out [Tq, H, d]

Semantics are the attention stage's (stages/attention.py): sequence b owns
query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys from cu_seqlens_k[b],
seqused_k[b] of them (else up to cu_seqlens_k[b+1]); causal, aligned
bottom-right; a row that sees no key gives 0; query head h reads KV head h // G.

Tiling (attention_common.py): grid (row tile, sequence, KV head x split); the
rows of a tile are (query, group head) pairs of one KV head, so the G heads
sharing it read each K/V tile once. A decode step (one query per sequence) is
one tile of G <= 16 rows per KV head: K/V are read once per KV head, not once
per query head (G = 3 for SmolLM2, 4 for Llama 3 8B, 8 for 70B). Prefill has
G * Lq / BLOCK_M tiles per KV head and K/V stream past each: Theta(N^2 d /
BLOCK_M) elements, FlashAttention's Theta(N^2 d^2 / M) for on-chip memory M,
while the [Lq, Lk] score matrix never exists. A decode step of a few long
sequences splits each tile's keys over NUM_SPLITS programs (flash decoding).

Tiles: up to DECODE_ROWS rows a fixed decode tile (BLOCK_N from KV_TILE_BYTES),
longer runs autotuned on a GPU, INTERPRETER_BLOCKS in the interpreter. q/k/v may
be strided views (q of the fused QKV output), the last dim contiguous. Dots follow
precision.py: 16-bit tensor-core dots, fp32 accumulation, P rounded to the input
dtype before P @ V; fp32 as torch.matmul (TF32 if allowed, else IEEE).

K/V tiles: pointer loads, or on sm_90 in 16 bits, for prefill, tensor descriptors that the TMA
engine serves (attention_tma.py; the TMA constexpr; same keys, same sums). Q stays a pointer
load, once per program: its rows are (query, group head) pairs, a box TMA could fetch only for a
power-of-two G (SmolLM2's is 3), and K/V carry most of the bytes. Llama-3-8B, a 512-token prompt,
a 128-row tile (32 queries x 4 heads, 32 KB of Q): it sees 256 keys on average, 4 pairs of
64-key K/V tiles of 32 KB each, so Q is a fifth of its loads, and less as prompts grow.
"""

import functools

import torch
import triton
import triton.language as tl

from stagewise.kernels import INTERPRETER
from stagewise.kernels.attention_common import (
    M_INIT,
    attend_chunks,
    attend_keys,
    check_cu_seqlens_q,
    check_index,
    check_qkv,
    invariant_tile,
    key_range,
    load_query_tile,
    needs_int64_offsets,
    program_tile,
    qk_scale_log2,
    store_rows,
    tile_fits,
)
from stagewise.kernels.attention_tma import (
    HAS_TENSOR_DESCRIPTORS,
    attend_chunks_tma,
    attend_keys_tma,
    descriptor_workspace,
    descriptors_fit,
    kv_descriptor,
    uses_tensor_descriptors,
)
from stagewise.kernels.checks import KernelInputError, check_same_device
from stagewise.kernels.plan_cache import cdiv, launch_tuned, next_power_of_2, plan_cache
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.split_k import (
    choose_num_splits,
    num_sms,
    partial_buffers,
    split_k_reduce,
)
from stagewise.kernels.targets import (
    LaunchPlan,
    Target,
    checked_target,
    fma_dots,
    launch_target,
)
from stagewise.runtime import debug_checks

NAME = "flash_attention"


@triton.jit
def _flash_attention_kernel(
    q_ptr,  # [Tq, H, d] queries, last dim contiguous
    k_ptr,  # [Tk, Hkv, d] keys, last dim contiguous
    v_ptr,  # [Tk, Hkv, d] values, last dim contiguous
    out_ptr,  # [Tq, H, d] output (NUM_SPLITS == 1) or [Tq, H, NUM_SPLITS, d] fp32 partial acc
    m_part_ptr,  # [Tq, H, NUM_SPLITS] fp32 partial running max (written only when NUM_SPLITS > 1)
    l_part_ptr,  # [Tq, H, NUM_SPLITS] fp32 partial running sum (written only when NUM_SPLITS > 1)
    cu_seqlens_q_ptr,  # [B+1] int32: query rows of each sequence
    cu_seqlens_k_ptr,  # [B+1] int32: first key row of each sequence
    seqused_k_ptr,  # [B] int32: keys used per sequence (read only when HAS_SEQUSED_K)
    qk_scale,  # softmax scale * log2(e)
    q_len_bucket,  # next power of two >= the longest query run: only an autotune key
    stride_q_token,  # elements between consecutive query tokens
    stride_q_head,  # elements between consecutive query heads
    stride_k_token,  # elements between consecutive key tokens
    stride_k_head,  # elements between consecutive KV heads of k
    stride_v_token,  # elements between consecutive value tokens
    stride_v_head,  # elements between consecutive KV heads of v
    stride_o_token,  # elements between consecutive output tokens (of out or the partial acc)
    stride_o_head,  # elements between consecutive output heads (of out or the partial acc)
    stride_o_split,  # elements between consecutive splits of the partial acc (0 without split-K)
    stride_ml_token,  # elements between consecutive tokens of m_part / l_part
    stride_ml_head,  # elements between consecutive heads of m_part / l_part
    GROUP: tl.constexpr,  # query heads per KV head, H // Hkv
    HEAD_DIM: tl.constexpr,  # d (a power of two)
    BLOCK_M: tl.constexpr,  # (query, group head) rows per tile
    BLOCK_N: tl.constexpr,  # keys per tile
    HAS_SEQUSED_K: tl.constexpr,  # key counts come from seqused_k, not from cu_seqlens_k
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load (fp32; bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot precision of fp32 tiles: "ieee" or "tf32"
    INT64_OFFSETS: tl.constexpr,  # a tensor spans >= 2^31 elements: 64-bit offsets
    NUM_SPLITS: tl.constexpr,  # programs sharing one tile's keys (1 = no split-K)
    TMA: tl.constexpr,  # K/V tiles through tensor descriptors (sm_90's TMA engine), not pointers
    KEY_CHUNK: tl.constexpr,  # > 0: batch-invariant, keys in fixed chunks merged in order
):
    seq, kv_head, split, q_start, q_len, f0 = program_tile(cu_seqlens_q_ptr, BLOCK_M, NUM_SPLITS)
    if f0 >= q_len * GROUP:
        return  # this sequence has fewer row tiles than the longest one
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    if HAS_SEQUSED_K:
        k_len = tl.load(seqused_k_ptr + seq)
    else:
        k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start
    q, query, head, row_ok, q_rows = load_query_tile(
        q_ptr, q_start, q_len, f0, kv_head, stride_q_token, stride_q_head,
        GROUP, HEAD_DIM, BLOCK_M, FP32_DOTS, INT64_OFFSETS,
    )  # fmt: skip
    lo, mid, hi = key_range(f0, q_len, k_len, split, GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS, KEY_CHUNK)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # the online softmax's running state
    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    shift = k_len - q_len  # query i sees keys j <= i + shift
    if TMA:  # one descriptor per K and V: this KV head's rows of the sequence, [k_len, d]
        k_desc = kv_descriptor(
            k_ptr + kv_head * stride_k_head, k_start, tl.maximum(k_len, 1), stride_k_token,
            BLOCK_N, HEAD_DIM, INT64_OFFSETS,
        )  # fmt: skip
        v_desc = kv_descriptor(
            v_ptr + kv_head * stride_v_head, k_start, tl.maximum(k_len, 1), stride_v_token,
            BLOCK_N, HEAD_DIM, INT64_OFFSETS,
        )  # fmt: skip
        if KEY_CHUNK > 0:  # batch-invariant: fixed chunks of keys, merged in order
            acc, m_i, l_i = attend_chunks_tma(
                q, query, row_ok, k_desc, v_desc, k_len, shift, lo, mid, hi, qk_scale,
                BLOCK_M, HEAD_DIM, BLOCK_N, KEY_CHUNK, FP32_DOTS, INPUT_PRECISION,
            )  # fmt: skip
        else:
            acc, m_i, l_i = attend_keys_tma(  # keys every row of the tile sees whole
                acc, m_i, l_i, q, query, row_ok, k_desc, v_desc, k_len, shift, lo, mid, qk_scale,
                BLOCK_N, MASKED=False, FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION,
            )  # fmt: skip
            acc, m_i, l_i = attend_keys_tma(  # the diagonal band
                acc, m_i, l_i, q, query, row_ok, k_desc, v_desc, k_len, shift, mid, hi, qk_scale,
                BLOCK_N, MASKED=True, FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION,
            )  # fmt: skip
    else:
        dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
        k_base = k_ptr + kv_head * stride_k_head + dims  # key row 0 of this KV head
        v_base = v_ptr + kv_head * stride_v_head + dims
        if KEY_CHUNK > 0:  # batch-invariant: fixed chunks of keys, merged in order
            acc, m_i, l_i = attend_chunks(
                q, query, row_ok, k_base, v_base, stride_k_token, stride_v_token, k_start,
                cu_seqlens_k_ptr, k_len, shift, lo, mid, hi, qk_scale, BLOCK_M, HEAD_DIM, BLOCK_N,
                KEY_CHUNK, 1, False, FP32_DOTS, INPUT_PRECISION, INT64_OFFSETS,
            )  # fmt: skip
        else:
            acc, m_i, l_i = attend_keys(  # keys every row of the tile sees whole: no mask work
                acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_k_token, stride_v_token,
                k_start, cu_seqlens_k_ptr, k_len, shift, lo, mid, qk_scale,
                BLOCK_N, BLOCK_SIZE=1, PAGED=False, MASKED=False,
                FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION, INT64_OFFSETS=INT64_OFFSETS,
            )  # fmt: skip
            acc, m_i, l_i = attend_keys(  # the diagonal band: causal and length masks
                acc, m_i, l_i, q, query, row_ok, k_base, v_base, stride_k_token, stride_v_token,
                k_start, cu_seqlens_k_ptr, k_len, shift, mid, hi, qk_scale,
                BLOCK_N, BLOCK_SIZE=1, PAGED=False, MASKED=True,
                FP32_DOTS=FP32_DOTS, INPUT_PRECISION=INPUT_PRECISION, INT64_OFFSETS=INT64_OFFSETS,
            )  # fmt: skip
    store_rows(
        out_ptr, m_part_ptr, l_part_ptr, acc, m_i, l_i, q_rows, head, row_ok, split,
        stride_o_token, stride_o_head, stride_o_split, stride_ml_token, stride_ml_head,
        HEAD_DIM, NUM_SPLITS,
    )  # fmt: skip


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    seqused_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_q_len: int | None = None,
    tensor_descriptors: bool | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """q [Tq, H, d], k/v [Tk, Hkv, d], cu_seqlens_q/k [B+1] int32, seqused_k [B] int32 or None
    -> out [Tq, H, d].

    `num_splits` forces split-K (1 = off); None lets `choose_num_splits` decide for the decode tile,
    from the grid and Tk / B keys per sequence (a contiguous cache's capacity per row: no host
    read).

    `tensor_descriptors` chooses how K/V tiles are loaded: None lets the plan decide (descriptors
    on sm_90 with 16-bit dots, pointers elsewhere), True asks for descriptors (on sm_90 or in the
    interpreter), False for pointers.

    `batch_invariant`: the tile paged attention uses, for every query length, and every row's keys
    in fixed chunks of KEY_CHUNK merged in order (attention_common.py): a row's bits are the same
    alone, batched, decoded or prefilled, and the same as paged attention's on the same keys. It
    runs unsplit (`num_splits` None or 1): with no host read there is no bound on a sequence's keys
    to give each split program one chunk, and every program walking its chunks gives the bits a
    split would.

    `max_q_len` (the longest sequence's query rows, a host int from the scheduler) sizes the grid.
    The launcher never reads cu_seqlens or seqused_k on the host: that would wait for every kernel
    queued before it (a host sync), making the step host-bound and impossible to capture in a CUDA
    graph. Without `max_q_len` it falls back to reading cu_seqlens_q (one sync; the engine always
    passes it). With debug checks on (`stagewise.runtime.debug_checks`) it reads them all and checks
    that every sequence's rows lie inside q and k, and that `max_q_len` covers every sequence.
    """
    num_heads, num_kv_heads, head_dim = _check_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k
    )
    qk_scale = qk_scale_log2(scale)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if debug_checks():
        _check_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q_len)
    if max_q_len is None:  # the fallback: one host read (the engine passes max_q_len)
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if num_seqs > 0 else 0

    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [Tq, H, d]; every row is written
    if max_q_len == 0:
        return out
    group = num_heads // num_kv_heads
    rows = max_q_len * group  # (query, group head) rows of the longest sequence
    policy = dot_policy(q.dtype)
    plan = flash_attention_launch_plan(
        max_q_len, group, head_dim, q.dtype, checked_target(NAME, q), batch_invariant
    )
    # the interpreter's tile, the decode tile, or the batch-invariant one
    fixed = INTERPRETER or rows <= DECODE_ROWS or batch_invariant
    if batch_invariant and num_splits not in (None, 1):
        raise KernelInputError(
            f"{NAME}: batch-invariant attention runs unsplit; num_splits must be None or 1, "
            f"got {num_splits}"
        )
    if fixed:
        blocks = plan.launch_options()
        if num_splits is None and not batch_invariant:  # a few long sequences: split their keys
            programs = cdiv(rows, blocks["BLOCK_M"]) * num_seqs * num_kv_heads
            num_splits = choose_num_splits(programs, k.shape[0] // num_seqs, num_sms(q.device))
    else:  # autotune picks BLOCK_M / BLOCK_N; a prefill grid is large enough unsplit
        blocks = plan.constexprs
    num_splits = 1 if num_splits is None else num_splits
    if num_splits < 1:
        raise KernelInputError(f"{NAME}: num_splits must be >= 1, got {num_splits}")
    tma = _descriptor_choice(tensor_descriptors, plan, k, v)
    target, m_part, l_part, stride_o_split, stride_ml = partial_buffers(out, num_splits)
    grid = lambda meta: (cdiv(rows, meta["BLOCK_M"]), num_seqs, num_kv_heads * num_splits)
    q_len_bucket = min(next_power_of_2(max_q_len), 8192)
    args = dict(
        q_ptr=q,
        k_ptr=k,
        v_ptr=v,
        out_ptr=target,
        m_part_ptr=m_part,
        l_part_ptr=l_part,
        cu_seqlens_q_ptr=cu_seqlens_q,
        cu_seqlens_k_ptr=cu_seqlens_k,
        seqused_k_ptr=cu_seqlens_k if seqused_k is None else seqused_k,  # unread if None
        qk_scale=qk_scale,
        q_len_bucket=q_len_bucket,
        stride_q_token=q.stride(0),
        stride_q_head=q.stride(1),
        stride_k_token=k.stride(0),
        stride_k_head=k.stride(1),
        stride_v_token=v.stride(0),
        stride_v_head=v.stride(1),
        stride_o_token=target.stride(0),
        stride_o_head=target.stride(1),
        stride_o_split=stride_o_split,
        stride_ml_token=stride_ml[0],
        stride_ml_head=stride_ml[1],
        HAS_SEQUSED_K=seqused_k is not None,
        FP32_DOTS=policy.fp32_dots,
        INPUT_PRECISION=policy.input_precision,
        INT64_OFFSETS=needs_int64_offsets(q, k, v, target),
        NUM_SPLITS=num_splits,
        **blocks,
    )
    args["TMA"] = tma  # the plan's choice, or the caller's
    if tma and not INTERPRETER:
        triton.set_allocator(descriptor_workspace)  # where the kernel writes its descriptors
    if fixed:
        _flash_attention_kernel[grid](**args)
    else:  # the autotuner's key: its key arguments and every tensor's dtype (all follow q's)
        key = ("flash_attention", q_len_bucket, head_dim, group, policy, num_splits, tma, q.dtype)
        launch_tuned(tuned_kernel(), _flash_attention_kernel, key, grid, args)
    if num_splits > 1:
        split_k_reduce(target, m_part, l_part, out)
    return out


def _descriptor_choice(asked: bool | None, plan: LaunchPlan, k, v) -> bool:
    """Whether this launch loads K/V through tensor descriptors (the kernel's TMA constexpr)."""
    if asked is None:
        return plan.constexprs["TMA"] and descriptors_fit(k, v)
    if asked and not (plan.constexprs["TMA"] or (INTERPRETER and HAS_TENSOR_DESCRIPTORS)):
        raise KernelInputError(
            f"{NAME}: tensor descriptors need sm_90 with 16-bit q/k/v (or the interpreter) and "
            f"triton >= 3.4 (installed: {triton.__version__})"
        )
    if asked and not descriptors_fit(k, v):
        raise KernelInputError(
            f"{NAME}: tensor descriptors need k and v 16-byte aligned, with token and head "
            "strides of a multiple of 16 bytes"
        )
    return asked


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k) -> tuple[int, int, int]:
    """Shapes, dtypes, layouts and devices (no host read) -> (H, Hkv, d)."""
    heads = check_qkv(NAME, q, k, v, kv_ndim=3)
    check_index(NAME, "cu_seqlens_q", cu_seqlens_q, None)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise KernelInputError(f"{NAME}: cu_seqlens_q is empty; it needs B+1 offsets")
    check_index(NAME, "cu_seqlens_k", cu_seqlens_k, num_seqs + 1)
    index = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if seqused_k is not None:
        check_index(NAME, "seqused_k", seqused_k, num_seqs)
        index["seqused_k"] = seqused_k
    check_same_device(NAME, q=q, k=k, v=v, **index)
    return heads


def _check_values(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k, max_q_len: int | None) -> None:
    """Debug checks: read the offsets on the host; every sequence's rows must lie inside q and k."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    check_cu_seqlens_q(NAME, cu_q, q.shape[0])
    used = seqused_k.tolist() if seqused_k is not None else [b - a for a, b in zip(cu_k, cu_k[1:])]
    for b in range(len(cu_q) - 1):
        if used[b] < 0 or cu_k[b] < 0 or cu_k[b] + used[b] > k.shape[0]:
            raise KernelInputError(
                f"{NAME}: sequence {b} reads keys {cu_k[b]}..{cu_k[b] + used[b]} of k, "
                f"which has {k.shape[0]} rows"
            )
    longest = max((b - a for a, b in zip(cu_q, cu_q[1:])), default=0)
    if max_q_len is not None and max_q_len < longest:
        raise KernelInputError(
            f"{NAME}: max_q_len {max_q_len} is below the longest sequence's {longest} query rows"
        )


# ---- tiles ----

# the interpreter pays per op, not per FLOP: few, small tiles
INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32}
DECODE_ROWS = 16  # a longest run of at most this many (query, group head) rows: the decode tile
KV_TILE_BYTES = 8 * 1024  # decode: bytes of one K (or V) tile, sets BLOCK_N (16 KB spills)
# GPU tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner may try; `_fits` keeps those
# that fit the target, dtype and head_dim. fp32 dots run on FMA units and hold whole operand rows
# per thread: small tiles.
TILES_16BIT = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 4),  # sm_90 at head_dim 128 (K/V in shared memory); small heads elsewhere
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
    (64, 32, 4, 2),
]
TILES_FP32 = [(64, 32, 8, 2), (32, 32, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (16, 16, 4, 2)]


@plan_cache
def flash_attention_launch_plan(
    max_q_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    target: Target,
    batch_invariant: bool = False,
) -> LaunchPlan:
    """`flash_attention_plan`, kept per key for the launcher (the compile gate calls the uncached
    one: its tests change the tile rules and must see the change)."""
    return flash_attention_plan(max_q_len, group, head_dim, dtype, target, batch_invariant)


def flash_attention_plan(
    max_q_len: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    target: Target,
    batch_invariant: bool = False,
) -> LaunchPlan:
    """Tiles: the interpreter's, the decode tile (one GQA group, fixed), or the tuner's that fit;
    batch-invariant, paged attention's one tile for every query length (`invariant_tile`)."""
    # KEY_CHUNK 0: one online softmax over all the keys (> 0: batch-invariant chunks)
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "TMA": False, "KEY_CHUNK": 0}
    if batch_invariant:  # K/V through descriptors where prefill would (the same values either way)
        meta, warps, stages = invariant_tile(head_dim, dtype, target)
        constexprs["KEY_CHUNK"] = meta.pop("KEY_CHUNK")
        constexprs["TMA"] = uses_tensor_descriptors(dtype, target)
        config = triton.Config(meta, num_warps=warps, num_stages=stages)
        return LaunchPlan(NAME, constexprs, (config,))
    if target.interpreter:
        config = triton.Config(INTERPRETER_BLOCKS, num_warps=4, num_stages=1)
        return LaunchPlan(NAME, constexprs, (config,))
    if max_q_len * group <= DECODE_ROWS:
        blocks = _decode_blocks(head_dim, dtype == torch.float32)
        warps, stages = blocks.pop("num_warps"), blocks.pop("num_stages")
        while blocks["BLOCK_N"] > 16 and not tile_fits(
            *blocks.values(), warps, stages, head_dim, dtype, target
        ):
            blocks["BLOCK_N"] //= 2  # e.g. sm_75's FMA dots: fewer keys per tile
        config = triton.Config(blocks, num_warps=warps, num_stages=stages)
        return LaunchPlan(NAME, constexprs, (config,))
    configs = tuple(c for c in _gpu_configs() if _fits(c, head_dim, dtype, target))
    constexprs["TMA"] = uses_tensor_descriptors(dtype, target)  # prefill only: see the docstring
    return LaunchPlan(NAME, constexprs, configs)


@functools.cache
def tuned_kernel():
    """The kernel under `triton.autotune`, built on first use (autotuning needs a GPU driver).

    The key holds the dot precision too: a tile tuned for TF32 dots is not the one for IEEE fp32.
    """
    return triton.autotune(
        configs=_gpu_configs(),
        key=[
            "q_len_bucket",
            "HEAD_DIM",
            "GROUP",
            "FP32_DOTS",
            "INPUT_PRECISION",
            "NUM_SPLITS",
            "TMA",
        ],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_flash_attention_kernel)


def _gpu_configs() -> list:
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)
        for bm, bn, warps, stages in TILES_16BIT + TILES_FP32
    ]


def _fits(config, head_dim: int, dtype, target: Target) -> bool:
    tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    if tile not in (TILES_FP32 if fma_dots(dtype, target) else TILES_16BIT):
        return False
    return tile_fits(*tile, head_dim, dtype, target)


def _prune_configs(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune: the tiles that fit this device (too big ones fail or spill)."""
    args = {**named_args, **kwargs}
    q = args["q_ptr"]
    keep = [c for c in configs if _fits(c, args["HEAD_DIM"], q.dtype, launch_target(q.device))]
    return keep or configs[-1:]


def _decode_blocks(head_dim: int, fp32_dots: bool) -> dict:
    """The decode tile: 16 rows (a GQA group), BLOCK_N keys of about KV_TILE_BYTES per K or V tile.

    16-bit: d 64 -> 64 keys, 128 -> 32, 256 -> 16; fp32 half that (at least 16, tl.dot's minimum).
    fp32 runs unpipelined: with 2 or 3 stages ptxas -v shows spills on sm_89 / sm_90 at some d, G.

    """
    element_bytes = 4 if fp32_dots else 2
    block_n = max(16, min(128, KV_TILE_BYTES // (head_dim * element_bytes)))
    return {"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 1 if fp32_dots else 2}
