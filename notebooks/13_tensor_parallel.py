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
# # 13 · Tensor parallelism: one model, N devices
#
# Llama 3 405B does not fit on one GPU. Every serious engine (vLLM,
# nano-vllm, TensorRT-LLM) answers with **tensor parallelism**: split every
# weight matrix over N devices, let each compute its slice of every layer,
# and add the slices up with an **all-reduce** twice per block.
#
# This notebook: why one device is not enough (the seeds' 405B numbers) ->
# how each matrix splits (a picture) -> why the split is exact (a check, no
# processes) -> a real TP=2 run on this CPU with torch.distributed (gloo),
# traced rank by rank -> what the calculator says for 405B on 8 GPUs.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the traced run generates 2
# tokens instead of 4. Nothing else changes.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import os

import matplotlib.pyplot as plt
import torch

from stagewise import LLM, SamplingParams, viz
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.roofline import analyze
from stagewise.calc.tensor_parallel import INTERCONNECTS, analyze_tp
from stagewise.calc.units import human
from stagewise.config import PRESETS
from stagewise.models.registry import load_model
from stagewise.parallel.shard import shard_plan, shard_weights, valid_tp_sizes
from stagewise.trace import Tracer

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"

# %% [markdown]
# ## 1. Why one device is not enough
#
# The seeds' model: Llama 3.1 405B (its shape printed below). In bf16 its
# weights alone outweigh any one GPU; here they are against an H100 and an
# H200:

# %%
l405 = PRESETS["llama-3-405b"]
print(f"Llama 3.1 405B: {l405.num_layers} layers, hidden {l405.hidden_size}, {l405.num_heads} query heads, "
      f"{l405.num_kv_heads} KV heads")
for hw in (HARDWARE["h100"], HARDWARE["h200"]):
    a = analyze(l405, hw, context=8192, batch=1, dtype="bf16")
    print(f"{hw.name:>10}: weights {human(a.weight_bytes):>10} vs memory {hw.memory_bytes / 1e9:.0f} GB "
          f"-> memory left for the KV cache: {human(a.capacity.free_for_kv)}")  # fmt: skip

# %% [markdown]
# Even if they fitted, one decode step reads all of them once:

# %%
h100 = HARDWARE["h100"]
w405 = analyze(l405, h100, context=8192, batch=1, dtype="bf16").weight_bytes
print(f"{w405.value / h100.memory_bytes:.1f} H100s' worth of weights; one decode token streams them: "
      f"{w405.value / 1e9:.0f} GB / {h100.memory_bandwidth / 1e12:.2f} TB/s = "
      f"{w405.value / h100.memory_bandwidth:.2f} s per token")  # fmt: skip

# %% [markdown]
# Splitting the matrices over
# N devices divides both the memory per device *and* the bytes each device
# streams per token by N — if the N devices talk fast enough.
#
# ## 2. How each matrix splits (Megatron-style)
#
# `stagewise.parallel.shard` cuts the weights the way vLLM does:
#
# | weight | shape | split | then |
# |---|---|---|---|
# | `w_qkv` | `[hidden, (H+2Hkv)d]` | columns by head: H/N query, Hkv/N KV heads | local attention |
# | `w_o` | `[Hd, hidden]` | rows (the rank's heads) | partial sums -> **all-reduce** |
# | `w_gate_up` | `[hidden, 2 inter]` | columns: a slice of gate, same slice of up | local `silu(gate) * up` |
# | `w_down` | `[inter, hidden]` | rows (the same slice) | partial sums -> **all-reduce** |
# | `embed` | `[V, hidden]` | vocabulary rows | masked lookup + **all-reduce** |
# | `lm_head` | `[hidden, V]` | vocabulary columns | logits gathered on rank 0 |
# | norms | `[hidden]` | replicated | |
#
# Column-parallel then row-parallel is the trick: the column split's output is
# exactly the row split's input slice, so the only communication per pair is
# one all-reduce at the end. The picture, for SmolLM2 (9 heads, 3 KV heads) on
# 3 ranks — each colour is one rank's part:

# %%
smol = PRESETS["smollm2-135m"]
N = 3
plans = [shard_plan(smol, r, N) for r in range(N)]
d, hid, inter = smol.head_dim, smol.hidden_size, smol.intermediate_size
q_spans = [(p.q_heads.start * d, p.q_heads.stop * d, p.rank) for p in plans]
k_spans = [(smol.q_size + p.kv_heads.start * d, smol.q_size + p.kv_heads.stop * d, p.rank) for p in plans]
v_spans = [(a + smol.kv_size, b + smol.kv_size, r) for a, b, r in k_spans]
gu = [(p.inter.start, p.inter.stop, p.rank) for p in plans]
gate_up_spans = gu + [(a + inter, b + inter, r) for a, b, r in gu]
per_rank = plans[0]
viz.matrix_splits(
    [
        (f"w_qkv [{hid}, {smol.qkv_size}]: columns by head\n(Q | K | V)", smol.qkv_size, hid,
         q_spans + k_spans + v_spans, True),
        (f"w_o [{smol.q_size}, {hid}]: rows by head", hid, smol.q_size, q_spans, False),
        (f"w_gate_up [{hid}, {2 * inter}]: columns\n(gate | up)", 2 * inter, hid, gate_up_spans, True),
        (f"w_down [{inter}, {hid}]: rows", hid, inter, gu, False),
    ],
    N,
    f"SmolLM2-135M ({smol.num_heads} query heads, {smol.num_kv_heads} KV heads) over {N} ranks: each holds "
    f"{len(per_rank.q_heads)} query heads, {len(per_rank.kv_heads)} KV head(s), {len(per_rank.inter)} FFN columns",
)  # fmt: skip
plt.show()
print("valid N for SmolLM2:", valid_tp_sizes(smol), "· for Llama 3 405B:", valid_tp_sizes(l405))

# %% [markdown]
# Not every N works: the heads must divide evenly, and the KV heads must
# either divide by N or be replicated on N/Hkv ranks each (vLLM's rule). With
# 8 KV heads and N = 8, every rank holds exactly one; with N = 16 each KV head
# would live on two ranks.
#
# ## 3. Why the split is exact: the all-reduce
#
# Row-parallel `x @ w_o` with `x = [x_0 | x_1 | x_2]` (the ranks' heads side by
# side) and `w_o` cut into the matching rows is a sum of N partial products:
#
#     x @ w_o = x_0 @ w_o_0 + x_1 @ w_o_1 + x_2 @ w_o_2
#
# Each rank computes one term; the all-reduce adds them and hands every rank
# the sum. Checked on the real SmolLM2 weights, in this one process:

# %%
model = load_model("smollm2-135m")
shards = [shard_weights(model.weights, smol, p, torch.device("cpu"), torch.float32) for p in plans]
x = torch.randn(5, smol.q_size, generator=torch.Generator().manual_seed(0))  # 5 tokens' attention outputs
full = x @ model.weights.layers[0].w_o  # [5, 576] @ [576, 576]
partial = [x[:, p.q_heads.start * d : p.q_heads.stop * d] @ s.layers[0].w_o for p, s in zip(plans, shards)]
print("shard shapes:", [tuple(s.layers[0].w_o.shape) for s in shards], "-> partials", [tuple(t.shape) for t in partial])
print("max |sum of partials - full| =", (sum(partial) - full).abs().max().item())  # float32 rounding only

# %% [markdown]
# A ring all-reduce over N ranks sends and receives 2(N-1)/N of the message
# per rank (a reduce-scatter then an all-gather). The message is the
# activations `[T, hidden]`: in decode, T = the batch, so it is *small*:

# %%
print(f"one 405B token in bf16: {l405.hidden_size} x 2 B = {l405.hidden_size * 2 / 1024:.0f} KiB per all-reduce")

# %% [markdown]
# ## 4. A real run: TP=2 on this CPU, traced rank by rank
#
# `LLM(..., tensor_parallel_size=2)` starts one worker process (rank 1) with
# torch.multiprocessing; this process is rank 0. They meet in a gloo process
# group. Rank 0 schedules, broadcasts each step's batch metadata (input ids,
# positions, slot mapping, block table rows), runs its half, and samples;
# rank 1 runs the same forward on its half. `tiny`'s query heads and KV heads
# (printed below) split in half, one half per rank.

# %% tags=["timing"]
tiny = PRESETS["tiny"]
print(f"tiny: {tiny.num_heads} query heads, {tiny.num_kv_heads} KV heads, FFN {tiny.intermediate_size}")
print(f"per rank at TP=2: {tiny.num_heads // 2} query heads, {tiny.num_kv_heads // 2} KV head(s), "
      f"FFN {tiny.intermediate_size // 2}")
prompts = ["The capital of France is", "Tensor parallel"]
params = SamplingParams(max_tokens=2 if QUICK else 4, temperature=0.0, ignore_eos=True)
reference = [o.token_ids for o in LLM("tiny").generate(prompts, params)]
with LLM("tiny", tensor_parallel_size=2) as llm, Tracer() as tracer:
    got = [o.token_ids for o in llm.generate(prompts, params)]
print("TP=1:", reference, "\nTP=2:", got, "\nsame greedy tokens:", got == reference)

# %% [markdown]
# The last step's layer 0, as each rank saw it: the same stages, half the
# heads, half the FFN, and the two all-reduces (plus the embedding's one and
# the LM head's gather outside the blocks):

# %%
step = tracer.steps[-1]
print(f"{'rank':>4} {'stage':<16} {'weight / tensor':<28} {'out':<16} {'ms':>6}")
for rec in step.stages:
    if rec.layer not in (0, None) or rec.stage in ("sampling", "rmsnorm"):
        continue
    weight = next((t for t in rec.inputs if t.name.startswith("w") or t.name == "x"), rec.inputs[0])
    out = rec.outputs[0].shape if rec.outputs else "(in place)"
    print(f"{rec.rank:>4} {rec.stage:<16} {weight.name + ' ' + str(weight.shape):<28} {str(out):<16} "
          f"{(rec.dur_us or 0) / 1000:>6.2f}")  # fmt: skip

# %% [markdown]
# Where the time goes, per rank (one bar per stage kind, summed over the
# step). The two processes share this machine's CPU cores (the cell prints
# how many), and the all-reduces are not free: each is a round trip through
# the loopback network stack; the cell prints their measured durations next
# to a tiny GEMM's. That is why TP on a
# CPU *costs* time (`stagewise bench modes --tp 1,2` measures it): it adds no
# hardware, only communication. On GPUs it adds memory bandwidth N-fold.

# %%
print(f"CPU cores on this machine: {os.cpu_count()}, shared by the 2 ranks' processes")
for rank in (0, 1):
    ar = sorted((r.dur_us or 0) for r in step.stages if r.rank == rank and r.stage == "all_reduce")
    mm = sorted((r.dur_us or 0) for r in step.stages if r.rank == rank and r.stage in ("qkv_proj", "o_proj"))
    print(f"rank {rank}: {len(ar)} all-reduces of {ar[0]:.0f} .. {ar[-1]:.0f} µs (median {ar[len(ar) // 2]:.0f}); "
          f"its qkv_proj / o_proj GEMMs: median {mm[len(mm) // 2]:.0f} µs")
kinds = sorted({r.stage for r in step.stages})
ms_by_rank = {  # rank -> ms of its calls of each kind in the step
    rank: [sum((r.dur_us or 0) for r in step.stages if r.rank == rank and r.stage == k) / 1000 for k in kinds]
    for rank in (0, 1)
}
viz.per_rank_times(kinds, ms_by_rank, "tiny, TP=2 on gloo: each rank's stages and collectives")
plt.show()

# %% [markdown]
# `stagewise trace "Hello" --model tiny --tp 2 --format chrome --out tp.json`
# writes the same run for Perfetto (ui.perfetto.dev): one process track per
# rank, all-reduces facing each other.
#
# ## 5. What the calculator says: 405B on 8 GPUs
#
# `stagewise calc --tp 8` (`stagewise.calc.tensor_parallel`) applies the same split
# to the shape-only 405B: weights and KV per device, and the all-reduces as a
# ring with a per-collective latency term.

# %%
rows = []
for hw_name in ("h100", "h200"):
    for link in ("nvlink4", "pcie4"):
        t = analyze_tp(l405, HARDWARE[hw_name], 8, "bf16", 2, 8192, 1, INTERCONNECTS[link])
        rows.append((f"8x {hw_name} {link}", t))
        print(f"8x {hw_name} over {link}: weights/device {human(t.weights_per_device)}, KV left "
              f"{human(t.capacity.free_for_kv)}, decode all-reduce {human(t.decode_message)} in "
              f"{t.decode_all_reduce.value * 1e6:.1f} µs, per token {human(t.decode_time)}")  # fmt: skip
shard = [t.decode_shard.time.value * 1e3 for _, t in rows]  # ms per token: one shard at the speed of light
comm = [t.decode_comm.value * 1e3 for _, t in rows]  # ms per token in all-reduces
viz.stacked_rows(
    [n for n, _ in rows],
    [("one shard's decode (speed of light)", shard),
     (f"{rows[0][1].all_reduces_per_step.value:.0f} all-reduces (ring + latency)", comm)],
    "ms per output token, batch 1, N = 8192",
    "Llama 3 405B, bf16, TP = 8",
)  # fmt: skip
plt.show()

# %%
h200_nvlink = dict(rows)["8x h200 nvlink4"]
link = INTERCONNECTS["nvlink4"]
per_device = h200_nvlink.weights_per_device.value
print(f"weights per device: {per_device / 1e9:.1f} GB (H100 holds {HARDWARE['h100'].memory_bytes / 1e9:.0f} GB, "
      f"H200 {HARDWARE['h200'].memory_bytes / 1e9:.0f} GB)")  # fmt: skip
message = h200_nvlink.decode_message.value
print(f"one decode all-reduce: {message / 1024:.0f} KiB, {message / link.bandwidth * 1e6:.2f} µs of bandwidth "
      f"against {link.latency * 1e6:.0f} µs of latency; "
      f"{h200_nvlink.all_reduces_per_step.value:.0f} of them per token")  # fmt: skip

# %% [markdown]
# The weights per device do not fit an 80 GB H100 (vLLM serves 405B on 8
# H100s in fp8, or on 16) and fit a 141 GB H200 with room left for the KV
# cache. Each decode all-reduce is the size printed above (one token's hidden
# state, tens of KiB): its bandwidth time is tiny next to the link's fixed
# latency — **latency-bound**, once per all-reduce, twice per block. Over PCIe
# the latency is higher and TP's share of the step grows (the bars above).
#
# ## In vLLM (v0.11.0)
#
# `ColumnParallelLinear` and `RowParallelLinear` in
# `vllm/model_executor/layers/linear.py` hold each rank's columns / rows; the row
# layer ends with `tensor_model_parallel_all_reduce`
# (`vllm/distributed/communication_op.py`), which calls `GroupCoordinator.all_reduce`
# in `vllm/distributed/parallel_state.py` (NCCL or vLLM's custom all-reduce for
# small messages). `VocabParallelEmbedding` / `ParallelLMHead`
# (`vllm/model_executor/layers/vocab_parallel_embedding.py`) split the vocabulary.
#
# ## Takeaways
#
# * Tensor parallelism splits every matrix: QKV and gate|up by columns, o_proj
#   and down by rows, the vocabulary by rows; norms are replicated.
# * Column-then-row needs one all-reduce per pair: 2 per block (+1 for the
#   embedding, + a gather of the logits). Attention needs none: heads are local.
# * Each rank's KV cache holds its KV heads only, under the one block table;
#   with N > Hkv a KV head is replicated (KV per device stops shrinking).
# * TP divides memory and weight traffic by N, and adds (2L+1) small
#   all-reduces per step that are latency-bound in decode. On a CPU it adds no
#   hardware, so it only costs.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb13.py`.
#
# **1. What a decode step sends.** A decode step of `batch` sequences runs
# every block's two all-reduces (after `o_proj` and after `down`) plus the
# embedding's. Each one adds up the ranks' partial `[T, hidden]` activations,
# `dtype_bytes` per number. Return `(bytes of one all-reduce's message,
# all-reduces per step)` for the model `cfg`. Notice that N, the number of
# ranks, is not an argument: the check tries two N per model and compares with
# `stagewise.calc.tensor_parallel.analyze_tp`. Then evaluate it for Llama 3 70B at batch 16 in bf16.

# %%
from stagewise.exercises import check  # noqa: E402


def my_decode_allreduces(cfg, batch: int, dtype_bytes: int) -> tuple[int, int]:
    raise NotImplementedError


# %%
check("13.decode_allreduces", my_decode_allreduces)

# %% [markdown]
# **2. Which N split a model?** Return every N, in ascending order, for which
# the query heads and the FFN columns divide by N and the KV heads either
# divide by N or are replicated (N a multiple of `num_kv_heads`). The check
# compares with `parallel.shard.valid_tp_sizes` on every preset. Why is N = 3
# not valid for `tiny` (its heads, KV heads and FFN size are printed in
# section 4), though 3 divides its query heads?


# %%
def my_valid_tp_sizes(cfg) -> list[int]:
    raise NotImplementedError


# %%
check("13.valid_tp_sizes", my_valid_tp_sizes)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/parallel/test_tensor_parallel.py tests/calc/test_calc_tp.py
#     .venv/bin/python -m pytest -q tests/exercises -k 13
