# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python (stagewise)
#     language: python
#     name: stagewise
# ---


# %% [markdown]
# # 12a · Triton kernels: reading them, then writing three
#
# Every stage in `stagewise.stages` has tiers with one signature: a **naive**
# PyTorch reference, the textbook formula written to be read; a **triton**
# tier that launches a kernel from `stagewise/kernels/`; for some, a **torch**
# tier, a faster PyTorch form for CPUs (`*_torch.py`). This notebook and 12b
# (attention, split-K, every stage checked and measured) connect the two.
#
# The kernels move fewer bytes between memory and the compute units
# (notebook 11: most of inference is memory-bound): **fusion** (intermediates
# never go back to memory), **tiling** (each loaded GEMM tile reused many
# times), the **online softmax** (no `[N, N]` score matrix), **indirection**
# (K/V through a block table and a slot mapping) and **no sort** (sampling
# thresholds found by counting).
#
# On an NVIDIA GPU the kernels are compiled. Without one, `import
# stagewise.kernels` switches Triton to its **CPU interpreter**
# (`TRITON_INTERPRET=1`): the same kernel code, every program instance run in
# Python, a real correctness check, orders of magnitude slower. **Interpreter
# timings say nothing about kernel speed.**
#
# Path: the registry -> what each kernel changes -> the online softmax in
# numbers -> how to read a kernel -> two kernels read line by line and
# checked -> **you write three kernels** (`silu_and_mul`, `rmsnorm`, the
# online softmax's tile step), checked, and timed on a GPU when there is one.
# Tiny shapes throughout: quick mode (`STAGEWISE_NOTEBOOK_QUICK=1`) changes
# nothing. The one notebook that defines Triton kernels (`@triton.jit`): the
# exercises are kernels; every other kernel is only read here.

# %%
import os

os.environ.setdefault("STAGEWISE_QUIET", "1")  # this cell prints where Triton runs
import torch  # noqa: E402

# isort: off
import stagewise.kernels  # first: decides GPU or interpreter before any kernel is defined
import triton  # after stagewise.kernels, which sets TRITON_INTERPRET=1 when there is no GPU
import triton.language as tl

# isort: on
from stagewise.config import PRESETS
from stagewise.kernels import activation as activation_kernels
from stagewise.kernels import rmsnorm as rmsnorm_kernels
from stagewise.kernels.attention_common import online_softmax_reference
from stagewise.kernels.targets import launch_target
from stagewise.stages import STAGES
from stagewise.stages.ffn import silu_and_mul_naive
from stagewise.viz.kernels import online_softmax_state
from stagewise.viz.kernels import show_source as show

# %matplotlib inline

ON_GPU = stagewise.kernels.TRITON_MODE == "cuda"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
print(f"Triton runs on: {stagewise.kernels.TRITON_MODE}" + ("" if ON_GPU else " (correctness only, not speed)"))
config, smol = PRESETS["tiny"], PRESETS["smollm2-135m"]  # tiny: shapes the interpreter runs in seconds

# %% [markdown]
# ## 1. The registry: one row per stage
#
# `STAGES` maps each stage name to its tiers (`naive`, `triton`, and `torch`
# where a CPU needs one), its shapes and a one-line description of what the
# `triton` tier is.

# %%
for name, stage in STAGES.items():
    print(f"{name:>15}  {stage.shapes:<66} {stage.triton_kind}")


# %% [markdown]
# ## 2. What each kernel changes
#
# The row and element-wise kernels (12b adds the GEMMs, attention and sampling):
#
# * **embedding** (`kernels/embedding.py`): wide, masked copies of a tile of
#   token rows per program. A pure copy, 0 FLOPs: only bandwidth matters.
# * **rmsnorm** (`kernels/rmsnorm.py`): residual add and norm **fused**, one
#   program per row; the row stays in registers (4 row passes instead of 5,
#   one launch instead of two).
# * **rope** (`kernels/rope.py`): in place on the strided q/k views of the
#   fused QKV output: read once, written once, nothing allocated.
# * **kv_store** (`kernels/kv_store.py`): one scatter through `slot_mapping`,
#   K and V in one launch; the slot hides whether the cache is paged.
# * **ffn** (`kernels/matmul.py`, `kernels/activation.py`): tiled GEMMs and a
#   **fused** `silu(gate) * up`: `[T, 2*inter]` read once, `[T, inter]`
#   written once.
#
# ### The online softmax, the one idea worth seeing in numbers
#
# Softmax needs a row's max and sum before any probability is known, which
# seems to require the whole row of scores. The online version walks the keys
# a tile at a time, keeping a running max `m`, a running sum `l` and a running
# output `acc`, and rescales both by `exp(m_old - m_new)` whenever the max
# grows. `kernels/attention_common.py` ships that loop in plain PyTorch
# (`online_softmax_reference`) next to the kernels' tile step: it equals the
# full softmax for any tile size.

# %%
g = torch.Generator().manual_seed(0)
scores = 4 * torch.randn(5, 100, generator=g)  # [M queries, N keys]
values = torch.randn(100, 16, generator=g)  # [N, d]
full = torch.softmax(scores.double(), dim=-1) @ values.double()  # needs all N scores of a row at once
for block_n in (1, 7, 16, 64, 100):
    tiled = online_softmax_reference(scores, values, block_n)
    print(f"tiles of {block_n:>3} keys: max |online - full| = {float((tiled - full).abs().max()):.1e}")

# %% [markdown]
# Only the order of the additions differs, so the results agree to float64
# rounding. In the kernel a tile of scores lives only in registers; the
# `[N, N]` matrices never reach memory, only Q, K, V (re-read once per query
# tile) and out.


# %% [markdown]
# ## 3. Reading the kernels
#
# A Triton kernel is a Python function that describes what **one program
# instance** does; the launcher starts a grid of them. Four ideas are enough
# to read every kernel in `stagewise/kernels/`:
#
# * **program ids** — `tl.program_id(axis)` says which instance this is along
#   each axis of the launch grid, `kernel[grid](...)`. The kernel turns it
#   into the piece of the output it owns: a row, a tile of `c`, a tile of
#   queries of one sequence and one KV head.
# * **pointers and strides** — a tensor arrives as a pointer to its first
#   element (`x_ptr`) plus, for each dimension, a **stride**: how many
#   elements to step to move one index along it. Element `[i, j]` of `x` is at
#   `x_ptr + i * stride_0 + j * stride_1`. With strides a kernel reads a
#   column slice or a transposed view in place, without a copy.
# * **blocks** — `tl.arange(0, BLOCK)` is a vector of offsets; adding it to a
#   pointer gives a vector (or, with `[:, None]` and `[None, :]`, a 2-D tile) of
#   addresses, and one `tl.load` fetches them all. Block sizes are
#   `tl.constexpr`: fixed when the kernel is compiled, powers of two.
# * **masks** — the last block of a row or a matrix runs past the end. `mask=`
#   switches those lanes off (`other=` is what a masked load returns), so any
#   size works with power-of-two blocks. Nothing checks bounds for you.
#
# Below, two kernels printed from their files (never copied here), each with
# what to look at and a check against the naive stage on small irregular
# shapes.

# %% [markdown]
# ### 3.1 RMSNorm: one program per row
#
# The simplest shape of kernel: the grid is `(T,)`, one program per token row,
# and the whole row fits in one block.

# %%
show(rmsnorm_kernels._rmsnorm_kernel)

# %% [markdown]
# What to look at:
#
# * `row = tl.program_id(0)`: the grid has one axis of `T` programs; program
#   `row` owns row `row`. It is cast to int64 because `row * stride` can pass
#   2^31 on large batches.
# * `x_ptr + row * x_row_stride + cols`: the row's `BLOCK_SIZE` addresses. The
#   row stride is passed, not assumed, so `x` may be a view whose rows are
#   further apart than `hidden`; the last dimension must be contiguous (the
#   launcher checks it), which is why `cols` is added with stride 1.
# * `mask = cols < hidden`: `BLOCK_SIZE` is the next power of two of `hidden`.
#   The masked lanes load 0 (`other=0.0`) and so add nothing to the sum of
#   squares; they are not stored.
# * `HAS_RESIDUAL` is a `tl.constexpr`: the kernel is compiled once per value,
#   and the version without the residual has no trace of that branch.
#
# The launcher's plan for this model's row and for the tiny config's:

# %%
here = launch_target(DEVICE)
for hidden in (smol.hidden_size, config.hidden_size):
    plan = rmsnorm_kernels.rmsnorm_plan(hidden, True).launch_options()
    idle = 1 - hidden / plan["BLOCK_SIZE"]
    print(f"hidden {hidden}: BLOCK_SIZE {plan['BLOCK_SIZE']} ({idle:.0%} of the lanes masked), "
          f"num_warps {plan['num_warps']} (on {here.name})")  # fmt: skip

g = torch.Generator().manual_seed(1)
for rows, hidden in ((1, 48), (5, 96), (3, 100)):  # widths that are no power of two
    x, res = (torch.randn(rows, hidden, generator=g).to(DEVICE) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE)
    ref_out, ref_res = STAGES["rmsnorm"].naive(x=x, weight=w, eps=1e-5, residual=res)
    out, new_res = rmsnorm_kernels.rmsnorm(x, w, 1e-5, res)
    err = max(float((out - ref_out).abs().max()), float((new_res - ref_res).abs().max()))
    print(f"T={rows}, hidden={hidden}: {rows} programs, max |kernel - naive| = {err:.1e}")

# %% [markdown]
# ### 3.2 silu_and_mul: a 2-D grid of tiles, and two loads from one row
#
# The FFN's fused gate/up GEMM writes `gate` and `up` side by side in one row
# of `[T, 2 * inter]`. The kernel's program `(i, j)` owns a tile of
# `BLOCK_T` rows and `BLOCK_C` columns of the output; it loads the gate tile
# and, `inter` columns further along the same rows, the up tile.

# %%
show(activation_kernels._silu_and_mul_kernel, start="rows = tl.program_id(0)")

# %% [markdown]
# What to look at:
#
# * two program ids: axis 0 walks row tiles, axis 1 column tiles; the launch
#   grid is `(cdiv(T, BLOCK_T), cdiv(inter, BLOCK_C))`.
# * `mask` is 2-D: `(rows < num_tokens)[:, None] & (cols < inter)[None, :]`,
#   so a tile hanging over the bottom or the right edge neither reads nor
#   writes past it.
# * `gate_ptrs + inter`: the up half is the same addresses shifted by
#   `inter` elements. One tensor, two loads, no slicing on the host.
# * the arithmetic happens in fp32 (`.to(tl.float32)`) and is cast to the
#   output's dtype only at the store.

# %%
for tokens, inter in ((1, 24), (5, 100)):
    gate_up = torch.randn(tokens, 2 * inter, generator=g).to(DEVICE)
    err = float((activation_kernels.silu_and_mul(gate_up) - silu_and_mul_naive(gate_up)).abs().max())
    print(f"T={tokens}, inter={inter}: max |kernel - naive| = {err:.1e}")

# %% [markdown]
# ### The picture: the online softmax's state, tile by tile
#
# What the third kernel you write (below) keeps while it walks a row of
# scores: the running max `m` (it only grows), the factor `alpha = exp(m_old
# - m_new)` by which everything summed so far is rescaled when it does, and
# the running sum `l`. A row whose scores rise to the right makes every tile
# rescale.

# %%
row = torch.linspace(-6, 6, 40) + 0.5 * torch.randn(40, generator=g)  # scores of one query, rising
online_softmax_state(row, block_n=8)  # stagewise/viz/kernels.py: the tile step in plain Python, drawn

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# The same jobs in vLLM v0.11.0 (CUDA kernels there, Triton here):
#
# * `vllm/model_executor/layers/activation.py`, class `SiluAndMul`: its
#   `forward_native` is the naive stage, its `forward_cuda` calls the fused
#   `silu_and_mul` kernel (`csrc/activation_kernels.cu`).
# * `vllm/model_executor/layers/layernorm.py`, class `RMSNorm`: `forward_cuda`
#   calls `rms_norm`, or `fused_add_rms_norm` when a residual comes along
#   (`csrc/layernorm_kernels.cu`) — the fusion of section 3.1.
# * `vllm/attention/ops/triton_unified_attention.py`, `kernel_unified_attention_2d`:
#   vLLM's own Triton attention kernel, the online softmax over paged K/V
#   (notebook 12b reads ours).
#
# ## Takeaways
#
# * A kernel describes one program instance; the grid says how many run. The
#   program ids pick the piece of the output a program owns: a row, a tile.
# * Pointers plus strides address any view in place; blocks are power-of-two
#   vectors of offsets and masks switch off what lies past the edge, with
#   `other=` chosen so the masked lanes change nothing (0 in a sum, -inf in a
#   max).
# * Element-wise kernels (silu_and_mul) and row reductions (rmsnorm) read each
#   byte once and write each result once: the fusion is in not going back to
#   memory in between. The online softmax carries `(m, l, acc)` across tiles,
#   so a row of scores never has to exist whole.
# * The interpreter runs the very same kernel code on a CPU: it proves a
#   kernel right, not fast.
#
# ## Exercises
#
# Each task is a Triton kernel to complete and a check cell below it. Fill in
# the lines marked `TODO` and delete each mark once its line is done. The check
# takes the kernel itself and launches it the way the package's launchers do
# (interpreted on a CPU, compiled on a GPU), on tensors of irregular sizes that
# it owns; nothing but your kernel can write the result. Around every input,
# and between the rows of a strided one, it puts NaN, and around the output a
# sentinel: a load that your mask should have switched off reads NaN, a store
# past the edge is found, and (in the interpreter) an access far outside every
# tensor is stopped before it happens. So a wrong mask prints **FAIL**, never
# stops the notebook. It prints **not yet** while `TODO` marks are left.
# Solutions: `notebooks/solutions/nb12a.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. silu_and_mul, element-wise with a mask.** One program per (row, block of
# `BLOCK` columns). Build the mask of the columns that exist (`inter` is no
# power of two) and the two loads: the gate at `row * stride_in + cols`, the up
# half `inter` further on. The check launches it as
# `my_silu_and_mul_kernel[(T, cdiv(inter, BLOCK))](gate_up_ptr=gate_up,
# out_ptr=out, inter=inter, stride_in=gate_up.stride(0), BLOCK=16)`, once with
# `gate_up` a view whose rows are further apart than `2 * inter`.

# %%
from stagewise.exercises import check, result  # noqa: E402


# %%
@triton.jit
def my_silu_and_mul_kernel(
    gate_up_ptr,  # [T, 2*inter]: gate in columns [0, inter), up in [inter, 2*inter)
    out_ptr,  # [T, inter], contiguous
    inter,  # width of each half
    stride_in,  # elements between rows of gate_up
    BLOCK: tl.constexpr,  # columns per program, a power of two
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < 0  # TODO: the columns of the row that exist
    gate = tl.load(gate_up_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # TODO: this row's gate
    up = tl.load(gate_up_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # TODO: this row's up
    out = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
    tl.store(out_ptr + row * inter + cols, out, mask=mask)


# %%
check("12a.silu_and_mul", my_silu_and_mul_kernel, save=True)

# %% [markdown]
# **2. rmsnorm, a row reduction.** One program per row; `BLOCK` is the next
# power of two of `hidden`, so the whole row is one block and some lanes are
# masked. Load the row (what must the masked lanes load so that they add
# nothing?), compute the mean of the squares over the `hidden` real columns
# (not over `BLOCK`), and store `x * rsqrt(mean + eps) * weight`. Launched as
# `my_rmsnorm_kernel[(T,)](x_ptr=x, weight_ptr=weight, out_ptr=out,
# hidden=hidden, stride_x=x.stride(0), eps=eps, BLOCK=next_power_of_2(hidden))`.


# %%
@triton.jit
def my_rmsnorm_kernel(
    x_ptr,  # [T, hidden], last dim contiguous
    weight_ptr,  # [hidden]
    out_ptr,  # [T, hidden], contiguous
    hidden,  # row width
    stride_x,  # elements between rows of x
    eps,  # added to the mean square
    BLOCK: tl.constexpr,  # next power of two >= hidden
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.zeros([BLOCK], dtype=tl.float32)  # TODO: load this row of x, as float32
    mean_square = 1.0  # TODO: the mean of x * x over the row's hidden columns
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, x * tl.rsqrt(mean_square + eps) * w, mask=mask)


# %%
check("12a.rmsnorm", my_rmsnorm_kernel, save=True)

# %% [markdown]
# **3. The online softmax's tile step.** One program per query row computes
# `softmax(scores[row]) @ values` while walking the keys `BLOCK_N` at a time
# (the heart of FlashAttention, without the `q @ k` in front). The loop, the
# loads and the final division are written; write the tile step that updates
# the running max `m`, the running sum `l` and the running output `acc` from
# the tile's scores `s [BLOCK_N]` and values `v [BLOCK_N, BLOCK_D]` (the
# picture above). The masked keys of the last tile load `-inf`: what does
# your step make of them? Launched as `my_online_softmax_kernel[(M,)](...)`
# with `BLOCK_D = next_power_of_2(d)`; in the interpreter the check also
# records every load: each score must be read once, a tile at a time.


# %%
@triton.jit
def my_online_softmax_kernel(
    scores_ptr,  # [M, N] contiguous
    values_ptr,  # [N, d] contiguous
    out_ptr,  # [M, d] contiguous
    num_keys,  # N
    dim,  # d
    BLOCK_N: tl.constexpr,  # keys per tile
    BLOCK_D: tl.constexpr,  # next power of two >= d
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    m = float("-inf")  # noqa: F841 - running max
    l = 0.0  # noqa: E741 - running sum of exp(s - m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # running sum of exp(s - m) * v
    for start in range(0, num_keys, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        s = tl.load(scores_ptr + row * num_keys + keys, mask=keys < num_keys, other=float("-inf"))
        v_ptrs = values_ptr + keys[:, None] * dim + d[None, :]
        v = tl.load(v_ptrs, mask=(keys < num_keys)[:, None] & (d < dim)[None, :], other=0.0)
        # TODO: the tile step: a new max, the rescale factor, this tile's exp(s - m_new), then l, acc and m
        l = l + tl.sum(s * 0.0, axis=0)  # noqa: E741
        acc = acc + tl.sum(v * 0.0, axis=0)
    tl.store(out_ptr + row * dim + d, acc / l, mask=d < dim)


# %%
check("12a.online_softmax", my_online_softmax_kernel)

# %% [markdown]
# **4. On a GPU: time yours.** With a GPU the cell below times your
# `silu_and_mul` kernel against the project's kernel and the naive PyTorch path
# on a SmolLM2-sized FFN activation (`[512, 2 * 1536]`, bf16): two launches of
# PyTorch against one of a fused kernel. Without a GPU it says so: the
# interpreter's times mean nothing.

# %% tags=["timing"]
if ON_GPU:
    from triton.testing import do_bench

    def my_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # the launch the check makes
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
        grid = (tokens, triton.cdiv(inter, 16))
        my_silu_and_mul_kernel[grid](gate_up, out, inter=inter, stride_in=gate_up.stride(0), BLOCK=16)
        return out

    gate_up = torch.randn(512, 2 * PRESETS["smollm2-135m"].intermediate_size, device=DEVICE, dtype=torch.bfloat16)
    paths = {"naive (PyTorch)": silu_and_mul_naive, "stagewise kernel": activation_kernels.silu_and_mul}
    if result("12a.silu_and_mul", my_silu_and_mul_kernel).passed:
        paths["yours"] = my_silu_and_mul
    else:
        print("your silu_and_mul kernel does not pass its check yet: timing the other two")
    moved = 3 * gate_up.numel() // 2 * gate_up.element_size()  # read [T, 2I], write [T, I]
    for name, fn in paths.items():
        ms = do_bench(lambda fn=fn: fn(gate_up))
        print(f"{name:>18}: {ms * 1e3:8.1f} us, {moved / ms / 1e6:7.0f} GB/s")
else:
    print("no GPU here: the checks above prove the kernels right; timing them needs a GPU")

# %% [markdown]
# The tests that cover this notebook's kernels, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels/test_rmsnorm.py tests/kernels/test_activation.py
#     .venv/bin/python -m pytest -q tests/exercises -k 12a
