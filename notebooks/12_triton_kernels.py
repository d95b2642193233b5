# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · The Triton kernels: what each one changes, and the proof it computes the same thing
#
# Every stage in `stagewise.stages` has two paths with the same signature: a
# **naive** PyTorch reference, written to be read, and an **optimized** path
# that launches a Triton kernel (`stagewise/kernels/`). The naive path is
# correct by inspection; the kernel is fast by design; this notebook connects
# the two.
#
# The optimizations fall into a few families, all about moving fewer bytes
# between memory and the compute units (notebook 11: most of inference is
# memory-bound):
#
# * **fusion** — do several element-wise steps in one pass over the data, so
#   intermediates never go back to memory;
# * **tiling** — cut a GEMM into tiles that fit in fast on-chip memory and
#   reuse each loaded tile many times;
# * **online softmax** — attention without ever storing the `[N, N]` score
#   matrix;
# * **indirection** — read K/V through a block table, write them through a
#   slot mapping (the paged cache);
# * **no sort** — sampling thresholds found by counting, not sorting.
#
# Where do the kernels run? On an NVIDIA GPU, compiled. Without one,
# `import stagewise.kernels` switches Triton to its **CPU interpreter**
# (`TRITON_INTERPRET=1`), which executes every program instance in Python:
# exactly the same kernel code, hence a real correctness check, but orders of
# magnitude slower than anything compiled. **Interpreter timings say nothing
# about kernel speed.** On a CPU this notebook therefore checks and explains;
# on a GPU its last section also measures.
#
# Path: motivation -> the registry (naive vs optimized, side by side) ->
# optimized: what each kernel changes -> check (every stage, two dtypes,
# irregular sizes; the whole model) -> measure (GPU only) -> picture.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the whole-model check
# generates 4 tokens instead of 8 and the interpreter timing table (CPU only)
# covers the decode shape only. The per-stage check is the same (it takes a
# few seconds even in the interpreter, on the tiny config's shapes).

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import stagewise.kernels  # first: decides GPU or interpreter before any kernel is defined
from stagewise import LLM, SamplingParams
from stagewise.bench.stage_bench import StagesSettings, run_stages
from stagewise.config import PRESETS, EngineConfig
from stagewise.kernels.attention_common import online_softmax_reference
from stagewise.kernels.sampling import sample_with_mask
from stagewise.models.forward_batch import ForwardBatch, NoKVCache
from stagewise.stages import STAGES
from stagewise.stages.sampling import processed_probs

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
ON_GPU = stagewise.kernels.TRITON_MODE == "cuda"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
print(f"Triton runs on: {stagewise.kernels.TRITON_MODE}" + ("" if ON_GPU else " (correctness only, not speed)"))

# %% [markdown]
# ## 1. The registry: one row per stage
#
# `STAGES` maps each stage name to its two paths, its shapes and a one-line
# description of what the optimized path is.

# %%
for name, stage in STAGES.items():
    print(f"{name:>15}  {stage.shapes:<66} {stage.optimized_kind}")

# %% [markdown]
# ## 2. What each kernel changes
#
# * **embedding** (`kernels/embedding.py`): wide, masked copies of a tile of
#   token rows per program. A pure copy, 0 FLOPs: only bandwidth matters.
# * **rmsnorm** (`kernels/rmsnorm.py`): residual add and norm **fused**, one
#   program per row; the row stays in registers (4 row passes instead of 5,
#   one launch instead of two).
# * **qkv_proj, o_proj** (`kernels/matmul.py`): a **tiled** GEMM with fp32
#   accumulation and grouped tile order: each loaded weight tile is reused by
#   a whole tile of rows, and neighbouring tiles share what is in L2.
#   Decode shapes (M <= 16 rows) go to a **split-K** kernel
#   (`kernels/matmul_decode.py`): K is cut into ranges, one program per
#   (columns, range), so enough programs stream the weights at once; the
#   fp32 partials are added in a fixed order, so results are deterministic.
# * **rope** (`kernels/rope.py`): in place on the strided q/k views of the
#   fused QKV output: read once, written once, nothing allocated.
# * **kv_store** (`kernels/kv_store.py`): one scatter through `slot_mapping`,
#   K and V in one launch; the slot hides whether the cache is paged.
# * **attention** (`kernels/flash_attention.py`): **FlashAttention**: a Q tile
#   in registers, K/V streamed past it tile by tile with the **online
#   softmax**, fully masked causal tiles never loaded. S = QK^T and P are never
#   written: O(N) extra memory instead of O(N^2). The traffic stays quadratic:
#   K/V are re-read once per query tile, Theta(N^2 d^2 / M) per head for an
#   on-chip memory M (notebook 05 counts the bytes). A tile's rows are
#   (query, head) pairs of one GQA group, so a decode step reads K/V once per
#   KV head.
# * **paged_attention** (`kernels/paged_attention.py`): the same online
#   softmax with K/V read **through the block table** (no gathered copy of the
#   cache); the G query heads of a KV head form one tile, so K/V are read once
#   per KV head (GQA); split-K for long decodes.
# * **ffn** (`kernels/matmul.py`, `kernels/activation.py`): tiled GEMMs and a
#   **fused** `silu(gate) * up`: `[T, 2*inter]` read once, `[T, inter]`
#   written once.
# * **lm_head** (`kernels/matmul.py`): the GEMM reads `hidden` rows through
#   `last_token_index` and `weight.T` through its strides: no gathered copy,
#   no transposed copy.
# * **sampling** (`kernels/sampling.py`): penalty, temperature, min_p, top-k,
#   top-p and the draw **fused** into a few streaming passes, each row's
#   vocabulary split across programs; thresholds by a radix search over the
#   float bits, **no sort**, no `[B, vocab]` intermediates.
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
#
# ## 3. Check: naive vs Triton for every stage
#
# Each stage's `example_inputs(config, num_tokens, device, dtype)` builds the
# same keyword arguments for both paths (seeded, so two calls give identical
# inputs). We run both paths on fresh copies, with the tiny config's shapes
# (small enough for the interpreter), at irregular token counts (1, 7, 33:
# a decode, and sizes that are not multiples of any tile) and in float32 and
# bfloat16, and compare:
#
# * tensors: the largest absolute difference, divided by the largest
#   magnitude of the reference (so float32 and bf16 read on one scale);
# * `kv_store` returns nothing: compare the caches it wrote;
# * `tokenize`: the ids must be identical (its optimized path is the Rust
#   `tokenizers` library, not Triton);
# * `sampling`: the kernel's draws use their own random stream, so compare the
#   *set of tokens each row may draw* (`sample_with_mask` vs
#   `processed_probs > 0`) — it must be identical.

# %%
config = PRESETS["tiny"]
token_counts = (1, 7, 33)
dtypes = (torch.float32, torch.bfloat16)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def compare_stage(name: str, num_tokens: int, dtype: torch.dtype) -> tuple[str, float]:
    """(kind, error) for one stage: a relative max-abs error for tensors, a count of mismatches otherwise."""
    stage = STAGES[name]
    ref_in = stage.example_inputs(config, num_tokens, DEVICE, dtype)
    opt_in = stage.example_inputs(config, num_tokens, DEVICE, dtype)
    if name == "sampling":
        _, allowed = sample_with_mask(**opt_in)
        return "set mismatches", float((allowed != (processed_probs(**ref_in) > 0)).sum())
    ref, opt = stage.naive(**ref_in), stage.optimized(**opt_in)
    if name == "tokenize":
        return "ids differing", float((ref != opt).sum())
    if stage.outputs:
        pairs = list(zip(as_tuple(ref), as_tuple(opt)))
    else:  # writes in place: compare what it wrote
        written = [k for k, v in ref_in.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        pairs = [(ref_in[k], opt_in[k]) for k in written]
    err = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    scale = max(float(a.float().abs().max()) for a, _ in pairs)
    return "relative max error", err / max(scale, 1e-30)


results = {}  # (stage, dtype) -> worst over token counts
for name in STAGES:
    for dtype in dtypes:
        checks = [compare_stage(name, n, dtype) for n in token_counts]
        results[name, dtype] = (checks[0][0], max(e for _, e in checks))

print(f"{'stage':>15} {'what is compared':>20} {'float32':>10} {'bfloat16':>10}")
for name in STAGES:
    kind = results[name, torch.float32][0]
    print(f"{name:>15} {kind:>20} {results[name, torch.float32][1]:>10.2e} {results[name, torch.bfloat16][1]:>10.2e}")

# %% [markdown]
# Tolerances: a float32 result may differ from the reference by a few units of
# float32 rounding (eps = 1.2e-7) — the kernels add in a different order and
# accumulate matmuls tile by tile; a bf16 result by a few bf16 units (eps =
# 7.8e-3). Exact stages (ids, sets, copies) must match exactly.

# %%
eps = {torch.float32: torch.finfo(torch.float32).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps}
for (name, dtype), (kind, err) in results.items():
    limit = 0.0 if kind != "relative max error" else 16 * eps[dtype]
    assert err <= limit, f"{name} {dtype}: {kind} {err:.2e} > {limit:.2e}"
print("every stage agrees with its reference: exact where it must be, within a few ulps elsewhere")

# %% [markdown]
# ### The picture: per-stage error
#
# One bar per stage and dtype (log scale); a bar at the bottom edge marked
# "exact" means zero difference. The dashed lines are each dtype's machine
# epsilon: the kernels sit within a few units of rounding of the reference.

# %%
floor = 1e-10
names = [n for n in STAGES if results[n, torch.float32][0] == "relative max error"]
exact_stages = [n for n in STAGES if n not in names]
x = np.arange(len(names))
fig, ax = plt.subplots(figsize=(12, 5))
for offset, dtype, color in ((-0.2, torch.float32, "tab:blue"), (0.2, torch.bfloat16, "tab:orange")):
    errs = [results[n, dtype][1] for n in names]
    bars = ax.bar(x + offset, [max(e, floor) for e in errs], 0.4, color=color, label=str(dtype).removeprefix("torch."))
    for b, e in zip(bars, errs):
        if e == 0:
            ax.text(b.get_x() + b.get_width() / 2, floor * 1.5, "exact", ha="center", va="bottom", rotation=90)
    name = str(dtype).removeprefix("torch.")
    ax.axhline(eps[dtype], color=color, ls="--", lw=1, label=f"{name} eps {eps[dtype]:.1e}")
ax.set_yscale("log")
ax.set_ylim(floor, 0.1)
ax.set_xticks(x, names, rotation=30)
ax.set_ylabel("max |triton - naive| / max |naive|")
ax.set_title(
    f"naive vs Triton ({stagewise.kernels.TRITON_MODE}), tiny config, T in {token_counts}; "
    f"exact matches also for: {', '.join(exact_stages)}"
)
ax.legend(fontsize=8, ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### The whole model
#
# Stage by stage agreement should add up to the same model. Two checks on the
# tiny model (2 layers, random weights): the logits of one prefill through the
# Llama forward built from naive stages vs from Triton stages
# (`backend="triton"`; the prefill runs FlashAttention), and greedy tokens from
# the paged engine (paged attention, KV store through the slot mapping),
# requests batched together.

# %%
small = EngineConfig(max_model_len=128)
engines = {
    b: LLM("tiny", backend=b, mode="paged", device=str(DEVICE), dtype=torch.float32, engine_config=small)
    for b in ("naive", "triton")
}
ids = engines["naive"].tokenizer.encode("the cat sat on the mat and then ran far away")
batch = ForwardBatch.from_sequences([ids, ids[:9]], [0, 0], DEVICE)
logits = {b: e.model.forward(batch, NoKVCache(batch.cu_seqlens_q)) for b, e in engines.items()}  # [2, vocab]
diff = float((logits["naive"] - logits["triton"]).abs().max())
scale = float(logits["naive"].abs().max())
print(f"prefill logits [2, {config.vocab_size}]: max |naive - triton| = {diff:.1e} (largest logit {scale:.1f})")
assert diff <= 1e-4 * scale

prompts = ["the cat sat on the mat", "hello there", "a dog ran quickly away from the market"]
params = SamplingParams(max_tokens=4 if QUICK else 8, temperature=0, ignore_eos=True)
tokens = {b: [o.token_ids for o in e.generate(prompts, params)] for b, e in engines.items()}
assert tokens["naive"] == tokens["triton"]
print("paged engine, 3 requests: naive and Triton backends generate the same tokens")

# %% [markdown]
# ## 4. Measure: naive vs Triton speed
#
# `stagewise.bench.stage_bench.run_stages` times both paths of every stage at
# a prefill shape and a decode shape, alternating them after a warm-up,
# synchronized, medians with p10/p90 (`stagewise.bench.timing.compare`).
#
# * **On a GPU**: the real SmolLM2 shapes in bfloat16. This is where the
#   kernels are meant to win: fusions save memory passes, FlashAttention
#   avoids the score matrix, the sampler avoids the sort.
# * **On a CPU**: the kernels run in the interpreter, one Python call per
#   program instance per operation. The table below is printed so you can see
#   *how* much slower that is; it is a statement about the interpreter, not
#   about the kernels, and no conclusion about speed may be drawn from it.

# %%
if ON_GPU:
    bench = run_stages(StagesSettings(prefill_tokens=512, decode_tokens=8, repeats=10 if QUICK else 30))
    rows = bench["rows"]
    print(f"{'stage':>15} {'shape':>14} {'naive ms':>9} {'triton ms':>10} {'speed-up':>9}")
    for r in rows:
        opt = r["optimized_ms"]
        print(f"{r['stage']:>15} {r['shape']:>14} {r['naive_ms']:>9.3f} {opt or float('nan'):>10.3f} "
              f"{(r['speedup'] or float('nan')):>8.2f}x")
else:
    shapes = dict(prefill_tokens=16, decode_tokens=1)
    bench = run_stages(StagesSettings(model="tiny", repeats=1, warmup=0, **shapes))
    rows = [r for r in bench["rows"] if not QUICK or r["phase"] == "decode"]
    print(f"Triton {bench['note']}")
    print(f"{'stage':>15} {'shape':>14} {'naive ms':>9} {'interpreter ms':>15}  (tiny config, one call each)")
    for r in rows:
        opt = r["optimized_ms"]
        opt = opt if opt is not None else float("nan")
        print(f"{r['stage']:>15} {r['shape']:>14} {r['naive_ms']:>9.3f} {opt:>15.3f}")

# %% [markdown]
# On a GPU, the picture: per stage and shape, median milliseconds of the naive
# PyTorch path and the Triton kernel (log scale), and the speed-up. On a CPU
# there is no speed picture to draw — the error chart above is this
# notebook's figure there.

# %%
if ON_GPU:
    from stagewise.bench.plots import plot_stage_times

    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [3, 2]})
    s = bench["settings"]
    plot_stage_times(rows, ax=left, note=f"{s['model']} config, {s['device']}, {s['dtype']}")
    labels = [f"{r['stage']} {r['phase']}" for r in rows]
    speedups = [r["speedup"] or 0.0 for r in rows]
    right.barh(labels, speedups, color=["tab:green" if v >= 1 else "tab:red" for v in speedups])
    right.axvline(1.0, color="black", lw=1)
    right.set_xscale("log")
    right.set_xlabel("speed-up of Triton over naive (x, log)")
    right.invert_yaxis()
    plt.tight_layout()
    plt.show()
else:
    print("no GPU: skipping the speed picture (interpreter timings are not speed measurements)")

# %% [markdown]
# ## 5. Measured on a real GPU: the committed device check
#
# A GPU is not always at hand, so the project keeps the results of its device
# check (`bash benchmarks/gpu/run.sh`, see `benchmarks/gpu/README.md`) in
# `benchmarks/results/<gpu>/device_check.json`. Each kernel is timed from a
# replayed CUDA graph (GPU time, without Python's launch cost) at Llama-3-8B
# shapes in bfloat16, with inputs larger than the GPU's L2 cache, and compared
# with what it should be compared with:
#
# * a **memory-bound** kernel (RMSNorm, RoPE, silu_and_mul, embedding, KV store,
#   paged decode attention) with the GPU's own device-to-device copy bandwidth —
#   nothing that reads and writes its bytes once can beat a copy;
# * a **compute-bound** kernel (prefill GEMMs, FlashAttention) with the vendor
#   library doing the same work (`torch.matmul` = cuBLAS, SDPA = cuDNN/flash).
#
# The cell below reads those files and computes every ratio it shows.

# %%
results_root = Path(stagewise.__file__).resolve().parents[1] / "benchmarks" / "results"
checks = sorted(results_root.glob("*/device_check.json"))
measured = []
for path in checks:
    run = json.loads(path.read_text())
    env = run["sections"].get("env", {})
    gpu = (env.get("gpu") or {}).get("name", path.parent.name)
    copy_gbs = env.get("copy", {}).get("gb_per_s")
    print(f"{gpu}: copy bandwidth {copy_gbs:,.0f} GB/s; bf16 torch.matmul {env['matmul_bf16']['tflops']:,.0f} TFLOP/s")
    for row in run["sections"].get("kernels", {}).get("rows", []):
        if "error" in row:
            continue
        if "share_of_copy" in row:
            measured.append((gpu, row["kernel"], row["shape"], row["share_of_copy"], "share of copy bandwidth"))
        elif "ratio_vs_stock" in row and row["kernel"] != "sampling":
            measured.append((gpu, row["kernel"], row["shape"], row["ratio_vs_stock"], f"vs {row['stock']}"))
for _gpu, kernel, shape, value, what in measured:
    print(f"  {kernel:>17} {shape:<58} {value:6.2f}  {what}")
if not checks:
    print("no device-check results committed yet: run benchmarks/gpu/run.sh on a GPU")

# %% [markdown]
# The same numbers as a picture: 1.0 is the ceiling (the copy, or the vendor
# library). Memory-bound kernels that stay far below 1.0 leave bandwidth
# unused — usually too few bytes in flight per program; compute-bound kernels
# below 1.0 use the tensor cores less well than the library's hand-tuned code.

# %%
if measured:
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(measured) + 1.5))
    labels = [f"{k} {s.split(' ', 1)[1][:40]}" for _, k, s, _, _ in measured]
    values = [v for *_, v, _ in measured]
    colors = ["tab:blue" if "copy" in w else "tab:orange" for *_, w in measured]
    ax.barh(labels, values, color=colors)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xlabel("fraction of the ceiling (blue: copy bandwidth, orange: vendor library)")
    ax.invert_yaxis()
    ax.set_title(f"Triton kernels on {measured[0][0]}, bfloat16, Llama-3-8B / SmolLM2 shapes")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## Takeaways
#
# * Every optimized stage computes what its reference computes: identical ids,
#   identical allowed sampling sets, identical copies, and float results within
#   a few units of rounding in float32 and bfloat16; the assembled model
#   gives the same logits and the same tokens.
# * What the kernels change is data movement: fusion (rmsnorm + residual,
#   silu_and_mul, the sampler), tiling (GEMMs), the online softmax
#   (FlashAttention, paged attention), indirection (block table, slot mapping)
#   and a sort replaced by counting.
# * The interpreter makes the kernels checkable anywhere; only a GPU makes
#   them measurable (`stagewise bench stages` there, or this notebook's last
#   section).
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb12.py`.
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
check("12.merge_splits", my_merge_splits)

# %% [markdown]
# **2. Softmax in base 2.** The kernels never call `exp`: they multiply the
# scores by `scale * log2(e)` once and use `exp2`, a single GPU instruction.
# Write `softmax(scores * scale)` over the last axis with `torch.exp2` only
# (subtract the row max first, in base-2 units).


# %%
def my_softmax_exp2(scores: torch.Tensor, scale: float) -> torch.Tensor:
    raise NotImplementedError


# %%
check("12.softmax_exp2", my_softmax_exp2)
