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
# # 12b · The attention kernels, split-K, and the proof that every kernel computes the same thing
#
# Notebook 12a read the row kernels and had you write three. This one reads
# the rest of `stagewise/kernels/` from the files themselves: the tiled GEMM,
# FlashAttention (the online softmax of 12a over K/V tiles), paged attention
# (the same loop, keys found through notebook 09's block table) and split-K
# (one decode's keys cut across programs, their softmax states merged
# exactly). What they change is data movement: a loaded weight tile serves a
# tile of rows; the `[N, N]` scores are never written (O(N) extra memory; the
# K/V traffic stays quadratic, as notebook 05 counts); no gathered copy of the
# cache; enough programs for a few long decodes to fill a GPU.
#
# On a CPU the kernels run in Triton's interpreter: a real correctness check
# (the same kernel code), no measure of speed.
#
# Path: the GEMM -> FlashAttention -> paged attention -> split-K, each read,
# pictured and checked -> every stage (the fused sampler included) and the
# whole model against the naive tier -> measure (GPU only).
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the whole-model check
# generates 4 tokens instead of 8 (and a GPU times 10 repeats, not 30).

# %%
import os

os.environ.setdefault("STAGEWISE_QUIET", "1")  # this cell prints where Triton runs
import numpy as np  # noqa: E402
import torch

import stagewise.kernels  # first: decides GPU or interpreter before any kernel is defined
import stagewise.viz.kernels as vk  # the pictures, printing helpers and the stage comparison
from stagewise import LLM, SamplingParams
from stagewise.bench.commands.stages import StagesSettings, run_stages
from stagewise.config import PRESETS, EngineConfig
from stagewise.kernels import attention_common, split_k
from stagewise.kernels import flash_attention as flash_kernels
from stagewise.kernels import matmul as matmul_kernels
from stagewise.kernels import paged_attention as paged_kernels
from stagewise.kernels.split_k import choose_num_splits, num_sms
from stagewise.kernels.targets import gpu_target, launch_target
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.viz.kernels import show_source as show

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
ON_GPU = stagewise.kernels.TRITON_MODE == "cuda"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
print(f"Triton runs on: {stagewise.kernels.TRITON_MODE}" + ("" if ON_GPU else " (correctness only, not speed)"))

config, smol = PRESETS["tiny"], PRESETS["smollm2-135m"]  # tiny: shapes the interpreter runs in seconds
here = launch_target(DEVICE)
g = torch.Generator().manual_seed(1)

# %% [markdown]
# ## 1. The tiled GEMM: a tile of `c` per program
#
# `c = a @ b` with `a [M, K]`, `b [K, N]`. Each program owns one
# `[BLOCK_M, BLOCK_N]` tile of `c` and walks `K` in steps of `BLOCK_K`,
# accumulating `tl.dot`s of an `a` tile and a `b` tile in fp32. The grid is
# one axis of `tiles_m * tiles_n` programs; the first lines turn the program
# id into a tile position.

# %%
show(matmul_kernels._matmul_kernel, start="pid = tl.program_id(0)")

# %% [markdown]
# What to look at:
#
# * **program id -> tile**: not row-major. Programs are handed out `GROUP_M`
#   tile-rows at a time: `pid` walks *down* a column of `GROUP_M` tiles, then
#   moves one tile-column right, so the programs running side by side share
#   tiles of `a` and `b` through L2.
# * `a_ptrs`, `b_ptrs`: 2-D tiles of addresses from the four strides. The LM
#   head passes `b = weight.t()`, a transposed view (strides swapped: the
#   embedding matrix is read in place); with `GATHER`, the rows of `a` come
#   through `row_index` (the last token of each sequence).
# * the masks `offs_k < k_left`, `mask_m`, `mask_n` switch off what lies past
#   K and past the edges of `c`; `acc` stays in registers, `c` is written once.
#
# Check on shapes that are multiples of nothing (M above 16: this kernel, not
# the decode kernel), the transposed view and the gathered rows included:

# %%
for m, k, n in ((37, 19, 33), (70, 40, 150)):
    a, bt = torch.randn(m, k, generator=g).to(DEVICE), torch.randn(n, k, generator=g).to(DEVICE)
    plan = matmul_kernels.gemm_plan(m, a.dtype, here).configs[0].kwargs
    grid = -(-m // plan["BLOCK_M"]) * -(-n // plan["BLOCK_N"])
    rows = torch.randint(0, m, (29,), generator=g).to(DEVICE)
    err = max(
        float((matmul_kernels.matmul(a, bt.t()) - a @ bt.t()).abs().max()),  # b is a transposed view: no copy
        float((matmul_kernels.matmul(a, bt.t(), row_index=rows) - a[rows] @ bt.t()).abs().max()),
    )
    print(f"[{m}, {k}] @ [{k}, {n}] with tiles {plan}: {grid} programs; max |kernel - torch| = {err:.1e}")
print(f"(on a GPU, M = 1 .. {matmul_kernels.DECODE_MAX_M} rows go to the split-K decode kernel, matmul_decode.py)")

# %% [markdown]
# ## 2. FlashAttention: the inner loop
#
# The grid is `(row tiles, sequences, KV heads x splits)`. A program owns one
# KV head of one sequence and `BLOCK_M` rows, where a row is a (query, query
# head) pair of that KV head's GQA group: row `r` is query `r // G`, head
# `kv_head * G + r % G`. It loads its Q tile once and then walks the keys.
# The step it repeats for every K/V tile lives in `attention_common.py`:

# %%
show(attention_common.attend_tile)

# %% [markdown]
# `s` is the `[BLOCK_M, BLOCK_N]` tile of scores, in registers only; `m_i`,
# `l_i` and `acc` are the running max, sum and output of the online softmax
# (notebook 12a), in base 2 (`qk_scale` already holds `log2(e)`). Which key tiles
# a program visits, and how it walks them, are two more helpers there, shared
# by FlashAttention and paged attention:

# %%
show(attention_common.key_range, start="shift = k_len - q_len")
show(attention_common.attend_keys, start="for n0 in range")

# %% [markdown]
# What to look at:
#
# * `hi`: keys past the tile's last query (plus `shift`, the bottom-right
#   alignment when there are more keys than queries) are seen by no row of the
#   tile: the loops stop there, and those K/V tiles are **never loaded**.
# * `full`: keys before the tile's *first* query are seen by every row: those
#   tiles run with `MASKED=False`, no mask work at all. Only the diagonal band
#   `[mid, hi)` builds the `visible` mask: the kernel calls `attend_keys`
#   twice, once per range.
# * the queries are a strided view into the fused QKV output (a token stride
#   of `(H + 2 Hkv) d`), read in place; `k_base + rows[:, None] * stride_k_row`
#   is a `[BLOCK_N, d]` tile of key addresses.
#
# The picture, from the launcher's own plan: one SmolLM2 prefill, every (row
# tile, key tile) pair coloured by what the kernel does with it. Left: this
# machine's tiles; right: the first tile shape offered to an sm_90 GPU's
# autotuner in bf16.

# %%
G = smol.num_heads // smol.num_kv_heads
L = 512  # prompt tokens: queries = keys, causal
targets = {f"this machine ({here.name})": (here, torch.float32), "sm_90, bf16": (gpu_target(90), torch.bfloat16)}
plans = {name: flash_kernels.flash_attention_plan(L, G, smol.head_dim, dt, t) for name, (t, dt) in targets.items()}
tiles = {name: (plan.configs[0].kwargs["BLOCK_M"], plan.configs[0].kwargs["BLOCK_N"]) for name, plan in plans.items()}
vk.causal_tile_map(tiles, L, G, smol.num_kv_heads)  # the kinds: vk.tile_kinds, the kernel's bounds

# %% [markdown]
# About half the tiles are never loaded (the causal triangle), and only a thin
# band pays for a mask. Check: the kernel against the attention stage on two
# sequences packed together (a prompt of 19 and a chunk of 5 queries on 12
# keys) and a decode row, tiny config (G = 3):

# %%
H, Hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
q_lens, k_lens = [19, 5, 1], [19, 12, 40]
q = torch.randn(sum(q_lens), H, d, generator=g).to(DEVICE)
k, v = (torch.randn(sum(k_lens), Hkv, d, generator=g).to(DEVICE) for _ in range(2))
cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEVICE)
cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32, device=DEVICE)
step = AttentionMetadata.build(q_lens, k_lens, DEVICE, k_starts=cu_k.tolist())  # what the stage takes
ref = STAGES["attention"].naive(q=q, k=k, v=v, metadata=step, scale=d**-0.5)
out = flash_kernels.flash_attention(q, k, v, cu_q, cu_k, d**-0.5, max_q_len=max(q_lens))
print(f"queries {q_lens} on keys {k_lens}: max |kernel - naive| = {float((out - ref).abs().max()):.1e}")

# %% [markdown]
# ## 3. Paged attention: the same loop, K/V through the block table
#
# Paged attention runs the same online softmax; what changes is where a key
# lives. The cache is a pool of blocks `[num_blocks, block_size, Hkv, d]`, and
# a sequence's keys are scattered over it in the order its block-table row
# says. `attend_keys` (above) loads every K/V tile; its `PAGED` branch is the
# block-table lookup:

# %%
show(attention_common.attend_keys, start="if PAGED:", stop="v_ptrs = v_base")

# %% [markdown]
# * `block_table_row_ptr + pos // BLOCK_SIZE`: one block id per key of the
#   tile; then `block_id * BLOCK_SIZE + pos % BLOCK_SIZE`, the slot formula
#   of notebook 09, and one slot's stride (`Hkv * d`) to the tile's addresses.
# * a tile may span several cache blocks or part of one: the block size and
#   the tile size are independent. The rest is FlashAttention's loop.
#
# The picture: the first sequence of the stage's example inputs (a decode on
# a cached prefix), its keys coloured by the physical block they live in, the
# kernel's key tiles on top.

# %%
pin = STAGES["paged_attention"].example_inputs(config, 9, DEVICE, torch.float32, block_size=8)
meta = pin["metadata"]  # the step's AttentionMetadata: block table, lengths (device and host)
pa_plan = paged_kernels.paged_attention_plan(meta.max_q_len, H // Hkv, d, torch.float32, here).launch_options()
n0, bs = meta.seq_lens_host[0], pin["k_cache"].shape[1]
vk.paged_keys(meta.block_table[0].tolist(), n0, bs, pa_plan["BLOCK_N"], pin["k_cache"].shape[0])

args = {key: pin[key] for key in ("q", "k_cache", "v_cache", "scale")}  # the launcher takes tensors and ints:
args.update(block_table=meta.block_table, seq_lens=meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q)  # unpacked
ref = STAGES["paged_attention"].naive(**pin)
out = paged_kernels.paged_attention(**args, max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len)
print(f"queries {np.diff(meta.cu_seqlens_q_host).tolist()} on cached lengths {meta.seq_lens_host}, "
      f"blocks shuffled: max |kernel - naive| = {float((out - ref).abs().max()):.1e}")  # fmt: skip

# %% [markdown]
# ## 4. Split-K (flash decoding) and its reduction
#
# A decode step gives one program per (sequence, KV head): with a few long
# sequences that is far fewer programs than a GPU has streaming
# multiprocessors (SMs), and most of the chip idles while they walk thousands
# of keys. Split-K cuts each sequence's keys into `NUM_SPLITS` ranges, one
# program each (the kernel's `lo`/`hi` lines above). A program then ends not
# with an output but with the online-softmax **state** of its range:
#
#     m_s = max score,   l_s = sum 2^(x - m_s),   acc_s = sum 2^(x - m_s) v
#
# and a second small kernel merges the states exactly:

# %%
show(split_k._split_k_reduce_kernel, start="token = tl.program_id(0)")

# %% [markdown]
# One program per (token, head): it loads the `S` partial states side by
# side, takes the common max `M`, rescales each split by `w_s = 2^(m_s - M)`
# and returns `sum_s w_s acc_s / sum_s w_s l_s`. Padding lanes (S rounded up
# to a power of two) load `m = -inf`, so their weight is 0.
#
# When does the launcher split? `choose_num_splits` aims at a few programs per
# SM and enough keys per split to pay for the merge. Its choices for decodes of
# 8 KV heads (Llama 3 8B) on an H100 SXM, and here:

# %%
sms = 132  # streaming multiprocessors of an H100 SXM
print(f"aim: {split_k.PROGRAMS_PER_SM} programs per SM, at least {split_k.MIN_KEYS_PER_SPLIT} keys per split, "
      f"at most {split_k.MAX_SPLITS} splits")  # fmt: skip
for batch, keys in ((1, 4096), (2, 32768), (8, 4096), (64, 4096), (2, 300)):
    programs = batch * 8
    print(f"B={batch:>2}, {keys:>5} keys: {programs:>3} programs -> {choose_num_splits(programs, keys, sms):>2} splits "
          f"on {sms} SMs, {choose_num_splits(programs, keys, num_sms(DEVICE))} here")  # fmt: skip

# %% [markdown]
# The interpreter runs programs one after the other, so it never splits on
# its own. We split by hand instead: the state of every range of one decode
# query, computed in PyTorch (base 2, as in the kernels), merged by the real
# reduction kernel, against the attention stage; and the paged kernel forced
# to split against itself unsplit.

# %%
n_keys, S = 300, 4
qd = torch.randn(1, H, d, generator=g)
kd, vd = torch.randn(n_keys, Hkv, d, generator=g), torch.randn(n_keys, Hkv, d, generator=g)
x = torch.einsum("hd,nhd->hn", qd[0], kd.repeat_interleave(H // Hkv, dim=1)) * d**-0.5 * attention_common.LOG2E
ranges = torch.tensor_split(torch.arange(n_keys), S)
m_part = torch.stack([x[:, r].max(dim=1).values for r in ranges], dim=1)  # [H, S]
p = [torch.exp2(x[:, r] - m_part[:, s, None]) for s, r in enumerate(ranges)]  # [H, keys of split s]
l_part = torch.stack([ps.sum(dim=1) for ps in p], dim=1)  # [H, S]
v_heads = vd.repeat_interleave(H // Hkv, dim=1)  # [n, H, d], only to write the partials out here
acc_part = torch.stack([torch.einsum("hn,nhd->hd", ps, v_heads[r]) for ps, r in zip(p, ranges)], dim=1)  # [H, S, d]
merged = torch.empty(1, H, d, device=DEVICE)
split_k.split_k_reduce(acc_part[None].to(DEVICE), m_part[None].to(DEVICE), l_part[None].to(DEVICE), merged)
one_decode = AttentionMetadata.build([1], [n_keys], "cpu", k_starts=[0, n_keys])  # 1 query on n_keys keys
want = STAGES["attention"].naive(q=qd, k=kd, v=vd, metadata=one_decode, scale=d**-0.5)  # [1, H, d]
err = float((merged.cpu() - want).abs().max())
print(f"{S} partial states merged by split_k_reduce: max |merged - attention| = {err:.1e}")
one, split4 = (paged_kernels.paged_attention(**args, max_q_len=meta.max_q_len, num_splits=s) for s in (1, 4))
print(f"paged_attention with 4 splits vs unsplit: max difference {float((one - split4).abs().max()):.1e}")

# %% [markdown]
# The merge for head 0: each split's max (base 2), its weight `w_s = 2^(m_s -
# M)` and its share `w_s l_s` of the denominator. The split holding the largest
# score has weight 1; the others shrink by how far their max sits below it.

# %%
vk.split_merge(m_part[0], l_part[0], ranges, f"split-K: one decode query (head 0) over {n_keys} keys in {S} splits")

# %% [markdown]
# ## 5. Check: naive vs Triton for every stage
#
# Each stage's `example_inputs(config, num_tokens, device, dtype)` builds the
# same seeded keyword arguments for both paths. `compare_stage`
# (`stagewise/viz/kernels.py`) runs both on fresh copies with the tiny
# config's shapes, at irregular token counts (1, 7, 33: a decode, and sizes
# that are multiples of no tile), in float32 and bfloat16. It compares
# tensors by their largest absolute difference over the reference's largest
# magnitude (both dtypes on one scale), `kv_store` by the caches it wrote,
# `tokenize` (the Rust `tokenizers` library, not Triton) by identical ids,
# and `sampling` by the *set of tokens each row may draw*: the kernel draws
# from its own random stream, but the sets must be identical.

# %%
config, token_counts, dtypes = PRESETS["tiny"], (1, 7, 33), (torch.float32, torch.bfloat16)
results = {}  # (stage, dtype) -> (what is compared, worst error over the token counts)
for name in STAGES:
    for dtype in dtypes:
        checks = [vk.compare_stage(name, config, n, dtype, DEVICE) for n in token_counts]
        results[name, dtype] = (checks[0][0], max(e for _, e in checks))
print(f"{'stage':>15} {'what is compared':>20} {'float32':>10} {'bfloat16':>10}")
for name in STAGES:
    kind, f32, bf16 = results[name, dtypes[0]][0], results[name, dtypes[0]][1], results[name, dtypes[1]][1]
    print(f"{name:>15} {kind:>20} {f32:>10.2e} {bf16:>10.2e}")

# %% [markdown]
# Tolerances: a float32 result may differ from the reference by a few units of
# float32 rounding (eps = 1.2e-7) — the kernels add in a different order and
# accumulate matmuls tile by tile; a bf16 result by a few bf16 units (eps =
# 7.8e-3). Exact stages (ids, sets, copies) must match exactly. The picture:
# one bar per stage and dtype (log scale), "exact" at the bottom edge for a
# zero difference, each dtype's machine epsilon dashed.

# %%
eps = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
for (name, dtype), (kind, err) in results.items():
    limit = 0.0 if kind != "relative max error" else 16 * eps[dtype]
    assert err <= limit, f"{name} {dtype}: {kind} {err:.2e} > {limit:.2e}"
print("every stage agrees with its reference: exact where it must be, within a few ulps elsewhere")
vk.stage_errors(results, eps, f"naive vs Triton ({stagewise.kernels.TRITON_MODE}), tiny config, T in {token_counts}")

# %% [markdown]
# ### The whole model
#
# Stage by stage agreement should add up to the same model. On the tiny model
# (2 layers, random weights): one prefill's logits, naive vs Triton stages
# (FlashAttention), and the paged engine's greedy tokens (paged attention, the
# KV store) for all three tiers, `backend="torch"` (the default) included.

# %%
small = EngineConfig(max_model_len=128)
engines = {
    b: LLM("tiny", backend=b, mode="paged", device=str(DEVICE), dtype=torch.float32, engine_config=small)
    for b in ("naive", "torch", "triton")
}
ids = engines["naive"].tokenizer.encode("the cat sat on the mat and then ran far away")
batch = ForwardBatch.from_sequences([ids, ids[:9]], [0, 0], DEVICE)
logits = {b: engines[b].model.forward(batch, NoKVCache(batch.cu_seqlens_q)) for b in ("naive", "triton")}
diff, scale = float((logits["naive"] - logits["triton"]).abs().max()), float(logits["naive"].abs().max())
print(f"prefill logits [2, {config.vocab_size}]: max |naive - triton| = {diff:.1e} (largest logit {scale:.1f})")
assert diff <= 1e-4 * scale

prompts = ["the cat sat on the mat", "hello there", "a dog ran quickly away from the market"]
params = SamplingParams(max_tokens=4 if QUICK else 8, temperature=0, ignore_eos=True)
tokens = {b: [o.token_ids for o in e.generate(prompts, params)] for b, e in engines.items()}
assert tokens["naive"] == tokens["torch"] == tokens["triton"]
print("paged engine, 3 requests: the naive, torch and triton tiers generate the same tokens")

# %% [markdown]
# ## 6. Measure: naive vs Triton speed, on a GPU
#
# `stagewise.bench.commands.stages.run_stages` times both paths of every stage at
# a prefill and a decode shape, alternated after a warm-up, synchronized,
# medians (`stagewise.bench.harness.timing.compare`): on a GPU, here, on SmolLM2's
# shapes in bfloat16. Without a GPU the cell says so: the interpreter's times
# mean nothing.

# %% tags=["timing"]
if ON_GPU:
    vk.print_stage_bench(run_stages(StagesSettings(prefill_tokens=512, decode_tokens=8, repeats=10 if QUICK else 30)))
else:
    print("no GPU here: the checks above prove the kernels right; timing them needs a GPU")

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# * `vllm/attention/ops/triton_unified_attention.py`: `kernel_unified_attention_2d`
#   is one Triton kernel for prefills, chunks and decodes over the paged cache
#   (sections 2-3 here), `kernel_unified_attention_3d` its split-K form for
#   long decodes and `reduce_segments` the merge of section 4.
# * `vllm/v1/attention/backends/flash_attn.py`, `FlashAttentionImpl.forward`:
#   the default backend on NVIDIA GPUs, which stores the new K/V through the
#   slot mapping (`reshape_and_cache_flash`) and calls the FlashAttention
#   library's variable-length kernel with the block table.
# * `vllm/model_executor/layers/linear.py`, `QKVParallelLinear` and
#   `RowParallelLinear`: the projections, whose GEMMs vLLM leaves to cuBLAS
#   (`torch.nn.functional.linear`) rather than to a Triton kernel.
#
# %% [markdown]
# ## Takeaways
#
# * Every optimized stage computes what its reference computes: identical ids,
#   sampling sets and copies, float results within a few units of rounding in
#   float32 and bfloat16; the assembled model gives the same logits and tokens.
# * FlashAttention and paged attention share one loop: the causal bounds skip
#   the K/V tiles above the diagonal and mask only its band; paged attention
#   differs only in how a key's address is found (block table -> slot).
#   Split-K cuts the keys across programs and merges their (max, sum, acc)
#   states exactly.
# * The interpreter makes the kernels checkable anywhere; only a GPU makes
#   them measurable (`stagewise bench stages` there, or section 6).
#
# ## Exercises
#
# A stub to fill in, a check cell below it (**PASS**, **FAIL** with the worst
# mismatch, or **not yet**). Solutions: `notebooks/solutions/nb12b.py`.
#
# **1. Split-K's merge.** Flash decoding cuts one decode query's keys into `S`
# ranges; range `s` ends with its own online-softmax state: `m[s]` (its max
# score), `l[s] = sum exp(score - m[s])` and `acc[s] = sum exp(score - m[s]) v`.
# Merge them exactly into the attention output `[d]` (what
# `kernels/split_k.py` does on the GPU): rescale each split to the common
# max, then divide. The check compares with the attention stage.

# %%
from stagewise.exercises import check  # noqa: E402


def my_merge_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:  # noqa: E741
    raise NotImplementedError


# %%
check("12b.merge_splits", my_merge_splits)

# %% [markdown]
# **2. Softmax in base 2.** The kernels never call `exp`: they multiply the
# scores by `scale * log2(e)` once and use `exp2`, a single GPU instruction.
# Write `softmax(scores * scale)` over the last axis with `torch.exp2` only
# (subtract the row max first, in base-2 units).


# %%
def my_softmax_exp2(scores: torch.Tensor, scale: float) -> torch.Tensor:
    raise NotImplementedError


# %%
check("12b.softmax_exp2", my_softmax_exp2)

# %% [markdown]
# The tests that cover this notebook's kernels (every stage's Triton tier against its naive one), and
# its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels tests/stages
#     .venv/bin/python -m pytest -q tests/exercises -k 12b
