"""Solutions to the exercises of notebook 12a (writing Triton kernels): three kernels, launched by the checks."""

# isort: off
import stagewise.kernels  # noqa: F401 - first: chooses the GPU or the CPU interpreter before any kernel is defined
import triton
import triton.language as tl

# isort: on


@triton.jit
def silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2*inter]: gate in columns [0, inter), up in [inter, 2*inter)
    out_ptr,  # [T, inter], contiguous
    inter,  # width of each half
    stride_in,  # elements between rows of gate_up
    BLOCK: tl.constexpr,  # columns per program, a power of two
):
    row = tl.program_id(0)  # one program per (row, column block)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter  # the last block runs past the end of the row
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    tl.store(out_ptr + row * inter + cols, out, mask=mask)



@triton.jit
def rmsnorm_kernel(
    x_ptr,  # [T, hidden], last dim contiguous
    weight_ptr,  # [hidden]
    out_ptr,  # [T, hidden], contiguous
    hidden,  # row width
    stride_x,  # elements between rows of x
    eps,  # added to the mean square
    BLOCK: tl.constexpr,  # next power of two >= hidden: the whole row in one block
):
    row = tl.program_id(0)  # one program per row
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden  # masked lanes are 0: they add nothing; divide by hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * tl.rsqrt(mean_square + eps) * w, mask=mask)



@triton.jit
def online_softmax_kernel(
    scores_ptr,  # [M, N] contiguous
    values_ptr,  # [N, d] contiguous
    out_ptr,  # [M, d] contiguous
    num_keys,  # N
    dim,  # d
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # next power of two >= d
):
    row = tl.program_id(0)  # one program per query row
    d = tl.arange(0, BLOCK_D)
    m = float("-inf")  # running max
    l = 0.0  # noqa: E741 - running sum of exp(s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp(s - m) * v
    for start in range(0, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        s = tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf"))
        v = tl.load(
            values_ptr + keys[:, None] * dim + d[None, :],
            mask=(keys < num_keys)[:, None] & (d < dim)[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        # the tile step
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)  # rescales everything summed so far
        p = tl.exp(s - m_new)  # [BLOCK_N]; masked keys give exp(-inf) = 0
        l = l * alpha + tl.sum(p, axis=0)  # noqa: E741
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + row * dim + d, acc / l, mask=d < dim)



SOLUTIONS = {
    "12a.silu_and_mul": silu_and_mul_kernel,
    "12a.rmsnorm": rmsnorm_kernel,
    "12a.online_softmax": online_softmax_kernel,
}
