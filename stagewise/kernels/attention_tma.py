"""Tensor descriptors for attention's K/V tiles: sm_90's TMA engine instead of per-thread pointers.

A pointer load makes every thread compute BLOCK_N * d / (32 * num_warps) addresses per tile and
issue the loads itself; the tile then passes through registers on its way to shared memory, where
sm_90's `wgmma` wants K and V (attention_common.tile_fits). A tensor descriptor
(`tl.make_tensor_descriptor`, Triton >= 3.4) describes a 2-D view once, (base, shape, strides),
and `desc.load([row, 0])` asks the TMA (tensor memory accelerator) for a [BLOCK_N, d] box: one
thread issues one copy, the hardware writes the box into shared memory and fills rows past the
view's shape with zeros. For Llama-3-8B prefill in bf16 (d 128, tile 128 x 64, 8 warps) a K tile is
64 * 128 * 2 = 16 KB that no thread addresses, and ptxas reports 166 registers per thread instead
of the pointer path's 220 (benchmarks/compile_gate.md).

Here a program makes one descriptor for K and one for V: its KV head's rows of its sequence,
[k_len, d], starting at the sequence's first key, so tiles that run past the sequence's keys read
zeros, as the pointer path's masked loads (`other=0.0`) do. A descriptor made in a kernel is
written to a global-memory workspace (128 bytes per descriptor and program) that Triton asks the
allocator set by `triton.set_allocator` for at each launch: `descriptor_workspace`.

TMA needs what it describes 16-byte aligned, with row strides of a multiple of 16 bytes
(`descriptors_fit`); only sm_90 with 16-bit tensor-core dots gets descriptors
(`uses_tensor_descriptors`). sm_80 / sm_89 (`mma.sync` reads its operands from registers, and
there is no TMA) and fp32 (FMA dots) keep the pointer loads, and so does the CPU interpreter by
default, although Triton 3.9's interpreter runs descriptor loads too (the tests force them there).
"""

import torch
import triton
import triton.language as tl

from stagewise.kernels.attention_common import M_INIT, attend_tile, merge_states
from stagewise.kernels.targets import Target, fma_dots

HAS_TENSOR_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


@triton.jit
def kv_descriptor(
    head_ptr,  # [Tk, d] view: row 0 of one KV head of k or v, last dim contiguous
    first_row,  # the sequence's first key row
    k_len,  # the sequence's keys: rows past them load as zeros
    stride_row,  # elements between consecutive key rows
    BLOCK_N: tl.constexpr,  # keys per box
    HEAD_DIM: tl.constexpr,  # d
    INT64_OFFSETS: tl.constexpr,  # first_row * stride_row may pass 2^31
):
    """One sequence's keys (or values) of one KV head: a [k_len, d] view, boxes [BLOCK_N, d]."""
    if INT64_OFFSETS:
        first_row = first_row.to(tl.int64)
    return tl.make_tensor_descriptor(
        head_ptr + first_row * stride_row,
        shape=[k_len, HEAD_DIM],
        strides=[stride_row, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
    )


@triton.jit
def attend_keys_tma(
    acc,  # [BLOCK_M, HEAD_DIM] fp32 running sum of p * v
    m_i,  # [BLOCK_M] fp32 running max of the scores (base-2 units)
    l_i,  # [BLOCK_M] fp32 running sum of p
    q,  # [BLOCK_M, HEAD_DIM] the query tile
    query,  # [BLOCK_M] each row's query within the sequence
    row_ok,  # [BLOCK_M] bool: the row exists
    k_desc,  # descriptor [k_len, HEAD_DIM] of the sequence's keys of this KV head (kv_descriptor)
    v_desc,  # descriptor [k_len, HEAD_DIM] of its values
    k_len,  # the sequence's keys
    shift,  # k_len - q_len: query i sees keys j <= i + shift
    n_lo,  # first key to visit
    n_hi,  # end of the keys to visit
    qk_scale,  # softmax scale * log2(e)
    BLOCK_N: tl.constexpr,  # keys per tile
    MASKED: tl.constexpr,  # the causal and length masks (False: every row sees every key)
    FP32_DOTS: tl.constexpr,  # convert tiles to fp32 after the load
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32" for fp32 tiles (precision.py)
):
    """`attend_keys` for contiguous K/V with each tile one descriptor load: same keys, same sums.

    Keys past k_len come back as zeros (the descriptor's shape ends there) and the mask hides
    them, as the pointer path's `other=0.0` does.
    """
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k = k_desc.load([n0, 0])  # [BLOCK_N, HEAD_DIM]
        v = v_desc.load([n0, 0])
        if MASKED:
            pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions within the sequence
            visible = (pos[None, :] <= query[:, None] + shift) & (pos < k_len)[None, :]  # [BM, BN]
        else:
            visible = row_ok[:, None]  # unread
        if FP32_DOTS:
            k, v = k.to(tl.float32), v.to(tl.float32)
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, k, v, visible, qk_scale, MASKED, INPUT_PRECISION
        )
    return acc, m_i, l_i


@triton.jit
def attend_chunks_tma(
    q, query, row_ok, k_desc, v_desc, k_len, shift, lo, mid, hi, qk_scale,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_CHUNK: tl.constexpr, FP32_DOTS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`attention_common.attend_chunks` with descriptor loads: the keys [lo, hi) in chunks of
    KEY_CHUNK, each from an empty state, merged in order -> (acc, m, l). Same keys, same sums."""
    acc_t = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_t = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_t = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(lo, hi, KEY_CHUNK):
        c1 = tl.minimum(c0 + KEY_CHUNK, hi)
        whole = tl.maximum(c0, tl.minimum(mid, c1))  # [c0, whole): every row sees these keys
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = attend_keys_tma(
            acc, m_i, l_i, q, query, row_ok, k_desc, v_desc, k_len, shift, c0, whole, qk_scale,
            BLOCK_N, False, FP32_DOTS, INPUT_PRECISION,
        )  # fmt: skip
        acc, m_i, l_i = attend_keys_tma(
            acc, m_i, l_i, q, query, row_ok, k_desc, v_desc, k_len, shift, whole, c1, qk_scale,
            BLOCK_N, True, FP32_DOTS, INPUT_PRECISION,
        )  # fmt: skip
        acc_t, m_t, l_t = merge_states(acc_t, m_t, l_t, acc, m_i, l_i)
    return acc_t, m_t, l_t


def descriptors_fit(*tensors: torch.Tensor) -> bool:
    """What a TMA descriptor asks of the memory it describes: a 16-byte aligned start and row
    strides of a multiple of 16 bytes (here: every stride but the contiguous last one)."""
    for t in tensors:
        strides = [s * t.element_size() for s in t.stride()[:-1]]
        if t.data_ptr() % 16 or any(s % 16 for s in strides):
            return False
    return True


def descriptor_workspace(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors a kernel builds (128 bytes each per program), which
    Triton asks for at every launch of such a kernel; the caching allocator makes it cheap."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def uses_tensor_descriptors(dtype: torch.dtype, target: Target) -> bool:
    """K/V tiles through descriptors: sm_90 with tensor-core (16-bit) dots, where wgmma reads K
    and V straight from the shared memory TMA fills, and a Triton that has them."""
    return (
        HAS_TENSOR_DESCRIPTORS
        and not target.interpreter
        and target.capability == 90
        and not fma_dots(dtype, target)
    )
