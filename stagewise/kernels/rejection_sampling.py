"""Fused rejection sampling: every sequence's accept walk and its one draw, in one launch.

    draft_token_ids [num_draft], cu_num_draft_tokens [B + 1], draft_probs [num_draft, V] | None,
    target_probs [num_draft + B, V], is_greedy [B], uniform [num_draft],
    exponential [B, V] (a row per sequence) or [num_draft + B, V] (a row per target row)
    -> output_token_ids [B, max_k + 1] int64, num_output_tokens [B] int32

The rule is the stage's (stages/rejection_sampling.py). One program per
sequence b:

1. walk its k_b guesses while they survive. A sampling guess x costs two loads,
   p(x) and q(x) (q = 1 for a point mass), and the test u * q(x) < p(x); a greedy
   guess needs the argmax of its target row, one pass over the vocabulary in
   blocks of BLOCK tokens (first index on ties, as `torch.argmax`). Survivors are
   stored straight into the output row.
2. one pass over the stopping row (the first rejected position, or the bonus
   row when all survived), in blocks: the exponential race argmax w / E over the
   residual w = max(0, p - q) and, at the same time, over w = p (the fallback
   when the residual is zero everywhere, and the bonus draw), plus the plain
   argmax of p for a greedy row. The row's kind picks one of the three at the
   end, so the pass is the same for every row.

Exactness against the reference: the same float32 operations in the same
order per element (a subtraction, a product, a correctly rounded division:
`tl.div_rn`), and argmaxes that keep the first index, so the tokens and counts
are bit-for-bit those of the textbook loop. The block size changes nothing
(an argmax with first-index ties does not depend on how the row is cut).

No host synchronisation: the grid is B programs, the output's width comes from
`max_num_draft_tokens` when the caller passes it (the engine knows k); only
without it does the launcher read cu_num_draft_tokens once to find the widest
sequence. Counts stay on the device.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from stagewise.kernels.checks import (
    KernelInputError,
    check_contiguous,
    check_dim,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_shape,
)

NAME = "rejection_sampling"
BLOCK = 1024  # tokens per block of a pass over a vocabulary row (fp32: 4 KB in registers)


def block_for(vocab: int) -> int:
    """Tokens per block of a pass over the vocabulary: BLOCK, or the vocab rounded up to 2^n."""
    return min(BLOCK, triton.next_power_of_2(max(vocab, 16)))


@triton.jit
def _argmax_row(row_ptr, vocab, BLOCK: tl.constexpr):
    """The first index of the largest p in one row: a pass in blocks, earlier blocks win ties."""
    arange = tl.arange(0, BLOCK)
    best = float("-inf")
    token = 0
    for start in range(0, vocab, BLOCK):
        offs = start + arange
        p = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        block_max = tl.max(p, axis=0)
        block_arg = tl.min(tl.where(p == block_max, offs, vocab), axis=0)
        token = tl.where(block_max > best, block_arg, token)
        best = tl.maximum(best, block_max)
    return token


@triton.jit
def _rejection_sample_kernel(
    draft_ptr,  # [num_draft] int64: the guessed tokens, sequence after sequence
    cu_ptr,  # [B + 1] int32: seq b's guesses are draft[cu[b]:cu[b + 1]]
    q_ptr,  # [num_draft, V] float32 draft probabilities (unused when not HAS_Q)
    q_row_stride,  # elements between two rows of q
    p_ptr,  # [num_draft + B, V] float32 target probabilities: seq b's rows start at cu[b] + b
    p_row_stride,  # elements between two rows of p
    greedy_ptr,  # [B] uint8: 1 = greedy sequence
    uniform_ptr,  # [num_draft] float32 in [0, 1): one accept test per guess
    exp_ptr,  # [B, V] or [num_draft + B, V] float32 Exp(1) noise of the draws
    exp_seq_stride,  # per-sequence noise: elements between two rows; per-row noise: 0
    exp_pos_stride,  # per-row noise: elements between two rows; per-sequence noise: 0
    out_ptr,  # [B, out_width] int64 output, pre-filled with 0: accepted guesses, then one token
    out_row_stride,  # elements between two output rows
    count_ptr,  # [B] int32 output: accepted + 1
    vocab,  # V
    HAS_Q: tl.constexpr,  # draft probabilities given; else a point mass on each guess
    BLOCK: tl.constexpr,  # tokens per block of a vocabulary pass
):
    b = tl.program_id(0).to(tl.int64)
    start = tl.load(cu_ptr + b).to(tl.int64)
    num_drafts = tl.load(cu_ptr + b + 1).to(tl.int64) - start  # k_b
    greedy = tl.load(greedy_ptr + b) != 0
    p_first = p_ptr + (start + b) * p_row_stride  # this sequence's first target row

    # 1. the walk: accepted counts the survivors; it stops at the first rejection
    accepted = start - start  # an int64 scalar 0
    rejected = accepted != 0  # a scalar False of type i1
    while (accepted < num_drafts) & (rejected == 0):
        x = tl.load(draft_ptr + start + accepted)
        p_row = p_first + accepted * p_row_stride
        if greedy:
            ok = _argmax_row(p_row, vocab, BLOCK) == x
        else:
            p_x = tl.load(p_row + x)
            q_x = 1.0
            if HAS_Q:
                q_x = tl.load(q_ptr + (start + accepted) * q_row_stride + x)
            ok = tl.load(uniform_ptr + start + accepted) * q_x < p_x
        if ok:
            tl.store(out_ptr + b * out_row_stride + accepted, x)
            accepted += 1
        else:
            rejected = ok == 0

    # 2. the one draw, from the stopping row (rejected position or bonus row)
    p_row = p_first + accepted * p_row_stride
    exp_row = exp_ptr + b * exp_seq_stride + (start + b + accepted) * exp_pos_stride
    use_residual = rejected & (greedy == 0)
    # the rejected guess and its q row; index 0 (always there) stands in when there is none
    at = tl.where(use_residual, start + accepted, 0)
    x = tl.where(use_residual, tl.load(draft_ptr + at), -1)  # -1: matches no token
    q_row = q_ptr + at * q_row_stride
    arange = tl.arange(0, BLOCK)
    best_r, token_r = float("-inf"), 0  # race over the residual
    best_p, token_p = float("-inf"), 0  # race over p
    best_g, token_g = float("-inf"), 0  # plain argmax of p (greedy)
    for first in range(0, vocab, BLOCK):
        offs = first + arange
        inside = offs < vocab
        p = tl.load(p_row + offs, mask=inside, other=0.0)
        e = tl.load(exp_row + offs, mask=inside, other=1.0)
        if HAS_Q:
            q = tl.load(q_row + offs, mask=inside, other=0.0)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(offs == x, 0.0, p)
        score_r = tl.where(inside, tl.where(r > 0.0, tl.div_rn(r, e), -1.0), float("-inf"))
        score_p = tl.where(inside, tl.where(p > 0.0, tl.div_rn(p, e), -1.0), float("-inf"))
        plain = tl.where(inside, p, float("-inf"))
        m = tl.max(score_r, axis=0)
        arg = tl.min(tl.where(score_r == m, offs, vocab), axis=0)
        token_r = tl.where(m > best_r, arg, token_r)
        best_r = tl.maximum(best_r, m)
        m = tl.max(score_p, axis=0)
        arg = tl.min(tl.where(score_p == m, offs, vocab), axis=0)
        token_p = tl.where(m > best_p, arg, token_p)
        best_p = tl.maximum(best_p, m)
        m = tl.max(plain, axis=0)
        arg = tl.min(tl.where(plain == m, offs, vocab), axis=0)
        token_g = tl.where(m > best_g, arg, token_g)
        best_g = tl.maximum(best_g, m)
    # a residual with some r > 0 has a score >= 0; all -1 means it is zero everywhere: draw from p
    token = tl.where(use_residual & (best_r >= 0.0), token_r, token_p)
    token = tl.where(greedy, token_g, token)
    tl.store(out_ptr + b * out_row_stride + accepted, token.to(tl.int64))
    tl.store(count_ptr + b, (accepted + 1).to(tl.int32))


def rejection_sample(
    draft_token_ids: Tensor,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    is_greedy: Tensor,
    uniform: Tensor,
    exponential: Tensor,
    max_num_draft_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch one program per sequence -> (output_token_ids [B, max_k + 1], num_output_tokens [B]).

    Layouts: the 1-D inputs contiguous, the 2-D ones with a contiguous last dimension; float32
    probabilities and noise, int64 tokens, int32 offsets, bool greedy flags.
    """
    tensors = {
        "draft_token_ids": (draft_token_ids, 1, (torch.int64,)),
        "cu_num_draft_tokens": (cu_num_draft_tokens, 1, (torch.int32,)),
        "target_probs": (target_probs, 2, (torch.float32,)),
        "is_greedy": (is_greedy, 1, (torch.bool,)),
        "uniform": (uniform, 1, (torch.float32,)),
        "exponential": (exponential, 2, (torch.float32,)),
    }
    if draft_probs is not None:
        tensors["draft_probs"] = (draft_probs, 2, (torch.float32,))
    for name, (t, ndim, dtypes) in tensors.items():
        check_dim(NAME, name, t, ndim)
        check_dtype(NAME, name, t, dtypes)
        (check_contiguous if ndim == 1 else check_last_dim_contiguous)(NAME, name, t)
    check_same_device(NAME, **{name: t for name, (t, _, _) in tensors.items()})
    num_seqs, num_draft, vocab = is_greedy.shape[0], draft_token_ids.shape[0], target_probs.shape[1]
    check_shape(NAME, "cu_num_draft_tokens", cu_num_draft_tokens, (num_seqs + 1,))
    check_shape(NAME, "target_probs", target_probs, (num_draft + num_seqs, vocab))
    check_shape(NAME, "uniform", uniform, (num_draft,))
    per_row = num_draft > 0 and exponential.shape[0] == num_draft + num_seqs
    if not per_row:
        check_shape(NAME, "exponential", exponential, (num_seqs, vocab))
    check_shape(NAME, "exponential", exponential, (exponential.shape[0], vocab))
    if draft_probs is not None:
        check_shape(NAME, "draft_probs", draft_probs, (num_draft, vocab))
    if max_num_draft_tokens is None:  # the widest sequence: one read of the offsets (a sync)
        widths = cu_num_draft_tokens[1:] - cu_num_draft_tokens[:-1]
        max_num_draft_tokens = int(widths.max()) if num_seqs else 0
    if max_num_draft_tokens < 0:
        raise KernelInputError(
            f"{NAME}: max_num_draft_tokens must be >= 0, got {max_num_draft_tokens}"
        )
    device = target_probs.device
    out = torch.zeros(num_seqs, max_num_draft_tokens + 1, dtype=torch.int64, device=device)
    counts = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    if num_seqs == 0:
        return out, counts
    # an empty tensor has no storage to point at: give the kernel a one-element stand-in
    draft = draft_token_ids if num_draft else torch.zeros(1, dtype=torch.int64, device=device)
    uni = uniform if num_draft else torch.zeros(1, dtype=torch.float32, device=device)
    # unread without HAS_Q
    q = draft_probs if draft_probs is not None and num_draft else target_probs
    _rejection_sample_kernel[(num_seqs,)](
        draft_ptr=draft,
        cu_ptr=cu_num_draft_tokens,
        q_ptr=q,
        q_row_stride=q.stride(0),
        p_ptr=target_probs,
        p_row_stride=target_probs.stride(0),
        greedy_ptr=is_greedy.view(torch.uint8),
        uniform_ptr=uni,
        exp_ptr=exponential,
        exp_seq_stride=0 if per_row else exponential.stride(0),
        exp_pos_stride=exponential.stride(0) if per_row else 0,
        out_ptr=out,
        out_row_stride=out.stride(0),
        count_ptr=counts,
        vocab=vocab,
        HAS_Q=draft_probs is not None and num_draft > 0,
        BLOCK=block_for(vocab),
    )
    return out, counts
