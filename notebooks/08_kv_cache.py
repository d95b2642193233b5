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
# # 08 · Naive recompute vs KV cache
#
# The seeds (chapter 5) start from the most literal way to generate text.
# To continue "大模型是" the model reads `["大", "模型", "是"]` through every
# layer and predicts "未"; to predict the next word it reads
# `["大", "模型", "是", "未"]` through every layer *again*, and so on. Each step
# recomputes everything it computed the step before, plus one token.
#
# For a context of N tokens, L layers and hidden size d, one such step costs
#
#     naive step:   O(L * (N * d^2  +  N^2 * d))     every token through every matmul, full N x N attention
#
# The fix (chapter 6) comes from one observation: the **keys and values of
# old tokens never change**. Token 3's K and V in layer 12 depend only on
# tokens 1..3, and those are fixed. So keep them (the KV cache) and run only
# the *new* token through the model:
#
#     cached step:  O(L * (d^2  +  N * d))           one token through every matmul, 1 x N attention
#
# The linear layers go from O(N) to O(1) per step, attention from O(N^2) to
# O(N). The price is memory that grows with N: every token keeps its K and V
# in every layer.
#
# This notebook runs both modes of the engine on the real model:
# `LLM(mode="naive")` (`engine/naive_runner.py`, no cache) and
# `LLM(mode="kv")` (`engine/kv_runner.py`, contiguous per-request cache).
# Path: motivation -> naive -> optimized (cache) -> check (same tokens) ->
# measure (time per output token vs context length) -> picture (measured
# curves with the seeds' cost models fitted, and the FLOP counts far beyond
# what a CPU can run).
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the timing sweeps contexts up
# to 256 tokens (instead of 512) with one repeat instead of two, and the
# same-tokens check generates 8 tokens instead of 16. Same measurements,
# fewer points.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import contextlib
import io
import os
import statistics

import matplotlib.pyplot as plt
import numpy as np
import torch

from stagewise import LLM, SamplingParams
from stagewise.bench.commands.modes import eval_fit, fit_cost
from stagewise.bench.harness.timing import alternating, stream_timed
from stagewise.bench.harness.workloads import single_prompt
from stagewise.calc.counts import attention_flops, linear_flops
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.roofline import analyze, seeds_table
from stagewise.config import PRESETS
from stagewise.kv.paged import kv_bytes_per_token
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.trace.tracer import Tracer

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
loaded = load_model("smollm2-135m", device="cpu")  # float32 on the CPU, even on a GPU machine: exact checks
cfg = loaded.config
with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once
    naive = LLM(loaded, mode="naive")  # recompute the whole sequence every step
kv = LLM(loaded, mode="kv")  # keep K/V of every token, compute only the new one
print(f"L={cfg.num_layers} layers, hidden d={cfg.hidden_size}, H={cfg.num_heads}, Hkv={cfg.num_kv_heads}")

# %% [markdown]
# ## 1. Check first: the same tokens
#
# A cache is an optimization, not a different model: both modes must produce
# the same greedy tokens. If they did not, comparing their speed would be
# comparing different work.

# %%
prompt = "The keys and values of old tokens never change, so"
params = SamplingParams(max_tokens=8 if QUICK else 16, temperature=0, ignore_eos=True)
out_naive = naive.generate(prompt, params)[0]
out_kv = kv.generate(prompt, params)[0]
print("naive:", repr(out_naive.text))
print("kv   :", repr(out_kv.text))
assert out_naive.token_ids == out_kv.token_ids, "the two modes must generate the same tokens"
print(f"identical {len(out_kv.token_ids)} tokens")
print(f"rows pushed through the model: naive {naive.last_stats.tokens_computed}, kv {kv.last_stats.tokens_computed}")

# %% [markdown]
# The counters already tell the story: to produce n tokens from a P-token
# prompt, naive mode pushes P + (P+1) + ... + (P+n-1) rows through the model,
# the KV cache P + (n-1).
#
# ## 2. What one step computes, traced
#
# The tracer records every stage call with its tensor shapes. Look at the
# attention stage of layer 0 in each step: the queries `q` and the keys `k`
# it attends over.

# %%
short = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
for name, llm in (("naive", naive), ("kv", kv)):
    with Tracer(timing=False) as tracer:
        llm.generate(prompt, short)
    for step in tracer.steps:
        att = next(s for s in step.stages if s.stage == "attention" and s.layer == 0)
        shapes = {t.name: t.label() for t in att.inputs}
        used = f", reads {step.batch['seq_lens'][0]} of them" if "seq_lens" in step.batch else ""
        print(f"{name:>5} step {step.index}: {step.num_tokens:>3} token(s) computed | q {shapes['q']:<34} "
              f"k {shapes['k']}{used}")

# %% [markdown]
# * **naive**: every step pushes the whole sequence (the prompt's tokens, then
#   one more each step) through all 30 layers, recomputing queries, keys and
#   values that the previous step already had.
# * **kv**: the prefill computes the prompt's tokens once and stores their K
#   and V; each later step computes **one** token: a `[1, H, d]` query against
#   the cached keys (the cache holds room for the whole request, prompt +
#   `max_tokens` slots; the step reads the first `seq_lens` of them).
#
# ## 3. Why only K and V? The query is consumed
#
# The seeds' "aha": a query is the *current token's intent*. To predict token
# N+1 we need q of token N against K and V of tokens 1..N. Token N's query is
# never needed again once that step is done; every old token's K and V are
# needed by *every* later query. So K and V are cached and Q is thrown away.
#
# Check it with the attention stage itself (random q, k, v with SmolLM2's head
# shapes): the last row of full causal attention equals attention of the last
# query alone against all keys, and changing every *earlier* query changes
# nothing in that row, while changing one earlier key does.

# %%
attention = STAGES["attention"].naive
n = 12
g = torch.Generator().manual_seed(0)
q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)  # [N, H, d]
k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)  # [N, Hkv, d]
v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
scale = cfg.head_dim**-0.5
whole = AttentionMetadata.build([n], [n], "cpu", k_starts=[0, n])  # n queries on n keys: a prefill
one = AttentionMetadata.build([1], [n], "cpu", k_starts=[0, n])  # 1 query on n keys: a decode

full = attention(q=q, k=k, v=v, metadata=whole, scale=scale)  # [N, H, d]: a prefill
last_only = attention(q=q[-1:], k=k, v=v, metadata=one, scale=scale)  # [1, H, d]: a decode
torch.testing.assert_close(last_only[0], full[-1])

q_changed = q.clone()
q_changed[:-1] = torch.randn(n - 1, cfg.num_heads, cfg.head_dim, generator=g)  # every old query replaced
k_changed = k.clone()
k_changed[3] += 1.0  # one old key nudged
out_q = attention(q=q_changed, k=k, v=v, metadata=whole, scale=scale)[-1]
out_k = attention(q=q, k=k_changed, v=v, metadata=whole, scale=scale)[-1]
print("last query alone == last row of the full attention:", True)
print(f"replace all old queries -> last row changes by {float((out_q - full[-1]).abs().max()):.1e}")
print(f"nudge one old key       -> last row changes by {float((out_k - full[-1]).abs().max()):.1e}")

# %% [markdown]
# ### The price: memory that grows with the context
#
# K and V of every token, every layer, every KV head:
# `2 * L * Hkv * d * bytes`. SmolLM2 has only 3 KV heads (GQA; notebook 11
# compares with full multi-head attention), so this is small per token, but it
# grows linearly with N and with the number of users.

# %%
per_token = kv_bytes_per_token(cfg, loaded.dtype)
print(f"KV per token: 2 * {cfg.num_layers} * {cfg.num_kv_heads} * {cfg.head_dim} * 4 B = {per_token:,} B")
for tokens in (1_000, 8_192):
    print(f"  one sequence of {tokens:>5} tokens: {per_token * tokens / 2**20:7.1f} MiB")
held = kv.last_stats.kv_cache_bytes
print(f"the last kv run allocated {held / 2**20:.2f} MiB: {held // per_token} tokens (prompt + max_tokens) of room")

# %% [markdown]
# ## 4. Measure: time per output token against the context length
#
# For each context length N we build a prompt of exactly N tokens
# (`stagewise.bench.harness.workloads.single_prompt`) and generate a few tokens in
# each mode (3 naive, 6 cached), greedy, ignoring EOS. The *gaps* between
# output tokens are single steps at context N+1, N+2, ...: in naive mode each
# is a full recompute of the whole sequence, with the cache each is one token. The modes
# alternate (naive, kv, naive, kv...) so a slow moment of the machine hits
# both, and both must again produce the same tokens. A warm-up run per mode
# comes first.
#
# Single steps can be slow outliers (the faint dots: anything else the
# machine does lands in one step); the medians and the fitted curves are the
# robust part.

# %% tags=["timing"]
contexts = [16, 64, 128, 256] if QUICK else [16, 64, 128, 256, 384, 512]
repeats = 1 if QUICK else 2
llms = {"naive": naive, "kv": kv}
# a cached step is cheap, so take more of them: 5 gaps per kv run, 2 per (expensive) naive run
timing_params = {
    "naive": SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
    "kv": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
}
for mode, llm in llms.items():  # warm-up
    stream_timed(llm, [single_prompt(loaded.tokenizer, 8)], [timing_params[mode]])

gaps = {(mode, n): [] for mode in llms for n in contexts}
for n in contexts:
    prompt_n = single_prompt(loaded.tokenizer, n, seed=0)
    tokens = {}
    for _rep, mode in alternating(list(llms), repeats):
        (req,) = stream_timed(llms[mode], [prompt_n], [timing_params[mode]])
        tokens[mode] = req.token_ids
        gaps[mode, n] += [1000 * t for t in req.metrics().tbt]
    assert tokens["naive"] == tokens["kv"][:3], f"N={n}: modes disagree"

ms = {mode: [statistics.median(gaps[mode, n]) for n in contexts] for mode in llms}
print(f"{'N':>5} {'naive ms/token':>15} {'kv ms/token':>12} {'naive / kv':>11}")
for i, n in enumerate(contexts):
    print(f"{n:>5} {ms['naive'][i]:>15.1f} {ms['kv'][i]:>12.1f} {ms['naive'][i] / ms['kv'][i]:>10.1f}x")

# %% [markdown]
# ### Fit the seeds' cost models
#
# `stagewise.bench.commands.modes.fit_cost` fits non-negative least squares:
# naive `t(N) = a + b*N + c*N^2` and cached `t(N) = a + b*N` (the seeds'
# complexities with the constant factors left to the data).

# %%
fits = {"naive": fit_cost(contexts, ms["naive"], (0, 1, 2)), "kv": fit_cost(contexts, ms["kv"], (0, 1))}
for mode, fit in fits.items():
    print(f"{mode:>5}: t(N) = {fit['label']}   (R^2 = {fit['r2']:.3f})")

# %% [markdown]
# ## 5. Beyond what this CPU can run: the FLOP counts
#
# The calculator (`stagewise.calc.roofline.analyze`, notebook 11) counts the
# FLOPs of one step exactly for SmolLM2: a naive step is a full forward pass
# over N tokens with the full masked N x N attention, a cached step one token
# with attention over N keys. The ratio is the speed-up the cache can give.

# %%
context_limit = cfg.max_position_embeddings  # the longest sequence the model was trained for
grid = [2**i for i in range(3, context_limit.bit_length())]  # 8 .. the context limit, powers of two
print(f"SmolLM2's context limit: {context_limit:,} tokens; N = {grid[0]} .. {grid[-1]:,}")
hw = HARDWARE["h100"]  # the FLOP counts do not depend on the hardware
steps = [analyze(cfg, hw, context=n, batch=1, dtype="fp32") for n in grid]
naive_flops = [s.naive.flops.value for s in steps]
cached_flops = [s.decode.flops.value for s in steps]
for n, a, b in zip(grid, naive_flops, cached_flops):
    if n in (8, 64, 512, 4096, grid[-1]):
        print(f"N={n:>5}: naive {a / 1e9:9.2f} GFLOP, cached {b / 1e9:6.3f} GFLOP, ratio {a / b:7.0f}x")


def naive_crossover(c) -> float:
    """N where a naive step's attention (full N x N, a N^2) equals its linear FLOPs (b N + c: the head once)."""
    a = attention_flops(c, context=1, new_tokens=1, causal=False).value  # 4 L (H d) per (query, key) pair
    per_token = linear_flops(c, 2).value - linear_flops(c, 1).value  # the blocks' 2 L (matmul weights) per token
    head = linear_flops(c, 1).value - per_token  # the LM head, paid once per step: 2 V hidden
    return (per_token + (per_token**2 + 4 * a * head) ** 0.5) / (2 * a)


for name in ("smollm2-135m", "llama-3-405b"):
    c = PRESETS[name]
    n_x = naive_crossover(c)
    at = round(n_x)
    check_a, check_l = attention_flops(c, at, at, causal=False).value, linear_flops(c, at).value
    print(f"{name}: attention = linear layers at N ~ {n_x:,.0f} = {n_x / c.hidden_size:.2f} x hidden "
          f"(at N = {at:,}: attention {check_a:.3e}, linear {check_l:.3e} FLOPs)")
crossover = naive_crossover(cfg)

# %% [markdown]
# ## 6. The picture
#
# Left: measured milliseconds per output token (points) and the fitted cost
# models (lines). Right: FLOPs of one step for SmolLM2 from the calculator,
# log-log, over the whole 8k context; the shaded band is what we measured.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
colors = {"naive": "tab:red", "kv": "tab:blue"}
dense = np.linspace(min(contexts), max(contexts), 100)
for mode in llms:
    for n in contexts:
        left.plot([n] * len(gaps[mode, n]), gaps[mode, n], ".", color=colors[mode], alpha=0.3)
    left.plot(contexts, ms[mode], "o", color=colors[mode], label=f"{mode}: median of the measured steps")
    fitted = eval_fit(fits[mode], list(dense))
    left.plot(dense, fitted, "-", color=colors[mode], label=f"{mode} fit: {fits[mode]['label']}")
left.set_xlabel("context length N (tokens)")
left.set_ylabel("time per output token (ms)")
left.set_yscale("log")
left.set_title("measured on this CPU: recompute grows with N, the cache stays flat")
left.grid(True, which="both", alpha=0.3)
left.legend(fontsize=8)

c = steps[0].linear_coefficient.value  # per-block matmul weights / d^2: the seeds' "11"
right.loglog(grid, naive_flops, "-o", color="tab:red", ms=4, label=f"naive step: 2L*({c:.3g}*N*d^2) + 4L*N^2*d")
right.loglog(grid, cached_flops, "-o", color="tab:blue", ms=4, label=f"cached step: 2L*({c:.3g}*d^2) + 4L*N*d")
right.axvline(crossover, color="gray", ls=":", label=f"attention = linear in a naive step (N~{crossover:,.0f})")
right.axvspan(min(contexts), max(contexts), color="gold", alpha=0.2, label="range measured on the left")
right.set_xlabel("context length N (tokens)")
right.set_ylabel("FLOPs of one step (log)")
right.set_title("SmolLM2 FLOPs per generated token (calculator)")
right.grid(True, which="both", alpha=0.3)
right.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading the picture:
#
# * **Left.** The naive step time climbs with N (it runs N tokens through 30
#   layers); the cached step barely moves (one token through 30 layers, plus
#   a dot product against N cached keys). The cache's advantage grows with the
#   context, and it is already large at a few hundred tokens.
# * **Right.** The same story in FLOPs, out to 8k tokens. A naive step is
#   linear in N while the matmuls dominate, then bends up to N^2 once the
#   attention term wins. The crossover is where the full score matrix's
#   `4 L N^2 d` meets the linear FLOPs: the blocks' `2 L c N d^2` (c = the
#   per-block weights in units of d^2, the seeds' "11") plus the LM head,
#   which a step pays *once*, not per token. Without the head that is
#   N = c d / 2; the cell above solves it exactly from the calculator's counts,
#   for SmolLM2 and for Llama 3 405B, whose crossover lands near the seeds'
#   chapter 8 finding that attention ≈ linear layers for a 100k-token prompt.
#   The cached step is nearly flat: its `N*d` attention term only starts to
#   show at thousands of tokens. At 8k tokens a naive step costs thousands of
#   times more than a cached one.
# * The seeds' Llama 3 405B version of this, recomputed by the calculator
#   under the seeds' assumptions (notebook 11 shows the whole table): with
#   the cache, the work per step is that of a single token.

# %%
for row in seeds_table():
    if row["chapter"] == "ch.5" and "naive step" in row["quantity"]:
        print(f"{row['quantity']:48} seeds {row['seed']:>8g} {row['unit']:6} recomputed {row['ours']:10.4g}")

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# * `vllm/v1/attention/backends/flash_attn.py`, `FlashAttentionImpl.forward`:
#   stores the step's new K and V into the cache (`reshape_and_cache_flash`,
#   through the slot mapping of notebook 09), then attends this step's queries
#   to every cached key: your exercise 4, on a GPU.
# * `vllm/v1/worker/gpu_model_runner.py`, `GPUModelRunner.initialize_kv_cache`:
#   allocates the K/V tensors of every layer once, at start-up, sized from the
#   memory left after the weights (`2 * L * Hkv * d * bytes` per token, as
#   here).
#
# ## Takeaways
#
# * KV cache = keep K and V of every token of every layer; compute only the
#   new token. Same tokens (checked), linear work per step drops from O(N) to
#   O(1) and attention from O(N^2) to O(N).
# * Q is not cached because it is consumed: each query is used once, by the
#   step that produces the next token.
# * The cost moves to memory: `2 * L * Hkv * d * bytes` per token per
#   sequence. Managing that memory well is notebook 09 (paged KV cache).
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb08.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. How big is the cache?** `my_kv_cache_bytes(cfg, num_tokens, dtype_bytes)`:
# the bytes of K and V for `num_tokens` tokens (all layers, all KV heads).
# Then use it: how many 8k-token conversations of SmolLM2 fit in 1 GB?

# %%
from stagewise.exercises import check  # noqa: E402


def my_kv_cache_bytes(cfg, num_tokens: int, dtype_bytes: int) -> int:
    raise NotImplementedError


# %%
check("08.kv_cache_bytes", my_kv_cache_bytes)

# %% [markdown]
# **2. The cost of recomputing.** `my_naive_step_flops(cfg, context)`: the
# FLOPs of one naive step over N tokens — every token through every block's
# matmuls (`2 x weights` per token: QKV, O, gate/up, down), the full `N x N`
# attention scores and `P @ V` (`4 L (H d) N^2`, the mask applied afterwards),
# and the LM head for the last token only.


# %%
def my_naive_step_flops(cfg, context: int) -> float:
    raise NotImplementedError


# %%
check("08.naive_step_flops", my_naive_step_flops)

# %% [markdown]
# **3. Rows pushed through the model.** A request with a `prompt_len`-token
# prompt generates `new_tokens` tokens. Return `(naive rows, kv rows)`: how
# many token rows each engine pushes through the model in total (the check
# runs both engines on the tiny model and reads their counters).


# %%
def my_rows_computed(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    raise NotImplementedError


# %%
check("08.rows_computed", my_rows_computed)

# %% [markdown]
# **4. Write the cache.** The mechanism itself. The check runs the tiny model
# one token per forward pass (the prompt too), and at every layer calls
# `my_cached_attention(cache, layer, q, k, v, scale)` with this token's query
# `q [1, H, d]` and its new key and value `k, v [1, Hkv, d]`. `cache[layer]`
# is a dict `{"k": [n, Hkv, d], "v": [n, Hkv, d]}` holding the `n` tokens seen
# so far (empty at first). Append the new K and V to it, then attend the one
# query to every cached key: query head `h` reads KV head `h // (H // Hkv)`,
# scores `q . k * scale`, softmax over the keys, weighted sum of the values;
# return `[1, H, d]`. No mask is needed: the one query is the newest token, so
# every cached key is in its past. The check compares your output and your
# cache with the attention stage at every layer of every step, then the greedy
# tokens with recompute's (the whole sequence each step, no cache).

# %%
def my_cached_attention(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    raise NotImplementedError


# %%
check("08.cached_attention", my_cached_attention, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#    .venv/bin/python -m pytest -q tests/engine/test_engine.py
#     .venv/bin/python -m pytest -q tests/exercises -k 08
