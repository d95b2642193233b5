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
# # 09 · The paged KV cache: blocks, block tables, slots, prefix caching
#
# Notebook 08 showed that a KV cache cuts each generation step's linear
# layers from O(N) work to O(1) per token and its attention from O(N^2) to
# O(N), and that it costs `2 * L * Hkv * d * bytes` of memory per token. Now: *where* does that memory come from?
#
# The simple answer — give every request one contiguous region big enough for
# its longest possible sequence — wastes memory twice. The output length is
# unknown when the request arrives, so the region must be sized for the worst
# case (`max_tokens`, or even `max_model_len`), and most of it stays empty.
# And contiguous regions of different sizes fragment the memory, so a new
# request can fail to fit even when enough bytes are free in total.
#
# vLLM's answer (the "Paged Attention" of the seeds, the project's two source
# articles named in the README; borrowed from virtual memory):
# cut the KV memory into fixed-size **blocks** of `block_size` tokens
# (`EngineConfig().block_size` by default, printed below) and hand them out
# **one at a time, as tokens arrive**. A request owns a list of block ids —
# its row of the **block table** — that can sit anywhere in the pool, in any
# order. Memory is allocated at token granularity (rounded up to a block), so
# a request wastes at most `block_size - 1` slots.
#
#     kv cache:    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
#     block_table: [max_num_reqs, max_num_blocks_per_req]     (physical block ids)
#     slot       = block_id * block_size + offset                (where a token's K/V live)
#     block_id   = slot // block_size,   offset = slot % block_size
#
# The trade-off the seeds name: reads through a block table are no longer one
# contiguous stream (a kernel jumps between blocks), but inside a block the
# tokens are contiguous, and losing a little bandwidth is far better than
# running out of memory.
#
# Path: motivation -> the pool -> stepping a real engine and drawing who owns
# which block -> check (slot formula on every token, same tokens as the
# contiguous cache) -> measure (memory reserved vs used) -> prefix caching.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the prefix-caching example
# generates 8 answer tokens instead of 24; everything else is the same.

# %%
import contextlib
import io
import os

import numpy as np

from stagewise import LLM, SamplingParams
from stagewise.bench.harness.workloads import SEED_TEXT, single_prompt
from stagewise.config import EngineConfig
from stagewise.kv.paged import kv_bytes_per_token
from stagewise.models.registry import load_model
from stagewise.trace.export import to_json
from stagewise.trace.tracer import Tracer
from stagewise.viz.engine import block_pool_over_time, block_table_board, memory_held, shared_rows

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
loaded = load_model("smollm2-135m", device="cpu")  # float32 on the CPU, even on a GPU machine: exact checks
cfg, tok = loaded.config, loaded.tokenizer

# %% [markdown]
# ## 1. The pool
#
# A paged engine with a deliberately small pool: 14 blocks of 16 tokens
# (224 token slots), so one picture can show every block. `num_kv_blocks`
# fixes the pool size directly; without it the engine sizes the pool from a
# memory budget.

# %%
BLOCK, NUM_BLOCKS = EngineConfig().block_size, 14  # the engine's default block size; a small pool
ecfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                    max_model_len=256)  # fmt: skip
with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once
    llm = LLM(loaded, mode="paged", engine_config=ecfg)
cache = llm.engine.cache
print(f"default block_size: {BLOCK} tokens; {cache.describe()}")
print("kv tensor  :", list(cache.kv.shape), "= [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]")
print("block table:", list(cache.block_table.shape), "= [max_num_reqs, max_num_blocks_per_req]")
print(f"one block holds {BLOCK} tokens x {kv_bytes_per_token(cfg, loaded.dtype):,} B = "
      f"{BLOCK * kv_bytes_per_token(cfg, loaded.dtype) / 2**10:.0f} KiB (all layers, K and V)")

# %% [markdown]
# ## 2. Step the engine and watch the blocks
#
# Four requests with prompts of exact lengths (`single_prompt` builds
# English text that tokenizes to exactly N tokens), greedy and ignoring EOS
# so each generates exactly `max_tokens`:
#
# | request | prompt tokens | max_tokens | arrives before step |
# |---|---|---|---|
# | A | 40 | 12 | 0 |
# | B | 20 | 40 | 0 |
# | C | 50 | 16 | 8 |
# | D | 30 | 20 | 14 |
#
# `add_request` queues a request, `step()` runs one engine iteration. One
# `Tracer` records every step; its JSON export (`to_json`) has, per step, each
# scheduled request's `blocks` (its block-table row) and the batch's
# `slot_mapping`, `positions`, `block_table` and `seq_lens`.

# %%
plan = {  # name: (prompt tokens, max_tokens, step before which it is added)
    "A": (40, 12, 0),
    "B": (20, 40, 0),
    "C": (50, 16, 8),
    "D": (30, 20, 14),
}
prompts = {name: single_prompt(tok, n, seed=i + 1) for i, (name, (n, _, _)) in enumerate(plan.items())}
params = {name: SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for name, (_, m, _) in plan.items()}
names = {}  # engine request id -> A, B, C, D
outputs = {name: [] for name in plan}
step = 0
with Tracer(timing=False) as tracer:
    while llm.has_unfinished_requests() or any(at >= step for *_, at in plan.values()):
        for name, (_, _, at) in plan.items():
            if at == step:
                names[llm.add_request(prompts[name], params[name])] = name
        for event in llm.step():
            outputs[names[event.request_id]].append(event.token_id)
        step += 1
trace = to_json(tracer)
print(f"{len(trace['steps'])} steps; tokens generated:", {n: len(t) for n, t in outputs.items()})

# %% [markdown]
# The steps where some block-table row changed: which requests ran, how many
# tokens each computed (`+n`), and the block-table row each one owns.

# %%
previous = {}
for s in trace["steps"]:
    now = {names[r["request_id"]]: r["blocks"] for r in s["requests"]}
    if now != previous:
        rows = "  ".join(
            f"{names[r['request_id']]}: {r['phase']:<7} +{r['num_scheduled']:<2} {r['blocks']}" for r in s["requests"]
        )
        print(f"step {s['index']:>2} | {rows}")
    previous = now

# %% [markdown]
# ### The picture: the block pool over time
#
# One row per engine step, one column per physical block, coloured by the
# request that owns it (white = free). Things to see:
#
# * a request grows **one block at a time**: a new block is taken only when
#   its last one is full (every 16 tokens);
# * blocks of one request are **not contiguous** and not in order once the
#   pool has been used for a while;
# * when A finishes, its blocks go back to the free queue at once (at its
#   tail: a freed block keeps its content, findable by the prefix cache of
#   section 5, until the queue hands it out again); once the never-used blocks
#   are gone, B, C and D grow into A's old blocks, wherever they are;
# * nobody reserves memory for tokens it has not generated yet. (Whether four
#   requests fit in 14 blocks is also a matter of *when* they run: A is gone
#   before D arrives. Section 4 separates the two effects.)

# %%
order = list(plan)
owner = np.zeros((len(trace["steps"]), NUM_BLOCKS), dtype=int)  # 0 = free, k = order[k-1]
for s in trace["steps"]:
    for r in s["requests"]:
        for b in r["blocks"]:
            owner[s["index"], b] = order.index(names[r["request_id"]]) + 1
legend = [f"{name}: {plan[name][0]} prompt + {plan[name][1]} output tokens" for name in order]
arrivals = {order.index(name): at for name, (_, _, at) in plan.items() if at > 0}
title = f"who owns which KV block, step by step ({NUM_BLOCKS} blocks x {BLOCK} tokens)"
block_pool_over_time(owner, legend, arrivals, title)

# %% [markdown]
# ### The board picture: block-table rows pointing into the pool
#
# The indirection drawn the way a teacher draws it, from a live engine: the
# same four requests replayed on a fresh engine up to the step after which the
# most requests were still running (most blocks among ties), then stopped, and
# its state read directly: each running request's row of `cache.block_table`
# (checked against the block manager's own list), its `num_computed_tokens`,
# and the pool. Left: logical block `i` of each request holds the physical
# block id written in it; right: the pool of physical blocks, each filled as
# far as it holds tokens. Every arrow is one step of
# `slot = block_table[row][pos // 16] * 16 + pos % 16`.

# %%
steps = trace["steps"]


def still_running(i: int) -> list[dict]:
    """The requests of step i that are scheduled again in step i + 1 (so still running after step i)."""
    before = {r["request_id"] for r in steps[i]["requests"]}
    return [r for r in steps[i + 1]["requests"] if r["request_id"] in before]


def fullness(i: int) -> tuple[int, int]:
    return len(still_running(i)), sum(len(r["blocks"]) for r in still_running(i))


stop = max(range(len(steps) - 1), key=fullness)
board = LLM(loaded, mode="paged", engine_config=ecfg)
board_names = {}
for step in range(stop + 1):
    for name, (_, _, at) in plan.items():
        if at == step:
            board_names[board.add_request(prompts[name], params[name])] = name
    board.step()
engine = board.engine
running = list(engine.scheduler.running)

rows = []
for req in running:
    name = board_names[req.request_id]
    ids = engine.block_manager.block_ids(req.request_id)
    row = engine.cache.row(req.request_id)
    table = engine.cache.block_table[row, : len(ids)].tolist()
    assert table == ids, "the block table the kernels read is the block manager's list"
    rows.append((f"{name}: block_table[{row}]\n{req.num_computed_tokens} tokens cached", order.index(name) + 1,
                 table, req.num_computed_tokens))  # fmt: skip
used = engine.block_manager.num_used_blocks
title = f"after engine step {stop}: block-table rows (left) -> the pool's blocks (right), {used} of {NUM_BLOCKS} in use"
block_table_board(rows, NUM_BLOCKS, BLOCK, title)

# %% [markdown]
# ## 3. Check: the slot of every token, and the tokens themselves
#
# The attention kernels never see "request A, position 37"; they see a slot.
# For every token of every step, the trace's `slot_mapping` must equal
# `block_table[row][pos // block_size] * block_size + pos % block_size`,
# with `row` the token's sequence in the step (from `cu_seqlens_q`).

# %%
checked = 0
for s in trace["steps"]:
    batch = s["batch"]
    cu = batch["cu_seqlens_q"]
    for row in range(len(cu) - 1):
        table = batch["block_table"][row]
        for t in range(cu[row], cu[row + 1]):
            pos = batch["positions"][t]
            assert batch["slot_mapping"][t] == table[pos // BLOCK] * BLOCK + pos % BLOCK
            checked += 1
print(f"slot = block_id * {BLOCK} + offset holds for all {checked} tokens of {len(trace['steps'])} steps")

s = trace["steps"][15]
print("\nstep 15, one row per token: request, position -> block-table entry -> slot")
cu = s["batch"]["cu_seqlens_q"]
for row in range(len(cu) - 1):
    for t in range(cu[row], cu[row + 1]):
        pos = s["batch"]["positions"][t]
        table = s["batch"]["block_table"][row]
        print(f"  {names[s['requests'][row]['request_id']]} pos {pos:>3}: block_table[{row}][{pos} // {BLOCK}] = "
              f"{table[pos // BLOCK]:>2}, offset {pos % BLOCK:>2} -> slot {s['batch']['slot_mapping'][t]}")

# %% [markdown]
# And the engine must produce the same tokens as the simple contiguous cache
# (`mode="kv"`), request by request: paging changes where K/V live, never
# what they are.

# %%
kv = LLM(loaded, mode="kv")
reference = kv.generate([prompts[n] for n in order], [params[n] for n in order])
for name, ref in zip(order, reference):
    assert outputs[name] == ref.token_ids, name
print("paged (stepped by hand, requests joining mid-way) == contiguous kv cache, for", ", ".join(order))

# %% [markdown]
# ## 4. Measure: memory reserved vs memory used
#
# The `kv` run we just did is the classic static layout
# (`kv/contiguous.py`): one batch, every row reserves room for the
# batch's longest prompt plus its largest `max_tokens`, from the start to the
# end. `last_stats.kv_cache_bytes` is what it allocated. The paged engine held
# `ceil(tokens / 16)` blocks per request, at its peak (from the trace).

# %%
per_token = kv_bytes_per_token(cfg, loaded.dtype)
static_slots_per_row = kv.last_stats.kv_cache_bytes // per_token // len(order)
used = {n: plan[n][0] + plan[n][1] for n in order}  # prompt + output tokens
paged_slots = {n: 0 for n in order}
for s in trace["steps"]:
    for r in s["requests"]:
        name = names[r["request_id"]]
        paged_slots[name] = max(paged_slots[name], BLOCK * len(r["blocks"]))
print(f"{'request':>8} {'tokens':>7} {'paged slots':>12} {'waste':>6} {'static slots':>13} {'waste':>6}")
for n in order:
    print(f"{n:>8} {used[n]:>7} {paged_slots[n]:>12} {paged_slots[n] - used[n]:>6} "
          f"{static_slots_per_row:>13} {static_slots_per_row - used[n]:>6}")
total_used = sum(used.values())
print(f"{'total':>8} {total_used:>7} {sum(paged_slots.values()):>12} {sum(paged_slots.values()) - total_used:>6} "
      f"{static_slots_per_row * len(order):>13} {static_slots_per_row * len(order) - total_used:>6}")
peak_blocks = max(int((row > 0).sum()) for row in owner)
print(f"\npaged peak: {peak_blocks} blocks in use at once = {peak_blocks * BLOCK} slots "
      f"({peak_blocks * BLOCK * per_token / 2**20:.1f} MiB); static: {static_slots_per_row * len(order)} slots "
      f"({kv.last_stats.kv_cache_bytes / 2**20:.1f} MiB) for the whole batch")

# %%
memory_held(used, paged_slots, static_slots_per_row, BLOCK)  # stagewise/viz/engine.py

# %% [markdown]
# ### Two effects, counted apart: staggered arrival and paging
#
# Four requests ran in a 14-block pool, but paging is not the only reason:
# they did not all live at once (A finished before D arrived). To separate the
# two effects, count the peak blocks held at once in four scenarios, from the
# same requests:
#
# * **together, reserved**: all four run together, each reserving its whole
#   `prompt + max_tokens` up front (a contiguous cache sized exactly — the
#   friendly case, since a real server does not know the output length);
# * **together, paged**: all four start together and grow block by block
#   (one token per step each; the token budget ignored);
# * **staggered, reserved**: the real arrival times and lifetimes from the
#   trace, each request reserving its whole length while it lives;
# * **staggered, paged**: what the engine actually did (the trace).

# %%
scheduled = [{names[r["request_id"]] for r in s["requests"]} for s in trace["steps"]]  # who ran in each step
lifetime = {n: [i for i, who in enumerate(scheduled) if n in who] for n in order}
whole = {n: -(-used[n] // BLOCK) for n in order}  # blocks for the whole request
steps_axis = range(max(max(v) for v in lifetime.values()) + 1)
longest = max(plan[n][1] for n in order)


def grown(n: str, s: int) -> int:  # blocks after s steps of a request that started at step 0 (0 once done)
    prompt_len, max_tokens, _ = plan[n]
    return -(-(prompt_len + s) // BLOCK) if s < max_tokens else 0


scenarios = {
    "together, reserved": sum(whole.values()),
    "together, paged": max(sum(grown(n, s) for n in order) for s in range(longest)),
    "staggered, reserved": max(sum(whole[n] for n in order if s in lifetime[n]) for s in steps_axis),
    "staggered, paged (the engine)": peak_blocks,
}
for name, blocks in scenarios.items():
    verdict = "fits" if blocks <= NUM_BLOCKS else "does NOT fit"
    print(f"{name:30} peak {blocks:2} blocks ({blocks * BLOCK:3} slots): {verdict} in the {NUM_BLOCKS}-block pool")

# %% [markdown]
# Reserving every request's whole length at once does not fit the pool; each
# effect alone does — paging (grow a block at a time) *or* staggered lifetimes
# (A leaves before D comes) — and the engine, which has both, peaked lowest.
# So "four requests in 14 blocks" is paging and arrival times together; on a
# busy server, where requests overlap more, paging is what keeps the peak
# down, and it never needs to know the output length in advance.
#
# The paged waste is the unfilled tail of each request's last block, at most
# `block_size - 1` slots. The static waste is everything between a request's
# real length and the batch's worst case, in the *friendly* case where the
# engine was told the exact output lengths. A real server does not know when
# a request will emit its end-of-sequence token, so a contiguous scheme must
# reserve `max_tokens` (or `max_model_len`) per request; the paged engine
# still allocates one block per 16 tokens actually generated.
#
# ## 5. Prefix caching: requests that share a beginning
#
# Many requests start the same way: a system prompt, few-shot examples, a long
# document followed by different questions. The K/V of a full block depend only
# on the tokens up to the end of that block, so equal prefixes give equal
# blocks. The block manager names each full block by a chained digest —
# `block_digest(parent block's digest, this block's token ids)`, SHA-256 — and
# a new request looks its prompt's full blocks up: the longest run of hits is
# *shared* (reference count + 1), and the request starts with
# `num_computed_tokens` already past them. (The last prompt token is always
# computed: its logits are needed.)
#
# A name is where to look, not proof. Python's `hash()` of a tuple of ints is
# 64 bits and predictable, so two different prompts can be made to collide,
# and one user's prompt would be answered from another's K/V (vLLM shipped
# that and fixed it: CVE-2025-25183). So the digest is cryptographic, and each
# hit is also checked against what the block holds: its token ids and the
# block holding the prefix before it, stored when the block was named.
#
# Two chat requests about the same passage, different questions, run one after
# the other through a fresh engine with prefix caching on (the default):

# %%
passage = " ".join(SEED_TEXT.split()[:90])
questions = ["What does a KV cache keep?", "Why is static batching wasteful?"]
chat_prompts = [f"Read this text.\n\n{passage}\n\nQuestion: {q}" for q in questions]
answer = SamplingParams(max_tokens=8 if QUICK else 24, temperature=0)

cached_llm = LLM(loaded, mode="paged", engine_config=EngineConfig(max_model_len=512, max_num_seqs=2))
runs = []
for p in chat_prompts:
    with Tracer(timing=False) as t:
        out = cached_llm.generate(p, answer, chat=True)[0]
    first = to_json(t)["steps"][0]["requests"][0]
    runs.append((out, first, cached_llm.last_stats.prefix_hit_tokens))
for (out, first, hits), q in zip(runs, questions):
    print(f"Q: {q}")
    print(f"   prompt {len(out.prompt_token_ids)} tokens, prefix-cache hits {hits}, first step computed "
          f"{first['num_scheduled']} tokens starting at {first['num_computed_tokens']}; blocks {first['blocks']}")
    print(f"   A: {out.text!r}")

# %% [markdown]
# The second request found the blocks that hold the system prompt, the
# passage and the start of the question — every *full* block the two prompts
# share — and computed only the rest. Its block-table row starts with the very
# same physical block ids as the first request's.
#
# Check that reuse is exact: the same question in an engine with prefix
# caching off must give the same answer.

# %%
plain_llm = LLM(
    loaded, mode="paged", engine_config=EngineConfig(max_model_len=512, max_num_seqs=2, enable_prefix_caching=False)
)
plain = plain_llm.generate(chat_prompts[1], answer, chat=True)[0]
assert plain.token_ids == runs[1][0].token_ids
print("same answer with and without the prefix cache:", repr(plain.text))
print(f"prefix cache off: {plain_llm.last_stats.prefix_hit_tokens} hit tokens")

# %% [markdown]
# ### The picture: two block-table rows pointing at shared blocks

# %%
shared_rows([runs[0][1]["blocks"], runs[1][1]["blocks"]], ["request 1 (first Q)", "request 2 (second Q)"], BLOCK)

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# * `vllm/v1/core/block_pool.py`, `BlockPool`: the pool of blocks, its
#   `get_new_blocks` (from the front of the free queue) and `free_blocks` (to
#   its back), and `get_cached_block` for prefix hits; the free queue itself
#   is `FreeKVCacheBlockQueue` in `vllm/v1/core/kv_cache_utils.py`, where
#   `hash_block_tokens` chains each full block's hash to its parent's
#   (SHA-256 since CVE-2025-25183).
# * `vllm/v1/core/kv_cache_manager.py`, `KVCacheManager.get_computed_blocks`
#   (the longest cached prefix) and `KVCacheManager.allocate_slots` (room for
#   a step's new tokens, or `None` when the pool is too short).
# * `vllm/v1/worker/block_table.py`, `BlockTable.compute_slot_mapping`:
#   `block_id * block_size + position % block_size` for every scheduled token.
#
# ## Takeaways
#
# * The paged cache is one tensor of blocks; a request is a list of block ids
#   (its block-table row); a token lives at `slot = block_id * block_size +
#   offset`. Kernels read and write through that indirection
#   (`kv_store` with `slot_mapping`, `paged_attention` with `block_table`).
# * Blocks are handed out as tokens arrive and returned the moment a request
#   finishes, so memory tracks what is actually used, with less than one block
#   of waste per request, and no contiguous region is ever needed.
# * How many requests fit depends on paging *and* on when they run (the
#   scenarios above count the two apart).
# * Full blocks are content-addressed by a chained digest, so requests with a
#   common prefix share physical blocks and skip recomputing them.
# * Same tokens as the contiguous cache, checked. Notebook 10 uses this freedom:
#   requests join and leave the batch at every step.
#
# ## Exercises
#
# A stub to fill in, a check cell below it (**PASS**, **FAIL** with the worst
# mismatch, or **not yet**). Solutions: `notebooks/solutions/nb09.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. Blocks for a request.** How many blocks of `block_size` slots hold
# `num_tokens` tokens? (Zero tokens need zero blocks.) Then sweep `block_size`
# (1, 4, 16, 64, 256) over this notebook's four requests and print the total
# waste: what does a large block cost, and what would a tiny one cost the
# block table?

# %%
from stagewise.exercises import check  # noqa: E402


def my_blocks_needed(num_tokens: int, block_size: int) -> int:
    raise NotImplementedError


# %%
check("09.blocks_needed", my_blocks_needed)

# %% [markdown]
# **2. The slot mapping.** Given a request's block-table row `block_ids`, the
# positions of the tokens scheduled this step and `block_size`, return the
# slot of each token. The check writes K through your slots with the
# `kv_store` stage, in three steps (a prefill, a chunk, a decode token), and
# reads the sequence back through the block table.


# %%
def my_slot_mapping(block_ids: list[int], positions: list[int], block_size: int) -> list[int]:
    raise NotImplementedError


# %%
check("09.slot_mapping", my_slot_mapping, save=True)

# %% [markdown]
# **3. The allocator.** Now the block manager's own job, on plain values: the
# pool's `free_queue` (a `deque` of block ids, least recently freed first),
# `ref_counts` (one count per block: how many requests hold it) and one
# request's block-table `row`. `my_allocate(free_queue, ref_counts, row,
# num_tokens, block_size)` makes `row` hold `num_tokens` tokens: take the
# blocks it lacks from the *front* of the queue, give each a count of 1, append
# them to the row and return the row. When the queue is too short, change
# nothing and return `False` (the scheduler then waits or preempts). The check
# runs a trace on a real `BlockManager` and calls your function on a copy of
# its state before each `allocate`: same row, same queue, same counts. Many of
# its requests ask for exactly the blocks left, or one more; the PASS line
# counts each kind.

# %%
def my_allocate(free_queue, ref_counts: list[int], row: list[int], num_tokens: int, block_size: int):
    raise NotImplementedError


# %%
check("09.allocate", my_allocate, save=True)

# %% [markdown]
# **4. Freeing.** `my_free(free_queue, ref_counts, row)`: the request is done
# (or preempted). Drop its reference on each block, *last block first*; a
# block whose count reaches 0 goes to the back of the free queue (a block of a
# shared prefix, still held by another request, stays out). Empty the row and
# return the block ids you put back, in order. The trace shares prompt
# prefixes, so some blocks have counts above 1.

# %%
def my_free(free_queue, ref_counts: list[int], row: list[int]) -> list[int]:
    raise NotImplementedError


# %%
check("09.free", my_free, save=True)

# %% [markdown]
# **5. The prefix-cache lookup.** `cached` maps a full block's digest to its
# block id. A block's digest names its whole prefix: `h_0 = block_digest(None,
# tokens[0:bs])`, `h_i = block_digest(h_{i-1}, tokens[i*bs:(i+1)*bs])`
# (`from stagewise.kv.block_manager import block_digest`).
# `my_cached_prefix(token_ids, block_size, cached)` returns the block ids of
# the longest run of hits from the start, stopping at the first miss, and never
# covering the last token (its logits are needed, so it must be computed: a
# 16-token prompt of 4-token blocks can reuse at most 3 blocks). Some of the
# check's `cached` dicts lack a block in the middle of a prompt's chain while
# the blocks after it are still there.

# %%
from stagewise.kv.block_manager import block_digest  # noqa: E402, F401 (your lookup's digest)


def my_cached_prefix(token_ids: list[int], block_size: int, cached: dict) -> list[int]:
    raise NotImplementedError


# %%
check("09.cached_prefix", my_cached_prefix, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#    .venv/bin/python -m pytest -q tests/engine/test_scheduler_properties.py tests/engine/test_paged_engine.py
#     .venv/bin/python -m pytest -q tests/exercises -k 09
