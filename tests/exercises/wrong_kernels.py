"""Wrong Triton kernels for 12a's exercises: each is the solution with the mistake its name says.

Each keeps the stub's parameters, so the check launches it; tests/exercises/test_kernel_checks.py
holds that every one reads FAIL (never crashes the process).
"""

# isort: off
import stagewise.kernels  # noqa: F401 - first: chooses the GPU or the CPU interpreter before any kernel is defined
import triton
import triton.language as tl

# isort: on


@triton.jit
def silu_mask_past_the_row(gate_up_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < 2 * inter  # the mask: twice the half it indexes, so it runs past the row
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=mask)


@triton.jit
def silu_without_masks(gate_up_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    gate = tl.load(gate_up_ptr + row * stride_in + cols).to(tl.float32)  # the last block reads past the half
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=cols < inter)


@triton.jit
def silu_rows_assumed_contiguous(gate_up_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    start = row * 2 * inter  # assumes the rows are 2 * inter apart: wrong for a view of a wider tensor
    gate = tl.load(gate_up_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + start + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, gate / (1.0 + tl.exp(-gate)) * up, mask=mask)


@triton.jit
def silu_store_unmasked(gate_up_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, gate / (1.0 + tl.exp(-gate)) * up)  # writes the masked lanes too


@triton.jit
def rmsnorm_mean_over_the_block(x_ptr, weight_ptr, out_ptr, hidden, stride_x, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / BLOCK  # divides by the block, not by hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * tl.rsqrt(mean_square + eps) * w, mask=mask)


@triton.jit
def rmsnorm_unmasked_load(x_ptr, weight_ptr, out_ptr, hidden, stride_x, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)  # the masked lanes read what lies after the row
    mean_square = tl.sum(x * x, axis=0) / hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * tl.rsqrt(mean_square + eps) * w, mask=mask)


@triton.jit
def rmsnorm_rows_assumed_contiguous(x_ptr, weight_ptr, out_ptr, hidden, stride_x, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)  # ignores stride_x
    mean_square = tl.sum(x * x, axis=0) / hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * tl.rsqrt(mean_square + eps) * w, mask=mask)


@triton.jit
def softmax_without_rescale(
    scores_ptr, values_ptr, out_ptr, num_keys, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    m = float("-inf")
    l = 0.0  # noqa: E741
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        s = tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf"))
        v = tl.load(
            values_ptr + keys[:, None] * dim + d[None, :],
            mask=(keys < num_keys)[:, None] & (d < dim)[None, :],
            other=0.0,
        )
        m = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m)
        l = l + tl.sum(p, axis=0)  # noqa: E741 - forgets alpha: the old sums keep the old max
        acc = acc + tl.sum(p[:, None] * v, axis=0)
    tl.store(out_ptr + row * dim + d, acc / l, mask=d < dim)


@triton.jit
def softmax_whole_row_at_once(
    scores_ptr, values_ptr, out_ptr, num_keys, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, 512)  # no tiles: a block wide enough for the whole row (softmax(s) @ v in one go)
    s = tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf"))
    v = tl.load(
        values_ptr + keys[:, None] * dim + d[None, :], mask=(keys < num_keys)[:, None] & (d < dim)[None, :], other=0.0
    )
    p = tl.exp(s - tl.max(s, axis=0))
    tl.store(out_ptr + row * dim + d, tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0), mask=d < dim)


@triton.jit
def softmax_in_two_passes(scores_ptr, values_ptr, out_ptr, num_keys, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    m = float("-inf")
    for start in range(0, num_keys, BLOCK_N):  # pass 1: the max of the row
        keys = start + tl.arange(0, BLOCK_N)
        m = tl.maximum(
            m, tl.max(tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf")), axis=0)
        )
    l = 0.0  # noqa: E741
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, num_keys, BLOCK_N):  # pass 2: every score read again
        keys = start + tl.arange(0, BLOCK_N)
        p = tl.exp(tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf")) - m)
        v = tl.load(
            values_ptr + keys[:, None] * dim + d[None, :],
            mask=(keys < num_keys)[:, None] & (d < dim)[None, :],
            other=0.0,
        )
        l = l + tl.sum(p, axis=0)  # noqa: E741
        acc = acc + tl.sum(p[:, None] * v, axis=0)
    tl.store(out_ptr + row * dim + d, acc / l, mask=d < dim)


@triton.jit
def softmax_far_out_of_bounds(
    scores_ptr, values_ptr, out_ptr, num_keys, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    # a pointer bug: rows 2^20 elements apart, far past any guard band (the interpreter must stop it)
    s = tl.load(scores_ptr + row * 1048576 + tl.arange(0, BLOCK_N))
    tl.store(out_ptr + row * dim + d, tl.zeros([BLOCK_D], dtype=tl.float32) + tl.sum(s, axis=0), mask=d < dim)
