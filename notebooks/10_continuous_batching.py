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
# # 10 · Continuous batching: scheduling at the level of tokens
#
# Why batch at all (the seeds, chapter 7): a decode step for one user reads
# *every weight* from memory to produce one token. Serving B users in the
# same step reads the weights once for all B — the cost of the read is shared,
# and the GEMV becomes a GEMM again.
#
# **Static batching** starts a group of requests together and ends them
# together: the batch runs until its longest output is done, finished rows
# and short prompts' padding are computed anyway, and newcomers wait.
#
# **Continuous batching** (vLLM) schedules tokens, not requests. Each request
# has two counters, `num_tokens` (prompt + tokens generated so far) and
# `num_computed_tokens` (those whose K/V are in the cache), and every step
# schedules the difference: a whole prompt, a chunk of one, or the token
# sampled last step, side by side in one batch. A finished request leaves at
# once; a waiting one takes its seat in the next step. Four constraints decide
# who runs (`engine/scheduler.py`): `max_num_seqs`, the token budget
# `max_num_batched_tokens`, `max_model_len`, and free KV blocks; when blocks
# run out, the newest running request is **preempted** (freed, recomputed
# later).
#
# Path: stepping the engine by hand with the tracer -> a timeline ->
# preemption -> check (same tokens as each request alone) -> measure (static
# vs continuous on one workload) -> picture -> the seeds' (the project's two
# source articles, named in the README) chapters 7-8 measured: step time
# against the batch, and the gaps while a long prompt is prefilled.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): 4 requests (2 at a time),
# shorter, instead of 8 (4 at a time) in section 4; fewer batch sizes and
# tokens and a shorter long prompt in section 6. Sections 1-3 are the same.

# %%
import contextlib
import io
import os
import time

import numpy as np
import torch

import stagewise.viz.engine as ve  # the pictures
from stagewise import LLM, SamplingParams
from stagewise.bench.harness.timing import stream_timed
from stagewise.bench.harness.workloads import mixed_workload, single_prompt
from stagewise.calc.counts import kv_bytes_per_token, weight_bytes_streamed
from stagewise.config import EngineConfig
from stagewise.models.registry import load_model
from stagewise.trace.export import to_json
from stagewise.trace.tracer import Tracer
from stagewise.viz.trace import print_preemptions, print_steps

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
loaded = load_model("smollm2-135m", device="cpu")  # float32 on the CPU, even on a GPU machine: exact checks
tok = loaded.tokenizer
torch.set_num_threads(1)  # one thread: the ratios between steps, not peak speed, and less exposed to other work
with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once
    LLM(loaded, mode="kv")

# %% [markdown]
# ## 1. Step the engine by hand
#
# A paged engine with tight limits so every mechanism shows up in a few steps:
# at most **3** requests running, at most **32** tokens per step. Four
# requests arrive at once; a fifth arrives before step 6.
#
# | request | prompt tokens | max_tokens | what it will show |
# |---|---|---|---|
# | R0 | 70 | 10 | chunked prefill: 70 > 32, so its prompt spreads over three steps |
# | R1 | 12 | 8 | shares a step with R0's last chunk |
# | R2 | 20 | 3 | finishes early and frees its seat |
# | R3 | 8 | 5 | waits for a seat (3 are taken), joins when R2 leaves |
# | R4 | 6 | 4 | arrives before step 6, waits for the next free seat |

# %%
ecfg = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, block_size=16, num_kv_blocks=64, max_model_len=256)
llm = LLM(loaded, mode="paged", engine_config=ecfg)
plan = [(70, 10, 0), (12, 8, 0), (20, 3, 0), (8, 5, 0), (6, 4, 6)]  # (prompt tokens, max_tokens, arrives before step)
prompts = [single_prompt(tok, n, seed=10 + i) for i, (n, _, _) in enumerate(plan)]
params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m, _ in plan]
label = {}  # engine request id -> "R0", "R1", ...
stepped = {f"R{i}": [] for i in range(len(plan))}  # tokens each request received from step()
step = 0
with Tracer(timing=False) as tracer:
    while llm.has_unfinished_requests() or any(at >= step for *_, at in plan):
        for i, (_, _, at) in enumerate(plan):
            if at == step:
                label[llm.add_request(prompts[i], params[i])] = f"R{i}"
        for event in llm.step():
            stepped[label[event.request_id]].append(event.token_id)
        step += 1
trace = to_json(tracer)

print_steps(trace, label, budget=32)  # stagewise/viz/trace.py: one line per step, read from the trace

# %% [markdown]
# Read it as `num_computed_tokens -> after this step / num_tokens`:
#
# * **steps 0-1**: R0's 70-token prompt does not fit the 32-token budget, so it
#   gets 32 tokens per step (`prefill chunk`: nothing is sampled yet), and
#   everyone else waits for budget.
# * **step 2**: R0's last 6 prompt tokens, R1's whole 12-token prompt and the
#   first 14 of R2's 20 fill the 32 tokens. R0 and R1 sample their first
#   token: a request samples in the step its `num_computed_tokens` reaches
#   `num_tokens`.
# * **step 3: prefill and decode in one step**: R0 and R1 decode (+1 each)
#   while R2 finishes its prompt (+6).
# * **joining**: R3 waits (3 seats taken) until R2 finishes in step 5, and is
#   admitted in the very next step; R4 arrives before step 6, finds no seat,
#   and joins the step after R1 leaves. A request that joins brings its whole
#   prompt into a step where the others decode: those steps are the large ones
#   from step 3 on (the last line lists them with their sizes); every other
#   step is decode only, one token per running request.
#
# The table is read from the tracer's JSON (`stagewise.trace.export.to_json`);
# each step there also holds `batch`, what the forward pass received: one flat
# `[T]` batch with `positions`, `cu_seqlens_q`, `seq_lens`, `block_table` rows
# and `slot_mapping` (notebook 09), no padding. (`stagewise view run.json`
# replays a saved trace in a browser.)
#
# Check: stepping by hand, with requests joining mid-way, must give each
# request exactly the tokens it gets when it runs alone.

# %%
alone = LLM(loaded, mode="kv")
for i, (p, sp) in enumerate(zip(prompts, params)):
    assert stepped[f"R{i}"] == alone.generate(p, sp)[0].token_ids, f"R{i}"
print("every request got the same tokens as when it runs alone")

# %% [markdown]
# ## 2. The timeline
#
# A Gantt chart from the trace: one row per request, one column per engine
# step, coloured by what the request did in that step. The lower panel stacks
# the tokens of each step against the budget.


# %%
ve.timeline(trace, label, "continuous batching, max_num_seqs=3, 32 tokens per step", budget=32)

# %% [markdown]
# Blue is prompt work (pale: a chunk that samples nothing), green is one
# decode token, grey is waiting for a seat. Every column is *one* forward pass
# over a flat batch of all its coloured cells; the lower panel shows the
# steps filling up to the token budget while R0's long prompt is chunked, and
# then one token per running request (decode), except the steps in which R3
# and R4 bring their prompts.
#
# Chunked prefill is the seeds' answer to the "straggler effect": a long
# prompt scheduled whole would make one step very slow, and every user who is
# decoding in that step would see a long pause between tokens. Cut into
# budget-sized chunks, the prompt shares steps with the decoders instead.
#
# ## 3. Preemption: when the KV blocks run out
#
# A KV pool of only **4 blocks** (64 token slots) and three requests of 14
# prompt tokens that each grow to 28 (2 blocks): all three fit at the start,
# not once they cross 16 tokens. When a running request needs a block and
# none is free, the scheduler frees the *most recently admitted* running
# request's blocks, resets its `num_computed_tokens` to 0 and puts it at the
# front of the waiting queue (its generated tokens are kept, recomputed with
# its prompt when it resumes).

# %%
tight = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16, num_kv_blocks=4, max_model_len=256)
small = LLM(loaded, mode="paged", engine_config=tight)
p_prompts = [single_prompt(tok, 14, seed=20 + i) for i in range(3)]
p_params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)] * 3
with Tracer(timing=False) as tracer:
    p_outs = small.generate(p_prompts, p_params)
p_trace = to_json(tracer)
p_label = {o.request_id: f"P{i}" for i, o in enumerate(p_outs)}
print_preemptions(p_trace, p_label)  # the steps that preempted someone or ran a prompt
print(f"preemptions: {small.last_stats.preemptions}, steps: {small.last_stats.steps}")
for o, p, sp in zip(p_outs, p_prompts, p_params):
    assert o.token_ids == alone.generate(p, sp)[0].token_ids
print("check: preempted and recomputed, every request still gets the tokens it gets alone")

# %%
ve.timeline(p_trace, p_label, "preemption: 4 KV blocks for three requests that each need 2", budget=64)

# %% [markdown]
# The red cross marks the step where a request lost its blocks. It waits
# (grey) until blocks free up, then runs a `prefill` of its prompt *plus* the
# tokens it had already generated — recompute is the price of preemption —
# and continues decoding where it stopped.
#
# ## 4. Measure: static vs continuous batching on the same workload
#
# A seeded mixed workload (`stagewise.bench.harness.workloads.mixed_workload`):
# prompts and output lengths drawn at random, greedy, `ignore_eos` so every
# request generates exactly its `max_tokens`. Both engines may run the same
# number of requests at once:
#
# * static (`mode="kv"`): batches of `max_num_seqs` requests in arrival order;
#   each batch is left-padded to its longest prompt and runs until its longest
#   output is done; the next batch waits;
# * continuous (`mode="paged"`): a request leaves the moment it is done and
#   the next one is admitted in the following step.
#
# `last_stats` counts what each run pushed through the model: `tokens_computed`
# (rows of every forward pass) and `padding_tokens` (rows that were padding or
# belonged to an already finished request).

# %% tags=["timing"]
if QUICK:
    work = mixed_workload(tok, num_requests=4, prompt_tokens=(8, 24), output_tokens=(4, 12), seed=1)
    seats = 2
else:
    work = mixed_workload(tok, num_requests=8, prompt_tokens=(16, 96), output_tokens=(8, 64), seed=1)
    seats = 4
print("prompt tokens:", [r.prompt_tokens for r in work.requests])
print("output tokens:", [r.max_tokens for r in work.requests])

results = {}
for mode in ("kv", "paged"):
    engine = LLM(loaded, mode=mode, engine_config=EngineConfig(max_num_seqs=seats, max_model_len=256))  # fresh engine
    with Tracer(timing=False) as tracer:
        start = time.perf_counter()
        outs = engine.generate(work.prompts(), work.params())
        wall = time.perf_counter() - start
    results[mode] = {"outs": outs, "stats": engine.last_stats, "wall": wall, "trace": to_json(tracer)}
for a, b in zip(results["kv"]["outs"], results["paged"]["outs"]):
    assert a.token_ids == b.token_ids
useful = sum(r.prompt_tokens + r.max_tokens - 1 for r in work.requests)  # rows a perfect engine computes
print(f"same tokens in both modes; rows that are real work: {useful}")
print(f"{'':>11} {'steps':>6} {'rows computed':>14} {'padding rows':>13} {'wall s':>7} {'out tok/s':>10}")
for mode, name in (("kv", "static"), ("paged", "continuous")):
    st, wall = results[mode]["stats"], results[mode]["wall"]
    rate = sum(len(o.token_ids) for o in results[mode]["outs"]) / wall
    print(f"{name:>11} {st.steps:>6} {st.tokens_computed:>14} {st.padding_tokens:>13} {wall:>7.1f} {rate:>10.1f}")
static, continuous = results["kv"], results["paged"]
saved = static["stats"].tokens_computed - continuous["stats"].tokens_computed
print(f"continuous batching computed {saved} fewer rows ({saved / static['stats'].tokens_computed:.0%} of static's) "
      f"in {continuous['wall'] / static['wall']:.2f}x static's wall time")  # fmt: skip

# %% [markdown]
# ## 5. The picture
#
# The same workload as two timelines, on the same step axis. Static: the
# second batch starts only when the first is entirely done; a finished row
# keeps running as padding (pink) until its batch's longest request ends, and
# the prefill step computes every short prompt's left padding (hatched, lower
# panel). Continuous: a seat freed in one step is taken in the next, and every
# row computed is a real token.

# %%
names_of = [f"#{i} ({r.prompt_tokens}+{r.max_tokens})" for i, r in enumerate(work.requests)]
labels = {mode: {o.request_id: n for o, n in zip(res["outs"], names_of)} for mode, res in results.items()}
xmax = max(len(res["trace"]["steps"]) for res in results.values())
ve.timeline(results["kv"]["trace"], labels["kv"], f"static batching (mode='kv'), {seats} requests per batch", xmax=xmax)
ve.timeline(results["paged"]["trace"], labels["paged"], f"continuous batching (mode='paged'), {seats} seats", xmax=xmax)

# %% [markdown]
# And the totals: rows pushed through the model (real work vs padding), and
# how long each request took from arrival to its last token.

# %%
ve.work_and_latency(
    {"static": results["kv"]["stats"], "continuous": results["paged"]["stats"]},
    {"static": [o.metrics.latency for o in results["kv"]["outs"]],
     "continuous": [o.metrics.latency for o in results["paged"]["outs"]]},
    [f"#{i}\n{r.prompt_tokens}+{r.max_tokens}" for i, r in enumerate(work.requests)],
)  # fmt: skip

# %% [markdown]
# Static batching computes padding and keeps dead rows running until each
# batch's longest request ends; continuous batching computes only real tokens
# and keeps every seat busy, so short requests come back early. (The step
# counts can come out close: both engines have the same seats, one token per
# seat per step; the gain is in what the steps compute and in who waits.) The
# row counts are exact. Whether fewer rows mean less wall time depends on how
# much of a step's cost grows with its rows: the line under the table says
# what it did on this run; with few, short requests (quick mode) there is
# little padding to save, and the two wall times can come out close.

# %% [markdown]
# ## 6. The seeds' chapters 7-8, measured on this machine
#
# Chapters 7 and 8 of the seeds make three claims about batching. Each can be
# measured here, with the real model, on this CPU:
#
# 1. **Batching shares the weight read.** A decode step reads every weight
#    once whatever the batch; with B sequences it does B times the arithmetic
#    on the same bytes. While the step is bound by memory, adding sequences
#    costs little: the step time stays nearly **flat**; once the arithmetic
#    catches up with the memory traffic it **rises** with B.
# 2. **Throughput against latency.** Every sequence in the step waits for the
#    whole step, so the time between its tokens (TBT) is the step time. A
#    larger batch buys throughput (B tokens per step) with TBT.
# 3. **The straggler effect.** A long prompt prefilled in the same step as
#    the decoding requests makes that step long, and every decoding user sees
#    a pause. Chunked prefill caps the prompt tokens a step may take while
#    others decode (`EngineConfig(prefill_beside_decodes=...)`) and trades
#    that pause for a later first token of the long prompt.
#
# Timing: `stagewise.bench.harness.timing.stream_timed` stamps every token as it
# reaches the caller, so the gap between two tokens of one request is one
# engine step as that user sees it. Every request is greedy with
# `ignore_eos=True`, so each generates exactly its `max_tokens`.
#
# ### 6.1 Decode step time against the batch
#
# B requests with prompts of equal length start together: one prefill step,
# then decode steps with all B in lockstep. The median gap between tokens is
# the decode step time at batch B. (A first short run warms the engine up;
# every size is measured twice, in both orders, and the lower median kept: a
# moment of other work on the machine inflates one of the two.)

# %% tags=["timing"]
batch_sizes = (1, 4, 8) if QUICK else (1, 2, 4, 8, 16)
decode_tokens = 6 if QUICK else 16
greedy = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
seats_cfg = EngineConfig(max_num_seqs=max(batch_sizes), max_model_len=256, enable_prefix_caching=False)
seats_llm = LLM(loaded, mode="paged", engine_config=seats_cfg)
stream_timed(seats_llm, [single_prompt(tok, 16, seed=99)], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
step_ms = {}
for B in [*batch_sizes, *reversed(batch_sizes)]:
    timed = stream_timed(seats_llm, [single_prompt(tok, 16, seed=100 + i) for i in range(B)], greedy)
    gaps = [b - a for r in timed for a, b in zip(r.token_times, r.token_times[1:])]  # every gap is one decode step
    step_ms[B] = min(step_ms.get(B, float("inf")), 1e3 * float(np.median(gaps)))
step_ms = dict(sorted(step_ms.items()))

cfg = loaded.config
print(f"{'B':>3} {'step ms':>8} {'tokens/s':>9} {'weights GB/s':>13} {'GFLOP/s':>8}")
for B, ms in step_ms.items():
    streamed = weight_bytes_streamed(cfg, 4, B).value  # float32 weights read once per step
    flops = B * 2 * cfg.num_parameters()  # about 2 FLOPs per weight per token
    print(f"{B:>3} {ms:>8.1f} {B / ms * 1e3:>9.1f} {streamed / ms / 1e6:>13.2f} {flops / ms / 1e6:>8.1f}")
for B in batch_sizes[1:]:
    ratio = step_ms[B] / step_ms[1]
    verdict = "shared: well under B" if ratio < 0.75 * B else "near B: arithmetic-bound here, or a busy moment: rerun"
    print(f"B={B:>2}: {B}x the tokens per step of B=1 for {ratio:.2f}x its step time ({verdict})")
kv = kv_bytes_per_token(cfg, 4).value * (16 + decode_tokens)  # the longest context here
print(f"KV read per sequence per step: at most {kv / 1e6:.2f} MB, against "
      f"{weight_bytes_streamed(cfg, 4, 1).value / 1e6:.0f} MB of weights")  # fmt: skip

# %% [markdown]
# Read the table against the seeds' claim. If every sequence paid for its
# own pass over the weights, the step would cost B times the B = 1 step (the
# dotted line in the picture below). A ratio well under B (the last lines)
# means the weights' read is shared: the tokens per second grow several-fold.
# A ratio near B means either that this machine is already arithmetic-bound
# at that size, or that other work took the cores during the measurement; a
# rerun tells them apart (a busy moment does not repeat in the same place).
# "weights GB/s" at B = 1 is the rate at which a decode step streams the
# weights here; as B grows, the arithmetic per byte grows with it (GFLOP/s)
# and bends the curve from flat towards rising. The KV cache read is tiny
# next to the weights with these short contexts (last line); with long ones
# it grows with B and makes the step rise sooner: every user's KV cache is
# private and read in full at every step.
#
# ### 6.2 Throughput against time between tokens
#
# The same measurements, read the way a service operator reads them: every
# point is one batch size; right is slower for each user, up is more tokens
# per second for the machine.

# %%
ve.step_time_and_throughput(step_ms, cfg.name)

# %% [markdown]
# ### 6.3 A long prompt among decoding requests
#
# A few requests are decoding when a long prompt arrives. With a large
# `prefill_beside_decodes` the scheduler puts the whole prompt into the next
# step; with a small one it takes a chunk per step and the decoders keep
# their pace. Both engines are stepped by hand (`add_request`, `step`), and
# every step's end is timed; the decoders' gaps are the steps they waited
# through.

# %% tags=["timing"]
decoders = 3 if QUICK else 4
long_tokens = 128 if QUICK else 384
decode_steps = 12 if QUICK else 40
arrives = 4  # the long prompt arrives before this step (after the decoders' prefill and a few decode steps)
small_cap = EngineConfig().prefill_cap("cpu")  # the engine's default on a CPU
caps = {"large": 512, "small": small_cap}
short = [single_prompt(tok, 16, seed=200 + i) for i in range(decoders)]
long_prompt = single_prompt(tok, long_tokens, seed=300)
runs = {}
for name, cap in caps.items():
    ecfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, prefill_beside_decodes=cap, max_model_len=1024,
                        enable_prefix_caching=False)
    engine = LLM(loaded, mode="paged", engine_config=ecfg)
    keep_decoding = SamplingParams(max_tokens=decode_steps, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, keep_decoding) for p in short]
    arrivals = {i: [] for i in ids}  # request id -> seconds at which each of its tokens came back
    t0, step = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        if step == arrives:
            long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
            long_arrival = time.perf_counter() - t0
            arrivals[long_id] = []
        for event in engine.step():
            arrivals[event.request_id].append(time.perf_counter() - t0)
        step += 1
    runs[name] = {"arrivals": arrivals, "decoders": ids, "long": long_id, "long_arrival": long_arrival, "cap": cap}

print(f"{decoders} decoders, a {long_tokens}-token prompt arrives before step {arrives}")
print(f"{'cap':>12} {'median gap ms':>14} {'longest gap ms':>15} {'longest / median':>17} {'long prompt TTFT s':>19}")
for name, run in runs.items():
    gaps = [1e3 * (b - a) for i in run["decoders"] for a, b in zip(run["arrivals"][i], run["arrivals"][i][1:])]
    ttft = run["arrivals"][run["long"]][0] - run["long_arrival"]
    median = float(np.median(gaps))
    print(f"{name + ' (' + str(run['cap']) + ')':>12} {median:>14.1f} {max(gaps):>15.1f} {max(gaps) / median:>16.1f}x "
          f"{ttft:>19.2f}")  # fmt: skip
    run["worst"] = max(gaps)
smaller = "small" if runs["small"]["worst"] < runs["large"]["worst"] else "large"
print(f"this run: the {smaller} cap gave the shorter longest gap")

# %% [markdown]
# The picture: every gap one decoder saw, at the time its token arrived, for
# both settings; the shaded span is the long prompt from its arrival to its
# first token.

# %%
ve.gaps_while_prefilling(runs, long_tokens)

# %% [markdown]
# What the two settings do is fixed by the scheduler: with the large one, one
# step carries the whole prompt (the seeds' straggler: one gap many times the
# usual TBT); with the small one the prompt is spread over several steps, each
# longer than a decode step by one chunk's time, and the long prompt's first
# token comes later (TTFT column). What the clock shows depends on the prompt
# and the machine. When the large cap's "longest / median" is the larger (the
# line under the table says which was), the straggler is seen and chunking
# removed it. When it is not, either the whole prompt costs little more than
# a chunk here (a short prompt: quick mode's is), or another job took the
# cores during one gap (an outlier away from the shaded span): rerun with a
# longer prompt before concluding. Which setting is better is a policy
# choice; the scheduler makes it one number.

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# * `vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`: running requests
#   first, then waiting ones, under `max_num_batched_tokens` and
#   `max_num_seqs`, a long prompt cut to the budget (chunked prefill); when
#   `KVCacheManager.allocate_slots` finds no room it preempts the last running
#   request (its blocks freed, `num_computed_tokens` reset to 0, back to the
#   front of the waiting queue): your exercise 3.
# * `Scheduler.update_from_output` (same file): appends the sampled tokens and
#   finishes requests, freeing their blocks.
# * `vllm/v1/engine/core.py`, `EngineCore.step`: one `schedule()`, one model
#   execution over the flat batch, one update — the step traced above.
#
# ## Takeaways
#
# * The scheduler sees two numbers per request and schedules the difference:
#   whole prompts, prompt chunks and decode tokens in one flat batch, no
#   padding. Seats, the token budget (chunked prefill), `max_model_len` and
#   free KV blocks (preemption by recompute) gate every step.
# * Requests join and leave at every step, and each gets exactly the tokens it
#   gets alone. Against static batching: no padding rows, seats refilled at
#   every step, earlier finishes for short requests.
# * A decode step reads the weights once for the whole batch: more sequences
#   cost little while the read dominates; then the step (every user's TBT)
#   grows. A long prompt beside decoders stalls them for a step, unless
#   `prefill_beside_decodes` caps it, at the price of its later first token.
#
# ## Exercises
#
# A stub to fill in, a check cell below it (**PASS**, **FAIL** with the worst
# mismatch, or **not yet**). Solutions: `notebooks/solutions/nb10.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. What static batching computes.** Requests run in batches of `seats`, in
# order. A batch's prefill pads every prompt (on the left) to the batch's
# longest prompt; then the batch runs one decode row per request per step
# until its longest output is done (the prefill already produced each
# request's first token), finished rows included. Return
# `(rows computed, padding rows)`; the check runs the static engine
# (`mode="kv"`, tiny model) and reads its counters.

# %%
from stagewise.exercises import check  # noqa: E402


def my_static_rows(prompt_lens: list[int], output_lens: list[int], seats: int) -> tuple[int, int]:
    raise NotImplementedError


# %%
check("10.static_rows", my_static_rows)

# %% [markdown]
# **2. What continuous batching computes.** Same requests, paged engine, no
# preemption, no prefix cache: how many rows does it push through the model in
# total? Then compare your two functions on this notebook's workload
# (`[r.prompt_tokens for r in work.requests]`, `[r.max_tokens ...]`, `seats`)
# with the table of section 4.


# %%
def my_continuous_rows(prompt_lens: list[int], output_lens: list[int]) -> int:
    raise NotImplementedError


# %%
check("10.continuous_rows", my_continuous_rows)

# %% [markdown]
# **3. Write `schedule()`.** One step of the scheduler, the heart of this
# notebook. `running` is a list and `waiting` a `deque` of requests, each with
# `request_id`, `num_tokens` (prompt + outputs so far) and
# `num_computed_tokens`; `allocate(seq, n) -> bool` asks the (real) block
# manager for room for `n` more tokens, `free(seq)` returns its blocks.
# Return the step's `[(request_id, num_new_tokens), ...]` in order, and leave
# `running` / `waiting` as the step leaves them:
#
# 1. running requests first, in order, while budget is left: each gets
#    `min(num_tokens - num_computed_tokens, budget)` tokens;
# 2. when `allocate` fails, preempt the *last* running request by recompute
#    (`free` it, `num_computed_tokens = 0`, to the *front* of `waiting`) and
#    try again; if that was the request asking, stop;
# 3. only if nobody was preempted, admit waiting requests from the front while
#    seats and budget last; if `allocate` fails, it and everyone behind wait.
#
# The check runs your function beside the real `Scheduler`, each over its own
# block manager, and compares every step: what is scheduled, both queues, and
# the blocks each request holds. Its workloads make every rule decide something
# (some change the budget from step to step), and the PASS line counts how
# often each did.


# %%
def my_schedule(running, waiting, budget: int, max_num_seqs: int, allocate, free) -> list[tuple[str, int]]:
    raise NotImplementedError


# %%
check("10.schedule_step", my_schedule, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/engine/test_scheduler_properties.py
#     .venv/bin/python -m pytest -q tests/engine/test_prefill_beside_decodes.py
#     .venv/bin/python -m pytest -q tests/exercises -k 10
