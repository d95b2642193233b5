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
# # 02 · Embedding and RMSNorm
#
# Two small stages that open every forward pass and every transformer block:
#
#     embedding   ids [T]          -> hidden_states [T, hidden]     a gather: no arithmetic at all
#     rmsnorm     x [T, hidden]    -> out [T, hidden]               one reduction per row, + the residual add
#
# Neither does much arithmetic, so both are **memory-bound**: their cost is
# the bytes they move, and the optimized versions are about moving fewer
# bytes (one pass instead of many), not about computing faster.
#
# SmolLM2: `hidden = 576`, `vocab = 49,152`, `rms_norm_eps = 1e-5`.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# bandwidth measurement uses fewer tokens and repeats. The Triton kernels
# always run on a handful of tokens: on a machine without a GPU they run in
# Triton's CPU *interpreter*, which checks correctness, not speed.
#
# PyTorch runs on **one thread** here: the comparisons are about ratios between
# paths doing the same work, not about the machine's peak speed.

# %%
import os

import matplotlib.pyplot as plt
import torch

from stagewise.bench.harness.timing import compare
from stagewise.errors import StagewiseError
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.base import stage_of
from stagewise.viz import stages as viz_stages

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed

loaded = load_model("smollm2-135m")  # float32 on the CPU
cfg, weights, tok = loaded.config, loaded.weights, loaded.tokenizer
print(f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, eps {cfg.rms_norm_eps:.0e}")

# %% [markdown]
# ## Embedding: a gather
#
# The embedding table `weight [vocab, hidden]` has one learned row per token.
# The stage's naive reference is one indexing expression, `weight[ids]`:

# %%
text = "The capital of France is Paris, and the capital of Italy is Rome."
ids = torch.tensor(tok.encode(text))  # [T]
h = STAGES["embedding"].naive(ids=ids, weight=weights.embed)  # [T] -> [T, hidden]
print("ids", tuple(ids.shape), "->", tuple(h.shape))
print("row 1 is table row", int(ids[1]), repr(tok.tokens[ids[1]]), ":", torch.equal(h[1], weights.embed[ids[1]]))

# %% [markdown]
# Textbooks often write the embedding as a matrix product, `one_hot(ids) @ W`.
# Same result, but it would cost `2 * T * vocab * hidden` FLOPs and read the
# whole table, to select T rows. The gather costs zero FLOPs and reads only
# `T * hidden` numbers:

# %%
one_hot = torch.nn.functional.one_hot(ids, cfg.vocab_size).float()  # [T, vocab]
assert torch.equal(one_hot @ weights.embed, h)
T = len(ids)
table_mb = weights.embed.numel() * 4 / 1e6
print(f"one-hot GEMM: {2 * T * cfg.vocab_size * cfg.hidden_size / 1e6:.0f} MFLOP, reads the {table_mb:.0f} MB table")
print(f"gather:       0 FLOP, reads {T * cfg.hidden_size * 4 / 1e3:.1f} kB ({T} rows)")

# %% [markdown]
# SmolLM2 **ties** its embeddings: the LM head at the end of the model uses
# the same numbers (`logits = h @ embed^T`). On a CPU, stagewise's
# `lm_head [hidden, vocab]` is the embedding table itself seen through a
# transposed view (no second copy): the table is stored [vocab, hidden]
# row-major, which is also the layout the CPU's BLAS streams fastest for a
# decode GEMM (the projections' torch tier, `stagewise/stages/gemm_torch.py`).
# On a GPU it is a contiguous copy.

# %%
print("lm_head holds the embedding, transposed:", torch.equal(weights.lm_head, weights.embed.t()))
print("same memory as the table:", weights.tied(), " strides", weights.lm_head.stride())

# %% [markdown]
# ### Optimized: a Triton gather kernel
#
# `STAGES["embedding"].triton` launches one program per (token, block of
# columns) that loads its table row and stores it: one read and one write per
# element, the minimum. Because a kernel trusts its indices (an id past the end
# would silently read other memory), the launcher checks the id range first.
# Check: the result is a copy, so it must be **bit-identical**.

# %%
few = ids[:6]  # the interpreter runs every program in Python: keep it small
out_triton = STAGES["embedding"].triton(ids=few, weight=weights.embed)
assert torch.equal(out_triton, STAGES["embedding"].naive(ids=few, weight=weights.embed))
print("Triton gather == weight[ids], bit for bit:", tuple(out_triton.shape))

try:
    STAGES["embedding"].triton(ids=torch.tensor([5, cfg.vocab_size]), weight=weights.embed)
except StagewiseError as err:
    print("out-of-range id rejected:", err)

# %% [markdown]
# ## RMSNorm
#
#     out = weight * x / sqrt(mean(x^2) + eps)          per row (token), over the hidden axis
#
# Why normalise at all: the residual stream `h` is a running sum — every
# block *adds* its attention and FFN outputs to it — so its scale grows with
# depth (we measure by how much below). The matrices inside a block were
# trained on inputs of a fixed scale; RMSNorm gives them that, whatever the
# depth. Unlike LayerNorm there is no mean subtraction and no bias: one
# reduction per row, cheaper, and it works as well.
#
# Worked example on one hand-checkable row:

# %%
row = torch.tensor([[3.0, -4.0, 0.0, 0.0]])  # mean(x^2) = (9 + 16) / 4 = 6.25, rms = 2.5
out, _ = STAGES["rmsnorm"].naive(x=row, weight=torch.ones(4), eps=0.0)
print(out)  # [3, -4, 0, 0] / 2.5 = [1.2, -1.6, 0, 0]
assert torch.allclose(out, torch.tensor([[1.2, -1.6, 0.0, 0.0]]))

# %% [markdown]
# ### The residual add, fused in
#
# In a Llama block every norm is preceded by a residual add:
#
#     h = h + sublayer_output           # the residual stream
#     x = rmsnorm(h)                    # what the next sublayer reads
#
# The stage takes both: given `residual`, it returns `(rmsnorm(x + residual),
# x + residual)`, the normalised input of the next sublayer and the new
# residual stream. That is how the model calls it (`models/llama.py`), and it
# lets a kernel do the add and the norm in one pass over memory.

# %%
g = torch.Generator().manual_seed(0)
x, res = torch.randn(4, cfg.hidden_size, generator=g), torch.randn(4, cfg.hidden_size, generator=g)
w_norm = weights.layers[0].attn_norm
normed, new_residual = STAGES["rmsnorm"].naive(x=x, weight=w_norm, eps=cfg.rms_norm_eps, residual=res)
assert torch.equal(new_residual, x + res)
unit = (x + res) / (x + res).pow(2).mean(-1, keepdim=True).sqrt()
print("out == weight * unit-RMS(x + residual):", torch.allclose(normed, w_norm * unit, atol=1e-5))

# %% [markdown]
# ### Why accumulate in float32
#
# The stage casts to float32 before `pow(2).mean()`, whatever the input dtype,
# and casts back at the end (as Hugging Face's `LlamaRMSNorm` does). The reason
# is the *sum* inside the mean: bfloat16 keeps 8 significant bits, so once a
# running sum is large, adding a small term changes nothing. To see it, add
# up the squares of one real residual-stream row (layer 20, captured below)
# one term at a time, with a bf16 accumulator and with an fp32 one. (PyTorch's
# own reductions already accumulate bf16 in fp32 on the CPU; a hand-written
# kernel must choose — ours loads, then `.to(tl.float32)`.)

# %% [markdown]
# First, a recording `StageOps`: the model calls every stage through `ops`, so
# a subclass can watch every RMSNorm call of a real forward pass without
# changing the model. We keep, for each call, the residual stream going in and
# the normalised output coming out.


# %%
class RecordNorms(StageOps):
    """Naive stages; remembers (layer, residual stream, normed output) of every rmsnorm call."""

    def __init__(self):
        super().__init__("naive")
        self.calls = []

    def __call__(self, stage, layer=None, **kwargs):
        result = super().__call__(stage, layer, **kwargs)
        if stage_of(stage, STAGES).name == "rmsnorm":  # the model passes the module
            normed, residual = result
            self.calls.append((layer, residual.clone(), normed.clone()))
        return result


recorder = RecordNorms()
batch = ForwardBatch.from_sequences([ids.tolist()], start_positions=[0], device="cpu")
LlamaModel(loaded, recorder).forward(batch, NoKVCache(batch.cu_seqlens_q))
print(len(recorder.calls), "rmsnorm calls: 2 per layer x 30 + the final norm")

# %%
layer20 = [c for c in recorder.calls if c[0] == 20][0][1]  # residual stream entering layer 20, [T, hidden]
squares = layer20[5].pow(2)  # one token's row
acc_bf16 = torch.zeros((), dtype=torch.bfloat16)
acc_fp32 = torch.zeros((), dtype=torch.float32)
for term in squares:
    acc_bf16 += term.to(torch.bfloat16)
    acc_fp32 += term
exact = squares.double().sum()
for name, acc in [("bf16 accumulator", acc_bf16), ("fp32 accumulator", acc_fp32)]:
    print(f"{name}: sum of squares {float(acc):12.1f}   relative error {abs(float(acc) - exact) / exact:.1e}")

# %% [markdown]
# ### Check: the stage in bf16 vs fp32
#
# With fp32 accumulation, the bf16 stage differs from the fp32 one only by
# bf16's rounding of inputs and outputs (relative ~2^-8 = 0.4%), not by a
# drifting sum.

# %%
x32 = layer20
out32, _ = STAGES["rmsnorm"].naive(x=x32, weight=w_norm, eps=cfg.rms_norm_eps)
out16, _ = STAGES["rmsnorm"].naive(x=x32.bfloat16(), weight=w_norm.bfloat16(), eps=cfg.rms_norm_eps)
rel = ((out16.float() - out32).norm() / out32.norm()).item()
print(f"bf16 vs fp32 stage: relative difference {rel:.1e}")
assert rel < 1e-2

# %% [markdown]
# ## Optimized: one Triton program per row
#
# The naive reference is about a dozen PyTorch ops — the add, `float()`,
# `pow`, `mean`, `rsqrt`, two multiplies, the casts — and each one is a pass
# over a `[T, hidden]` tensor in memory. The Triton kernel
# (`kernels/rmsnorm.py`) keeps one row in registers from the add to the store:
# it reads `x` and `residual` once and writes `residual_out` and `out` once,
# **4 row passes** in all (a separate add kernel and norm kernel would need 5).
#
# Check against the naive reference on real rows (interpreter, a handful of
# tokens). In float32 the residual add is bit-identical and the norm agrees to
# float32 rounding. In bfloat16 both paths round three times (the add, the
# normalised row, the product with the weight), but Triton's *interpreter*
# casts fp32 -> bf16 by truncation where PyTorch rounds to nearest, so values
# may differ by one bf16 step (2^-7 relative) per rounding; on a GPU the kernel
# rounds like PyTorch.

# %%
x_few, r_few = recorder.calls[40][2][:4], recorder.calls[41][1][:4]  # real rows of this forward pass
for dtype, tol_res, tol_out in [(torch.float32, 0.0, 1e-5), (torch.bfloat16, 2**-7, 4 * 2**-7)]:
    args = {"x": x_few.to(dtype), "weight": w_norm.to(dtype), "eps": cfg.rms_norm_eps, "residual": r_few.to(dtype)}
    ref_out, ref_res = STAGES["rmsnorm"].naive(**args)
    tri_out, tri_res = STAGES["rmsnorm"].triton(**args)

    def rel_err(a, b):
        return ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-2)).max().item()

    err_res, err_out = rel_err(tri_res, ref_res), rel_err(tri_out, ref_out)
    print(f"{str(dtype):15} max relative error: residual_out {err_res:.1e} (tol {tol_res:.0e}), out {err_out:.1e}")
    assert err_res <= tol_res and err_out <= tol_out

# %% [markdown]
# ## Measure: how many passes does the naive norm make?
#
# A memory-bound stage runs as fast as it moves bytes. We time, on the CPU,
# the naive fused-residual RMSNorm on a large token batch, and compare it
# with one plain copy of the same `[T, hidden]` float32 tensor into a
# preallocated buffer (a read and a write: one "pass"). The ratio is how many
# copies' worth of time the naive reference costs — its intermediate tensors
# are each written, read back and freed, and freshly allocated memory costs
# page faults on top. The fused kernel's floor is 2 copies (read x and
# residual, write out and residual_out).

# %% tags=["timing"]
num_tokens = 4096 if QUICK else 16384
big_x = torch.randn(num_tokens, cfg.hidden_size)
big_r = torch.randn(num_tokens, cfg.hidden_size)
buffer = torch.empty_like(big_x)  # preallocated: the copy measures bandwidth only
timings = compare(
    {
        "copy (1 read + 1 write)": lambda: buffer.copy_(big_x),
        "naive rmsnorm + residual": lambda: STAGES["rmsnorm"].naive(
            x=big_x, weight=w_norm, eps=cfg.rms_norm_eps, residual=big_r
        ),
    },
    repeats=5 if QUICK else 20,
    warmup=2,
)
copy_ms = timings["copy (1 read + 1 write)"].median_ms
norm_ms = timings["naive rmsnorm + residual"].median_ms
mb = big_x.numel() * 4 / 1e6
print(f"[{num_tokens}, {cfg.hidden_size}] float32 = {mb:.1f} MB per tensor")
print(f"copy {copy_ms:.2f} ms ({2 * mb / copy_ms:.1f} GB/s), naive rmsnorm {norm_ms:.2f} ms")
print(f"naive rmsnorm costs {norm_ms / copy_ms:.1f} copies; the fused kernel's floor is 2")

# %% [markdown]
# ## Picture: what the norm does to the residual stream
#
# Left: the RMS of the residual stream at each of the 61 norms (2 per
# layer + the final one), as the median over tokens and for token 0 alone,
# and the RMS of the norm's output. The stream grows by orders of magnitude
# with depth (the cell prints by how much); the norm's output stays in a
# narrow band set by the learned weights (the attention and FFN norms alternate; the final norm's
# weight is larger). Token 0 is special: the first position of a sequence develops a
# **massive activation** (its RMS peaks at the multiple of the other tokens'
# median that the cell prints) in a few dimensions — the "attention sink" that
# many models learn. RMSNorm is what keeps those rows from blowing up the next
# matmul.
#
# Right: the same residual RMS per token and layer (log colour scale).

# %%
rms = lambda t: t.float().pow(2).mean(-1).sqrt()  # noqa: E731  [T, hidden] -> [T]
before = torch.stack([rms(res) for _, res, _ in recorder.calls])  # [61, T]
after = torch.stack([rms(out) for _, _, out in recorder.calls])  # [61, T]
growth_median = float(before[-1].median() / before[0].median())
growth_sink = float(before[:, 0].max() / before[0, 0])
out_lo, out_hi = float(after.median(dim=1).values.min()), float(after.median(dim=1).values.max())
print(f"residual stream RMS, first norm -> final norm: x{growth_median:,.0f} for the median token, "
      f"up to x{growth_sink:,.0f} for token 0")
print(f"the norms' outputs (median token): RMS between {out_lo:.2f} and {out_hi:.2f}, whatever the input's scale")
sink_ratio = before[:, 0] / before[:, 1:].median(dim=1).values  # token 0 over the other tokens' median, [61]
peak = int(sink_ratio.argmax())
print(f"token 0's residual RMS peaks at x{float(sink_ratio[peak]):,.0f} the other tokens' median (norm call {peak}, "
      f"layer {peak // 2})")

viz_stages.rms_before_after(before, after, [tok.decode([i]) for i in ids.tolist()])
plt.show()

# %% [markdown]
# "A few dimensions" is literal: here is token 0's residual row at layer 20.

# %%
sink = layer20[0]  # [hidden]
top = sink.abs().topk(3)
share = (sink[top.indices].pow(2).sum() / sink.pow(2).sum()).item()
print(f"token 0, layer 20: largest |values| {top.values.round().tolist()} in dims {top.indices.tolist()}")
print(f"those 3 of {cfg.hidden_size} dimensions hold {share:.1%} of the row's sum of squares")

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `VocabParallelEmbedding` in
# `vllm/model_executor/layers/vocab_parallel_embedding.py` is the embedding gather
# (its rows split over tensor-parallel ranks). `RMSNorm` in
# `vllm/model_executor/layers/layernorm.py`: `forward_native` is this notebook's
# naive path (upcast to float32, the residual added first when `residual` is
# given, the pair returned), `forward_cuda` calls the fused kernels `rms_norm` /
# `fused_add_rms_norm` (`csrc/layernorm_kernels.cu`).

# %% [markdown]
# ## Takeaways
#
# * embedding = `weight[ids]`, `[T] -> [T, hidden]`: zero FLOPs, `T * hidden`
#   numbers moved; the kernel is a copy with a bounds check;
# * RMSNorm rescales each row to unit RMS times a learned weight, with the
#   sum of squares in float32; fused with the residual add it is one pass
#   that reads 2 and writes 2 rows;
# * the residual stream's scale grows by orders of magnitude over the layers
#   (far more for the sink token, as printed above); the norm's output does not.
#
# Next: `03_qkv_gqa`, where the normalised rows meet their first GEMM.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb02.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. RMSNorm from the formula.** `out = weight * x / sqrt(mean(x^2) + eps)`,
# per row, over the last axis. Compute the norm in float32 whatever the input
# dtype (why: the bf16 accumulator above) and cast back to the input's dtype
# before multiplying by the weight, as the stage does. The check feeds
# float32, bfloat16 and float16 rows, and allows one rounding step per value.

# %%
from stagewise.exercises import check  # noqa: E402


def my_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    raise NotImplementedError


# %%
check("02.rmsnorm", my_rmsnorm)

# %% [markdown]
# **2. The fused residual add.** Return `(rmsnorm(x + residual), x + residual)`:
# the next sublayer's input and the new residual stream, as the stage does when
# given `residual=`. (Reuse `my_rmsnorm`.)


# %%
def my_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    raise NotImplementedError


# %%
check("02.add_rmsnorm", my_add_rmsnorm)

# %% [markdown]
# **3. The embedding gather.** `ids [T]` -> the rows of `weight [vocab, hidden]`,
# `[T, hidden]`. One line; try it without indexing syntax too
# (`torch.index_select`, or a one-hot matrix product — and think about what that
# product would cost for SmolLM2's `vocab`).


# %%
def my_embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("02.embedding", my_embedding, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels/test_rmsnorm.py tests/kernels/test_embedding.py
#     .venv/bin/python -m pytest -q tests/stages/test_stages_oracle.py -k 'rmsnorm or embedding'
#     .venv/bin/python -m pytest -q tests/exercises -k 02
