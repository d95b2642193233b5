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
# Over notebooks 00-12a you wrote, one exercise at a time, the parts of an
# inference engine. Here you write the engine itself: **one engine step**, the
# loop every serving engine turns (the package's paged runner, vLLM's
# `EngineCore.step`):
#
#     schedule -> build the batch -> forward -> sample -> settle
#
# and run it, on your parts, beside `LLM()`'s paged engine, comparing every
# step. The parts it runs on, and where each comes from:
#
# | job | your answer | written in |
# |---|---|---|
# | the flat token batch | `cu_seqlens`, `positions` | 00 |
# | greedy sampling | `greedy` | 00 |
# | embedding | `embedding` | 02 |
# | GQA | `repeat_kv` | 03 |
# | RoPE, on your own cos/sin cache | `cos_sin_cache`, `rope` | 04 |
# | attention of a whole prompt | `causal_attention` | 05 |
# | attention of a prompt chunk, one online-softmax tile at a time | `online_softmax` | 05 |
# | attention of a decode token over its KV cache | `cached_attention` | 08 |
# | the paged pool: where each token's K/V live | `slot_mapping` | 09 |
# | the block allocator and the prefix-cache lookup | `allocate`, `free`, `cached_prefix` | 09 |
# | the scheduler's step: budget, seats, chunks, preemption | `schedule` | 10 |
# | every RMSNorm, and the FFN's `silu(gate) * up` | your Triton kernels | 12a |
# | **the engine step** | `my_engine_step` | here |
#
# The package contributes the model's weights, its forward pass
# (`stagewise/models/llama.py`, which calls each stage through a stage-ops
# object: here yours, `stagewise/exercises/capstone.py`), the GEMMs of the
# projections and the LM head (the naive stages), the pool's tensors, and the
# glue that hands your `allocate` a request's cached prefix.
#
# **Where your parts come from.** A check cell of notebooks 00-12a written
# `check(..., save=True)` keeps your answer, once it passes, in
# `notebooks/my_parts.py` (one file, yours, never committed). This notebook
# reads that file and nothing else; the shipped solutions
# (`notebooks/solutions/`) fill the parts you have not written only when you
# ask, and every table below says which part is whose.
#
# Path: your parts -> the engine step, explained -> what `LLM()`'s engine does
# on the check's workload, pictured -> the prefix cache -> your step, checked.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`) changes nothing here.

# %%
import os

os.environ.setdefault("STAGEWISE_QUIET", "1")  # your kernels run in Triton's interpreter without a GPU: no notice
from stagewise.exercises.capstone import PARTS  # noqa: E402
from stagewise.exercises.capstone_checks import ENGINE, PREFIX, STEP, assemble, reference_steps  # noqa: E402
from stagewise.exercises.engine_checks import tiny_model  # noqa: E402
from stagewise.viz.engine import steps_chart  # noqa: E402

# %matplotlib inline

USE_SOLUTIONS = False  # True: the shipped solutions fill every part you have not written (and say so)
loaded = tiny_model()  # same architecture as SmolLM2, random weights: tokens are not words, but exact

# %% [markdown]
# ## 1. Your parts
#
# What `my_parts.py` holds, part by part (a missing file means nothing is
# kept yet: run the check cells of the earlier notebooks).

# %%
mine = assemble(None, use_solutions=USE_SOLUTIONS)
for role, name in PARTS.items():
    print(f"{role:>19}  {name:<20} {mine.whose[name]}")
yours = [name for name, who in mine.whose.items() if who == "yours" and name != STEP]
if not yours:
    print("\nnothing is yours yet: no answer is kept in my_parts.py (the check cells with save=True keep them)")
else:
    print(f"\n{len(yours)} of {len(PARTS)} parts are yours")

# %% [markdown]
# ## 2. The engine step
#
# Your step is a function `my_engine_step(engine, running, waiting)` that runs
# one step and returns the tokens it sampled, `[(request_id, token), ...]`.
# `running` (a list) and `waiting` (a deque) hold `Seq`s: `request_id`,
# `token_ids` (the prompt, then the generated tokens), `num_tokens`,
# `num_computed_tokens` (tokens whose K/V are in the pool), `max_tokens`
# and `generated`. `engine.seqs[request_id]` finds one. The five moves:
#
# 1. **schedule**: `engine.parts.schedule(running, waiting, engine.budget,
#    engine.seats, engine.allocate, engine.free)`, your notebook-10 scheduler,
#    with `engine.allocate` and `engine.free` your notebook-09 allocator over
#    the pool. A request admitted with a cached prefix comes back with
#    `num_computed_tokens` already past its hits: of the `n` tokens the
#    scheduler gave it, only `min(n, num_tokens - num_computed_tokens)` are
#    left to compute.
# 2. **build the batch**: every scheduled request's next tokens, flattened
#    into one list of ids, with `engine.parts.positions` and
#    `engine.parts.cu_seqlens` (notebook 00).
# 3. **forward**: `engine.forward(seqs, counts, ids, positions, cu_seqlens)`:
#    the model on your stages and kernels; it stores the batch's K/V at your
#    slots and returns `logits [B, vocab]`, one row per request (its last
#    token).
# 4. **sample**: `engine.parts.greedy(logits)`, one token per request, kept
#    only where the step reached the request's last token (a prompt chunk
#    samples nothing).
# 5. **settle**: add what was computed to `num_computed_tokens`, name the
#    request's full blocks for the prefix cache (`engine.name_blocks(seq)`),
#    record each sampled token (`generated`, and `token_ids` while more are to
#    come); a request with all its tokens leaves `running`, and its blocks go
#    back through `engine.free`.
#
# The check runs your step and `LLM()`'s paged engine in lockstep, with the
# same seats, budget and pool, and after every step compares: the tokens each
# request computed, the budget, who runs and who waits (in order), the blocks
# each request holds, the tokens sampled. The first difference is a FAIL that
# names the step; a step that runs no forward pass while `LLM()`'s computes is
# a FAIL saying your engine stalled there.
#
# ## 3. What `LLM()`'s engine does on the check's workload
#
# The check's first workload: four requests, two seats, a budget of a few
# tokens per step and a pool the largest request just fills alone (the
# printed limits), so prompts are chunked, requests wait for seats, and
# requests running together outgrow the pool and are preempted. One bar per
# step, one colour per request: the tokens `LLM()`'s paged engine computed.
# Your engine must take exactly these steps.

# %%
print(f"{len(ENGINE.prompts)} requests of {ENGINE.max_tokens} new tokens, {ENGINE.seats} seats, "
      f"{ENGINE.budget} tokens per step, {ENGINE.num_blocks} blocks of {ENGINE.block_size}")  # fmt: skip
target, _ = reference_steps(loaded, ENGINE)
steps_chart(target, f"LLM()'s paged engine: {len(target)} steps your engine must reproduce", budget=ENGINE.budget)

# %% [markdown]
# A preempted request comes back later with its prompt *and* the tokens it had
# generated, all recomputed: its bar after a preemption is taller than a
# decode.
#
# ## 4. A shared prompt prefix
#
# After each step your settle names every full block of a request's computed
# tokens by its chained digest (`block_digest(parent, block's tokens)`, the one
# 09's check uses) in `engine.cached: digest -> block id`; a freed block keeps its
# name until your `allocate` hands it to someone else. When a request is
# admitted, the engine asks your `cached_prefix` for the longest cached prefix,
# takes a shared reference on those blocks and counts their tokens as
# computed. The check's second workload: two requests with the same opening
# sentence and one seat, so the second starts after the first has finished
# and freed its blocks, which are still named:

# %%
shared, reused = reference_steps(loaded, PREFIX)
first = {rid: n for rid, n in reversed([x for step in shared for x in step])}  # each one's first step
for rid, prompt in zip(["r0", "r1"], PREFIX.prompts):
    print(f"{rid}: a prompt of {len(loaded.tokenizer.encode(prompt))} tokens, {reused[rid]} found in the cache, "
          f"{first[rid]} computed in its first step")  # fmt: skip

# %% [markdown]
# The second request's first step computes fewer tokens than its prompt holds:
# the rest were found in the cache. A block is found only when every block
# before it is too (the digest is chained: it names the whole prefix), and never
# the block holding the prompt's last token, whose logits the request needs.
#
# ## In vLLM (v0.11.0)
#
# The same loop in vLLM's V1 engine:
#
# * `vllm/v1/engine/core.py`, `EngineCore.step`: schedule, execute the model,
#   update from its output — your step.
# * `vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule` and
#   `Scheduler.update_from_output` (your `schedule`, and your settle).
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
# * An inference engine is a loop of five moves — schedule, build the batch,
#   forward, sample, settle — over two data structures: the requests' token
#   counts and the pool of KV blocks.
# * The forward pass never knows about requests: it sees a flat batch,
#   positions, and a KV layout (the slots and the block table). The scheduler
#   never sees a tensor. That separation is what lets continuous batching,
#   chunked prefill and preemption change nothing in the model.
# * Greedy decoding makes the whole engine checkable: every step's decisions
#   and tokens must equal the package's, request by request.
#
# ## Exercises
#
# **1. Write the engine step** (section 2), then run the checks below. They
# run your step on your parts from `my_parts.py`: a part you have not kept
# yet makes them say **not yet**, naming it. To try your step before every
# part is yours, set `USE_SOLUTIONS = True` in the first cell: the shipped
# solutions then fill the missing parts, and the table of section 1 says so.
# Solutions: `notebooks/solutions/nb16.py`.

# %%
from stagewise.exercises import check  # noqa: E402


def my_engine_step(engine, running, waiting) -> list[tuple[str, int]]:
    raise NotImplementedError


# %%
capstone = assemble(my_engine_step, use_solutions=USE_SOLUTIONS)
solution_parts = [name for name, who in capstone.whose.items() if who == "solution"]
if solution_parts:
    print(f"from the shipped solutions, not yours: {', '.join(solution_parts)}")
check("16.engine", capstone)

# %%
check("16.shared_prefix", capstone)

# %% [markdown]
# The tests that cover this notebook: the engine of the solutions, and wrong
# parts that must fail (a scheduler that ignores the seats, an allocator that
# refuses exact fits, an engine that stalls):
#
#     .venv/bin/python -m pytest -q tests/exercises/test_capstone.py
