"""Split-K for decode attention (flash decoding): when to split, and how the pieces merge.

A decode step has one query per sequence. Paged attention gives one program
per (sequence, KV head), so 2 long sequences x 8 KV heads = 16 programs on a
GPU with 132 SMs: most of the chip idles while 16 programs walk thousands of
keys. Split-K cuts each sequence's keys into NUM_SPLITS ranges, one program
per range. Program s ends with the online-softmax state of its own keys,

    m_s (max score), l_s = sum exp(x - m_s), acc_s = sum exp(x - m_s) v     (base 2 in the kernels)

and the states merge exactly, like steps of the online softmax, one split
after another in the order 0, 1, ... (attention_common.merge_states):

    m = max(m, m_s),   l = l 2^(m_old - m) + l_s 2^(m_s - m),   acc likewise;   out = acc / l

A split that saw no key has l_s = 0 and acc_s = 0 and changes nothing; a row
with no key anywhere keeps l = 0 and gets 0. The order is fixed, so the same
partials always give the same bits, and batch-invariant attention merges the
same way inside a program that walks every chunk itself: splitting or not is
then a matter of speed only.
"""

import functools

import torch
import triton
import triton.language as tl

from stagewise.kernels.attention_common import M_INIT
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.plan_cache import plan_cache
from stagewise.kernels.targets import LaunchPlan, fixed_plan

MIN_KEYS_PER_SPLIT = 256  # below this, a split's fixed cost (partials, reduce) outweighs its keys
MAX_SPLITS = 16  # bounds the partial buffers and the reduce's work
PROGRAMS_PER_SM = 2  # aim: about two programs per SM, so none idles while another finishes


@triton.jit
def _split_k_reduce_kernel(
    acc_part_ptr,  # [T, H, NUM_SPLITS, d] fp32 unnormalised partial outputs
    m_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running max (base-2 units)
    l_part_ptr,  # [T, H, NUM_SPLITS] fp32 partial running sum
    out_ptr,  # [T, H, d] output
    NUM_SPLITS,  # partials per row, merged in the order 0, 1, ...
    stride_a_token,  # elements between consecutive tokens of acc_part
    stride_a_head,  # elements between consecutive heads of acc_part
    stride_a_split,  # elements between consecutive splits of acc_part
    stride_ml_token,  # elements between consecutive tokens of m_part / l_part
    stride_ml_head,  # elements between consecutive heads of m_part / l_part
    stride_o_token,  # elements between consecutive output tokens
    stride_o_head,  # elements between consecutive output heads
    HEAD_DIM: tl.constexpr,  # d
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    a_row = acc_part_ptr + token * stride_a_token + head * stride_a_head + dims  # [HEAD_DIM]
    ml_row = token * stride_ml_token + head * stride_ml_head
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)  # the merged state, from empty
    m = tl.full([], M_INIT, dtype=tl.float32)
    l_i = tl.zeros([], dtype=tl.float32)
    for s in range(NUM_SPLITS):  # the operations of attention_common.merge_states, per row
        m_s = tl.load(m_part_ptr + ml_row + s)
        l_s = tl.load(l_part_ptr + ml_row + s)
        acc_s = tl.load(a_row + s * stride_a_split)  # [HEAD_DIM]
        m_new = tl.maximum(m, m_s)
        w_a = tl.math.exp2(m - m_new)
        w_b = tl.math.exp2(m_s - m_new)
        l_i = tl.fma(l_i, w_a, l_s * w_b)
        acc = tl.fma(acc, w_a, acc_s * w_b)
        m = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw no key: acc == 0, l == 0 -> 0
    o_ptrs = out_ptr + token * stride_o_token + head * stride_o_head + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


def split_k_reduce(
    acc_part: torch.Tensor, m_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor
) -> None:
    """acc_part [T, H, S, d], m_part / l_part [T, H, S] fp32 (the split kernel's) -> out [T, H, d].

    out is written in place.
    """

    num_tokens, num_heads, num_splits, head_dim = acc_part.shape
    if num_tokens == 0:
        return
    _split_k_reduce_kernel[(num_tokens, num_heads)](
        acc_part_ptr=acc_part,
        m_part_ptr=m_part,
        l_part_ptr=l_part,
        out_ptr=out,
        stride_a_token=acc_part.stride(0),
        stride_a_head=acc_part.stride(1),
        stride_a_split=acc_part.stride(2),
        stride_ml_token=m_part.stride(0),
        stride_ml_head=m_part.stride(1),
        stride_o_token=out.stride(0),
        stride_o_head=out.stride(1),
        NUM_SPLITS=num_splits,
        **split_k_reduce_options(head_dim),
    )


def partial_buffers(out: torch.Tensor, num_splits: int) -> tuple:
    """Where an attention kernel writes: (target, m_part, l_part, stride_o_split, stride_ml).

    Unsplit, the kernel writes `out` [T, H, d] itself and never touches the partials; split, fp32
    partials [T, H, S, d] and [T, H, S], which `split_k_reduce` then merges into `out`.
    """
    if num_splits == 1:
        return out, out, out, 0, (0, 0)
    num_tokens, num_heads, head_dim = out.shape
    f32 = dict(dtype=torch.float32, device=out.device)
    acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, **f32)  # [T, H, S, d]
    m_part = torch.empty(num_tokens, num_heads, num_splits, **f32)  # [T, H, S]
    return acc, m_part, torch.empty_like(m_part), acc.stride(2), m_part.stride()[:2]


def num_sms(device: torch.device) -> int | None:
    """The streaming multiprocessors of a CUDA device; None in the CPU interpreter (kept per
    device: launchers ask on every call, and reading the device's properties is not free)."""
    if device.type != "cuda":
        return None
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(num_programs: int, max_seq_len: int, sms: int | None) -> int:
    """How many programs share one (query tile, sequence, KV head)'s keys; 1 = no split.

    Split only when the unsplit grid leaves SMs idle and the keys are long
    enough that each split still gets MIN_KEYS_PER_SPLIT of them. On the CPU
    interpreter (sms None) programs run one after another, so splitting only adds work.
    """
    if sms is None or num_programs >= sms:
        return 1
    by_occupancy = -(-PROGRAMS_PER_SM * sms // num_programs)  # ceil division
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    splits = min(MAX_SPLITS, by_occupancy, by_length)
    return splits if splits >= 2 else 1


MAX_CHUNK_SPLITS = 64  # batch-invariant: at most this many one-chunk programs, else one walks all


def chunk_splits(
    num_programs: int, max_seq_len: int, sms: int | None, key_chunk: int, asked: int | None
) -> int:
    """Batch-invariant split-K: 1 (each program walks all its chunks of `key_chunk` keys) or one
    program per chunk, cdiv(max_seq_len, key_chunk). Both merge the same chunk states in the same
    order (attention_common.attend_chunks), so occupancy may choose (`choose_num_splits`) without
    changing a bit. `asked`: the caller's count, 1 or at least one program per chunk.
    """
    chunks = -(-max_seq_len // key_chunk)
    if asked is None:
        wanted = choose_num_splits(num_programs, max_seq_len, sms) > 1
        return chunks if wanted and 1 < chunks <= MAX_CHUNK_SPLITS else 1
    if asked != 1 and asked < chunks:
        raise KernelInputError(
            f"attention: batch-invariant split-K gives each program {key_chunk} keys; "
            f"num_splits={asked} cannot cover {max_seq_len} keys (1 or >= {chunks})"
        )
    return asked


@plan_cache
def split_k_reduce_options(head_dim: int) -> dict:
    """`split_k_reduce_plan`'s launch kwargs, kept per d."""
    return split_k_reduce_plan(head_dim).launch_options()


def split_k_reduce_plan(head_dim: int) -> LaunchPlan:
    """One program per (token, head) merges its NUM_SPLITS partials, a [HEAD_DIM] fp32 row each.

    (The dtype checks are the attention launcher's.)
    """
    return fixed_plan("split_k_reduce", {"HEAD_DIM": head_dim}, num_warps=1)
