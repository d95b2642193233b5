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
# # 03 · Fused QKV projection and grouped-query attention (GQA)
#
# Attention needs, for every token, a query, a key and a value per head:
#
#     x [T, hidden] @ W_q [hidden, H * d]     -> q [T, H, d]
#     x [T, hidden] @ W_k [hidden, Hkv * d]   -> k [T, Hkv, d]
#     x [T, hidden] @ W_v [hidden, Hkv * d]   -> v [T, Hkv, d]
#
# Two ideas make this cheaper:
#
# * **fused QKV**: the three products read the same `x`, so concatenate the
#   weights along their output columns and run **one** GEMM,
#   `x @ w_qkv [hidden, (H + 2*Hkv) * d]`, then cut the result into q, k, v
#   with *views* (no copy);
# * **GQA**: use fewer key/value heads than query heads (`Hkv < H`). Several
#   query heads share one K/V head, found by an index map
#   `kv_head = q_head // (H // Hkv)` — never by copying K/V. K and V are what
#   the KV cache stores for every past token, so GQA divides the cache (and
#   the bytes every decode step reads) by `H / Hkv`.
#
# SmolLM2: H = 9, Hkv = 3, d = 64, so `w_qkv` is `[576, 576 + 192 + 192] = [576, 960]`.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing uses a smaller prefill batch and fewer repeats. The Triton GEMM runs
# on a handful of tokens either way: without a GPU it runs in Triton's CPU
# interpreter, which checks correctness, not speed.
#
# PyTorch runs on **one thread** here: the comparisons are about ratios between
# paths doing the same work, not about the machine's peak speed.

# %%
import os

import matplotlib.pyplot as plt
import torch

from stagewise import viz
from stagewise.bench.harness.timing import compare
from stagewise.calc.counts import kv_bytes_per_token
from stagewise.config import PRESETS
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.qkv_proj import split_qkv

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed

loaded = load_model("smollm2-135m")
cfg, weights, tok = loaded.config, loaded.weights, loaded.tokenizer
H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
print(f"H={H} query heads, Hkv={Hkv} KV heads, head_dim d={d}, hidden={cfg.hidden_size}")
print(f"q_size {cfg.q_size} + 2 x kv_size {cfg.kv_size} = qkv_size {cfg.qkv_size}")

# %% [markdown]
# ## The input: normalised hidden states of a real prompt
#
# Layer 0's QKV projection reads `rmsnorm(embedding(ids))`; we build it with
# the two previous stages.

# %%
ids = torch.tensor(tok.encode("The capital of France is Paris, and the capital of Italy is Rome."))
layer = weights.layers[0]
h = STAGES["embedding"].naive(ids=ids, weight=weights.embed)  # [T] -> [T, hidden]
x, _ = STAGES["rmsnorm"].naive(x=h, weight=layer.attn_norm, eps=cfg.rms_norm_eps)  # [T, hidden]
T = x.shape[0]
print("x", tuple(x.shape), " w_qkv", tuple(layer.w_qkv.shape))

# %% [markdown]
# ## Naive: three GEMMs; fused: one
#
# The fused weight is just the three weights side by side, so slicing its
# columns gives them back. One GEMM against it equals three GEMMs against the
# slices, column block by column block.

# %%
w_q, w_k, w_v = layer.w_qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=1)  # column views
three = torch.cat([x @ w_q, x @ w_k, x @ w_v], dim=1)  # [T, 576] | [T, 192] | [T, 192]
qkv = STAGES["qkv_proj"].naive(x=x, w_qkv=layer.w_qkv)  # [T, hidden] @ [hidden, 960] -> [T, 960]
print("qkv", tuple(qkv.shape), " max |one GEMM - three GEMMs| =", (qkv - three).abs().max().item())
assert torch.allclose(qkv, three, rtol=1e-5, atol=1e-5)  # equal up to float32 summation order

# %% [markdown]
# ## Splitting without copying
#
# `split_qkv` cuts the `[T, 960]` result into q `[T, 9, 64]`, k `[T, 3, 64]`,
# v `[T, 3, 64]` as **views** of the same memory: each keeps the row stride of
# the fused tensor (960), so none of them is contiguous, and the next stages
# (RoPE, the KV store, attention) take strides rather than demanding a copy.

# %%
q, k, v = split_qkv(qkv, cfg)
base = qkv.data_ptr()
for name, t in [("q", q), ("k", k), ("v", v)]:
    offset = (t.data_ptr() - base) // t.element_size()
    print(f"{name}: shape {tuple(t.shape)}, strides {t.stride()}, from column {offset}, contiguous {t.is_contiguous()}")
assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()

# %% [markdown]
# ## Optimized: the Triton GEMM
#
# `STAGES["qkv_proj"].triton` is a tiled Triton GEMM (`kernels/matmul.py`):
# each program owns one output tile and walks the hidden axis in blocks,
# accumulating in float32. Check it against the naive product on a few real
# rows (interpreter).

# %%
few = x[:8]
ref = STAGES["qkv_proj"].naive(x=few, w_qkv=layer.w_qkv)
out = STAGES["qkv_proj"].triton(x=few, w_qkv=layer.w_qkv)
err = (out - ref).abs().max().item()
print(f"Triton GEMM vs x @ w_qkv: max abs error {err:.1e} on values of size ~{ref.abs().max():.1f}")
assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Measure: one GEMM vs three
#
# On the CPU with PyTorch's own GEMM, in a decode step (T = 1: really three
# matrix-*vector* products) and a prefill (many tokens). The fused version
# reads `x` once instead of three times and pays one call's fixed cost instead
# of three; on a GPU that is one kernel launch instead of three, and one large
# grid of tiles that fills the machine better than three small ones.

# %% tags=["timing"]
prefill_tokens = 128 if QUICK else 512
g = torch.Generator().manual_seed(0)
# both sides are the naive tier's plain `x @ w` (the torch tier's CPU forms, stages/gemm_torch.py, aside)
for label, num_tokens in [("decode, T=1", 1), (f"prefill, T={prefill_tokens}", prefill_tokens)]:
    xt = torch.randn(num_tokens, cfg.hidden_size, generator=g)
    timings = compare(
        {
            "three GEMMs": lambda xt=xt: (xt @ w_q, xt @ w_k, xt @ w_v),
            "one fused GEMM": lambda xt=xt: xt @ layer.w_qkv,
        },
        repeats=20 if QUICK else 100,
        warmup=3,
    )
    t3, t1 = timings["three GEMMs"].median_ms, timings["one fused GEMM"].median_ms
    print(f"{label:16} three GEMMs {t3 * 1e3:8.1f} us   one fused GEMM {t1 * 1e3:8.1f} us   ratio {t3 / t1:.2f}x")

# %% [markdown]
# (Medians of a few runs: the exact ratio moves from run to run.) A ratio
# above 1 means fusing saved time. Expect the gap to be largest when each
# product is small — decode — where the fixed cost per call is a large part of
# the total. For a big batch the arithmetic dominates and the ratio sits near
# 1; it can even drop below 1 on a CPU when the BLAS happens to pick a better
# blocking for the three narrow matrices than for the wide one — then fusion
# gains nothing here, and its benefit is the saved calls and launches.
# Note also that `w_q`, `w_k`, `w_v` here are column *slices* of `w_qkv`: a
# real unfused model would store three separate matrices.)
#
# ## GQA: the index map
#
# In multi-head attention (MHA) every query head has its own key and value
# head. In GQA, `H // Hkv` consecutive query heads share one:

# %%
for name in ["smollm2-135m", "llama-3-8b", "llama-3-405b"]:
    c = PRESETS[name]
    group = c.num_heads // c.num_kv_heads
    kv_of = [h // group for h in range(c.num_heads)]  # kv_head = q_head // (H // Hkv)
    shown = kv_of if c.num_heads <= 12 else kv_of[:20] + ["..."]
    print(f"{name:13} H={c.num_heads:3} Hkv={c.num_kv_heads} group={group:2}  kv_head per q_head: {shown}")

# %% [markdown]
# ### Check: the index map is the same as copying K/V
#
# A tempting way to implement GQA is to *copy* each KV head `group` times
# (`repeat_interleave`) and run ordinary MHA. The attention stage instead
# reshapes q to `[T, Hkv, group, d]` so the group axis broadcasts against
# `k [T, Hkv, d]`: no copy. Both must give identical outputs — here with the
# real layer-0 q, k, v of our prompt (before RoPE, which does not matter for
# this check).

# %%
one_seq = AttentionMetadata.over_batch(torch.tensor([0, T], dtype=torch.int32))  # one sequence of T
scale = d**-0.5
attn = STAGES["attention"].naive
gqa = attn(q=q, k=k, v=v, metadata=one_seq, scale=scale)  # index map
group = H // Hkv
k_copied, v_copied = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, H, d] each
mha = attn(q=q, k=k_copied, v=v_copied, metadata=one_seq, scale=scale)
print("copied K/V:", tuple(k_copied.shape), "vs shared:", tuple(k.shape))
print("max |GQA by index map - MHA on copied K/V| =", (gqa - mha).abs().max().item())
assert torch.allclose(gqa, mha, atol=1e-6)

# %% [markdown]
# ## Measure: what GQA saves
#
# Per token and layer the cache keeps K and V: `2 * Hkv * d` numbers. The
# seeds' chapter 6 computes Llama 3 405B's KV cache *without* GQA (MHA: K and V
# as wide as the hidden state, in every layer) for a million-token context; the
# calculator recomputes it below, and with the model's real KV heads it is
# `H / Hkv` times smaller.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
rows = []
for name in ["smollm2-135m", "llama-3-8b", "llama-3-70b", "llama-3-405b"]:
    c = PRESETS[name]
    gqa_b = kv_bytes_per_token(c, dtype_bytes=2).value  # bf16
    mha_b = kv_bytes_per_token(c, dtype_bytes=2, mha=True).value
    rows.append((name, c, gqa_b, mha_b))
    print(
        f"{name:13} KV per token (bf16): MHA {mha_b / 1e3:8.1f} kB, GQA {gqa_b / 1e3:7.1f} kB "
        f"({mha_b / gqa_b:.0f}x less); 1M tokens: MHA {mha_b * 1e6 / 1e9:6.0f} GB, GQA {gqa_b * 1e6 / 1e9:4.0f} GB"
    )
mha_405 = rows[-1][3]
print(
    f"Llama 3 405B, MHA: {mha_405:,} bytes per token = {mha_405 / 1e3:.1f} kB (1000 B) "
    f"= {mha_405 / 1024:.0f} KiB (1024 B)"
)

# %% [markdown]
# The last line is the seeds' chapter-6 number: they write it as 8064 KB,
# which is this same count of bytes in KiB (1024 bytes each); the table above
# uses kB (1000 bytes), like the GB beside it.

# %% [markdown]
# ## Pictures
#
# **The index map.** Each box is a head; colour = the KV head it reads. Top:
# SmolLM2, 9 query heads on 3 KV heads (groups of 3). Bottom: Llama 3 405B,
# 128 query heads on 8 KV heads (groups of 16). Nothing is copied: a query
# head's kernel program simply computes which K/V head to load.


# %%
c405 = PRESETS["llama-3-405b"]
viz.gqa_map([
    (H, Hkv, f"SmolLM2: H={H} -> Hkv={Hkv}, kv_head = q_head // {H // Hkv}"),
    (c405.num_heads, c405.num_kv_heads,
     f"Llama 3 405B: H={c405.num_heads} -> Hkv={c405.num_kv_heads}, kv_head = q_head // {c405.group_size}"),
])  # fmt: skip
plt.show()

# %% [markdown]
# **What it saves.** KV-cache bytes per token (bf16, all layers), MHA vs GQA,
# for the four presets (log scale). The saving is exactly `H / Hkv` (the
# factor over each bar). Since a decode step
# must read every cached K/V of its sequence, GQA divides that traffic by the
# same factor — it is as much a bandwidth optimisation as a memory one.

# %%
viz.kv_per_token([(name, mha_b, gqa_b, c.group_size) for name, c, gqa_b, mha_b in rows])
plt.show()

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `QKVParallelLinear` in `vllm/model_executor/layers/linear.py` is the fused
# QKV weight (each rank's share of query and KV heads); `LlamaAttention.forward` in
# `vllm/model_executor/models/llama.py` cuts its output with
# `qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)`, as `split_qkv`
# does, and the attention backends read GQA's shared KV heads by index.

# %% [markdown]
# ## Takeaways
#
# * one GEMM `x @ [W_q | W_k | W_v]` replaces three, and `split_qkv` cuts the
#   result into q, k, v as strided views, no copy;
# * GQA: query head `h` reads KV head `h // (H // Hkv)`; computing the index
#   gives exactly what copying K/V would, without the copy;
# * the KV cache, and the bytes each decode step reads from it, shrink by
#   `H / Hkv`.
#
# Next: `04_rope`, which rotates q and k by their positions.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb03.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. Cut the fused output.** `qkv [T, (H + 2 Hkv) d]` -> `q [T, H, d]`,
# `k [T, Hkv, d]`, `v [T, Hkv, d]`, as **views** of `qkv` (slicing and `.view`,
# no copy; the check verifies they share qkv's memory).

# %%
from stagewise.exercises import check  # noqa: E402


def my_split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    raise NotImplementedError


# %%
check("03.split_qkv", my_split_qkv)

# %% [markdown]
# **2. GQA the expensive way.** Return K (or V) copied to one head per query
# head, `[T, Hkv, d] -> [T, H, d]`, so that plain multi-head attention on the
# copies gives what the stage computes with its index map. (Then look at
# `.numel()` of your result: that is what the index map saves.)


# %%
def my_repeat_kv(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    raise NotImplementedError


# %%
check("03.repeat_kv", my_repeat_kv, save=True)

# %% [markdown]
# **3. KV bytes per token.** For a `ModelConfig` (`num_layers`, `num_kv_heads`,
# `head_dim`) and bytes per element, how many bytes does one token's K and V
# take in the cache, all layers together? The check tries every preset.


# %%
def my_kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    raise NotImplementedError


# %%
check("03.kv_bytes_per_token", my_kv_bytes_per_token)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/stages/test_stages_oracle.py -k qkv
#     .venv/bin/python -m pytest -q tests/kernels/test_matmul.py
#     .venv/bin/python -m pytest -q tests/exercises -k 03
