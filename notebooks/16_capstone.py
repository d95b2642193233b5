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
# # 16 · Capstone: your engine
#
# Over notebooks 00-10 you wrote, one exercise at a time, every part of an
# inference engine. This notebook puts them together and runs the real
# SmolLM2 model on them:
#
# | job | your function | written in |
# |---|---|---|
# | the flat token batch | `cu_seqlens`, `positions` | 00 |
# | embedding, RMSNorm (+ the residual add) | `embedding`, `rmsnorm`, `add_rmsnorm` | 02 |
# | GQA | `repeat_kv` | 03 |
# | RoPE, on your own cos/sin cache | `cos_sin_cache`, `rope` | 04 |
# | attention: a whole prompt, and one tile of the online softmax | `causal_attention`, `online_step` | 05 |
# | the FFN | `ffn` | 06 |
# | the paged KV cache: where each token's K/V live | `slot_mapping` | 09 |
# | the block allocator | `allocate`, `free` | 09 |
# | the prefix cache's lookup | `cached_prefix` | 09 |
# | the scheduler's step: budget, seats, chunks, preemption | `schedule` | 10 |
# | greedy sampling | `greedy` | 00 |
#
# The package contributes only the model's weights, its forward pass
# (`stagewise/models/llama.py`, which calls each stage through a stage-ops
# object: here yours, `stagewise.exercises.capstone.StudentOps`) and the three
# GEMMs (qkv, o, the LM head: the naive stages). No part of the package's
# scheduler, block manager, KV cache or attention runs. The claim to check:
# **your engine generates the same greedy tokens as `LLM()`**.
#
# Path: your parts, each checked again -> the engine assembled -> run on three
# requests with a small token budget and a small pool of blocks (so chunks and
# preemptions happen) -> the same tokens as `LLM()` -> two requests sharing a
# prompt prefix, the second reusing the first's blocks through your lookup ->
# the picture of the steps.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): 3 new tokens per request
# instead of 8.

# %%
import os
import time
from pathlib import Path

os.environ.setdefault("STAGEWISE_QUIET", "1")  # no Triton kernel runs here: no notice about its CPU interpreter
import torch  # noqa: E402

from stagewise import LLM, SamplingParams
from stagewise.exercises import result
from stagewise.exercises.capstone import PARTS, StudentEngine, StudentParts, load_solutions
from stagewise.models.registry import load_model
from stagewise.viz_engine import steps_chart

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: the engine's Python loops, not the GEMMs, set the pace here
loaded = load_model("smollm2-135m", device="cpu")  # float32 on the CPU: exact comparisons
tok = loaded.tokenizer

# %% [markdown]
# ## 1. Your parts
#
# `notebooks/solutions/` holds a solved version of every exercise; the cell
# below starts from those. To run **your** engine, paste your functions from
# the other notebooks into a cell and replace the entries, e.g.
# `solved["10.schedule_step"] = my_schedule`. Every part is checked again
# first, with the same check as in its notebook: an engine built from a part
# that fails its check would generate garbage, or nothing.

# %%
solved = load_solutions(Path("solutions"))
# solved["02.rmsnorm"] = my_rmsnorm  # <- yours, once it passes in notebook 02
verdicts = {check: result(check, solved[check]) for check in PARTS.values()}
for part, check in PARTS.items():
    print(f"{part:>16}  {verdicts[check].line()}")
assert all(v.passed for v in verdicts.values()), "fix the failing parts first"

# %% [markdown]
# ## 2. The engine, assembled
#
# `StudentEngine` keeps a paged pool of K/V blocks per layer and runs this
# loop until every request is done:
#
# 1. **schedule**: your `schedule(running, waiting, budget, max_num_seqs,
#    allocate, free)`, with `allocate` and `free` your block allocator over
#    the pool's free queue; a request's first `allocate` starts from the
#    blocks your `cached_prefix` finds (section 4);
# 2. **batch**: the scheduled tokens of every request, flattened by your
#    `cu_seqlens` and `positions`;
# 3. **forward**: the model's 30 blocks on your stage functions; in every
#    layer, the new K/V are stored at your `slot_mapping`'s slots and read back
#    through the block table; a whole prompt goes through your
#    `causal_attention`, a prompt chunk or a decode token through your
#    `online_step`, tile by tile, over the cached keys;
# 4. **sample**: your `greedy`, for each request whose step reached its last
#    token; a request with all its tokens leaves, and its blocks go back to
#    the free queue through your `free`.
#
# Three requests, at most 2 running at once, 8 tokens per step, blocks of 4
# tokens and a pool just large enough for the largest request alone: two
# requests together do not fit, so your scheduler must preempt.

# %%
prompts = ["The capital of France is", "Once upon a time, a small robot", "1, 2, 3, 4,"]
prompt_ids = [tok.encode(p) for p in prompts]
new_tokens = 3 if QUICK else 8
num_blocks = max(-(-(len(p) + new_tokens) // 4) for p in prompt_ids)  # the largest request just fits alone
engine = StudentEngine(loaded, StudentParts.of(solved), num_blocks=num_blocks, block_size=4, budget=8, seats=2)
t0 = time.perf_counter()
yours = engine.generate(prompt_ids, new_tokens)
took = time.perf_counter() - t0
print(f"prompts of {[len(p) for p in prompt_ids]} tokens, {new_tokens} new tokens each, {num_blocks} blocks: "
      f"{len(engine.steps)} steps, {engine.preemptions} preemptions, {took:.1f} s")  # fmt: skip
print("stage calls answered by your functions:", engine.ops.calls)

# %% [markdown]
# ## 3. Check: the same tokens as `LLM()`
#
# The package's engine (`mode="paged"`: its scheduler, block manager, paged
# attention and sampler; `backend="naive"`, the reference tier of every
# stage) on the same prompts, greedy, no stop token:

# %%
llm = LLM(loaded, mode="paged", backend="naive")
params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
reference = [out.token_ids for out in llm.generate(prompts, params)]
for prompt, mine, ref in zip(prompts, yours, reference):
    print(f"{prompt!r} -> {tok.decode(mine)!r}  ({'same' if mine == ref else 'DIFFERENT'} tokens)")
assert yours == reference, f"your engine: {yours}\nLLM():       {reference}"
print("your engine generates LLM()'s greedy tokens")

# %% [markdown]
# ## 4. A shared prompt prefix: your lookup
#
# After each step the engine names every full block of a request's computed
# tokens by its chained hash (`hash((parent, block's tokens))`, the hash 09's
# check uses) in a dict `cached: hash -> block id`. A freed block keeps its
# name until your `allocate` hands it to someone else. When a request is
# admitted, the engine asks your `cached_prefix(token_ids, block_size, cached)`
# for the longest cached prefix, takes a shared reference on those blocks and
# counts their tokens as computed: the step computes only the rest. (Your
# `schedule` does not know about the cache: it charged the whole prompt to
# the token budget. vLLM's scheduler asks for the hits first, and charges
# only the rest.)
#
# Two requests with the same opening sentence and one seat: the second starts
# after the first has finished and freed its blocks, which are still cached.

# %%
opening = "The capital of France is Paris. The capital of Spain is Madrid. The capital of"
shared = [opening + " Italy is", opening + " Germany is"]
shared_ids = [tok.encode(p) for p in shared]
common = next(i for i, (a, b) in enumerate(zip(*shared_ids)) if a != b)  # tokens the two prompts share
engine2 = StudentEngine(loaded, StudentParts.of(solved), num_blocks=32, block_size=4, budget=64, seats=1)
yours2 = engine2.generate(shared_ids, new_tokens)
first_steps = {rid: n for rid, n in reversed([x for step in engine2.steps for x in step])}  # each one's first step
for rid, ids in zip(["r0", "r1"], shared_ids):
    print(f"{rid}: prompt of {len(ids)} tokens, {engine2.reused[rid]} found in the cache, "
          f"{first_steps[rid]} computed in its first step")  # fmt: skip
print(f"the prompts share {common} tokens: {common // 4} full blocks of 4")
reference2 = [out.token_ids for out in llm.generate(shared, params)]
assert engine2.reused["r1"] == common // 4 * 4 > 0 and yours2 == reference2
print("the second request reused the first's blocks, and both generate LLM()'s greedy tokens")

# %% [markdown]
# A block is found only when every block before it is too (the hash is
# chained: it names the whole prefix, not one block's tokens), and never the
# block holding the prompt's last token, whose logits the request still needs.
# The tokens match `LLM()`'s because a cached block holds exactly the K/V the
# second request would have computed: same tokens, same positions.
#
# ## 5. The picture: what your scheduler did
#
# One bar per engine step, one colour per request: the tokens your scheduler
# gave it. Prompts are cut into chunks where the budget runs out; a request
# preempted by recompute comes back later with its prompt *and* the tokens it
# had generated, all recomputed.

# %%
steps_chart(engine.steps, f"your engine: {len(prompts)} requests, {engine.preemptions} preemptions", budget=8)

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# The same loop in vLLM's V1 engine:
#
# * `vllm/v1/engine/core.py`, `EngineCore.step`: schedule, execute the model,
#   update from its output — this notebook's loop.
# * `vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule` and
#   `Scheduler.update_from_output` (your `schedule` and the bookkeeping after
#   the forward pass).
# * `vllm/v1/core/kv_cache_manager.py`, `KVCacheManager.allocate_slots` and
#   `vllm/v1/core/block_pool.py`, `BlockPool` (your `allocate` and `free`);
#   `KVCacheManager.get_computed_blocks`, called by the scheduler before it
#   admits a waiting request, is your `cached_prefix`.
# * `vllm/v1/worker/gpu_model_runner.py`, `GPUModelRunner.execute_model`:
#   builds the flat batch (positions, `query_start_loc` = your `cu_seqlens`,
#   the slot mapping through `vllm/v1/worker/block_table.py`) and calls the
#   model, `vllm/model_executor/models/llama.py`, `LlamaForCausalLM`.
#
# ## Takeaways
#
# * An inference engine is a loop of four jobs — schedule, batch, forward,
#   sample — over two data structures: the requests' token counts and the
#   pool of KV blocks. You wrote every one of them.
# * The forward pass never knows about requests: it sees a flat batch,
#   positions, and a KV layout (the slots and the block table). The scheduler
#   never sees a tensor. That separation is what lets continuous batching,
#   chunked prefill and preemption change nothing in the model.
# * Greedy decoding makes the whole engine checkable: the tokens must equal
#   the package's, request by request, whatever the scheduler decided.
#
# ## Exercises
#
# The capstone's exercise is the engine itself: replace the solutions one part
# at a time with your own functions (the cell of section 1), rerun, and keep
# going until every part is yours and the tokens still match. The checks each
# part must pass first, the same as in its notebook:

# %%
from stagewise.exercises import check  # noqa: E402

check("10.schedule_step", solved["10.schedule_step"])

# %%
check("09.allocate", solved["09.allocate"])

# %% [markdown]
# The tests that cover this notebook, and the engine run on the solutions with the tiny model:
#
#     .venv/bin/python -m pytest -q tests/exercises -k "capstone or 09 or 10"
