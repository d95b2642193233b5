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
# # 17 · Batch invariance: the same tokens, whatever the batch
#
# Notebooks 08-10 promised that naive recompute, the KV cache and the paged
# engine give the same tokens and differ only in speed; notebook 15 promised
# that speculative decoding is lossless. Both promises hide a condition: a
# request's logits must not depend on **who else is in the batch** — how many
# rows a step has, where its prompt was cut into chunks, which slot it sits in,
# whether its token is decoded alone or verified among k + 1 guesses.
#
# They do depend on it unless the arithmetic is arranged so that they cannot.
# Floating-point addition is not associative, and the libraries that multiply
# matrices choose *how* to add from the *shape* of the call. With the weights
# kept packed, the activations are rounded to bfloat16 before every GEMM, so a
# difference in the last bit can move one rounding, grow through 30 layers and
# flip a greedy token whose two best logits nearly tie.
#
# Path: motivation (the same request alone and in a busy engine, invariance off
# and on) -> why (non-associative sums, a library that picks its kernel by the
# shape) -> finding the op (the tracer's row digests name the first op that
# differs) -> the fix (every attention row over fixed 64-key chunks, GEMM rows
# padded to one kernel) -> the cost, measured -> a picture of the divergence
# spreading -> exercises.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): fewer generated tokens and
# timing repeats, and only the invariance-off runs traced. What each section
# shows is the same.

# %%
import os
from contextlib import nullcontext

import matplotlib.pyplot as plt
import torch

from stagewise import LLM, SamplingParams
from stagewise.bench.harness.english_text import TEXT
from stagewise.bench.harness.timing import compare
from stagewise.config import EngineConfig
from stagewise.stages import attention_torch, chunked_attention
from stagewise.trace import Tracer
from stagewise.trace.digests import first_divergence, first_token_divergence

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
MAX_TOKENS = 8 if QUICK else 24

# %% [markdown]
# ## Motivation: one request, alone and in a busy engine
#
# SmolLM2 with its packed GGUF weights (the default), greedy. The same prompt
# — a page of prose and a question about it — runs twice: alone, and in an
# engine busy with three other requests under a 64-token budget per step, so
# that its prompt is prefilled in chunks beside the others' decode steps.
# `SamplingParams(logprobs=k)` returns, for every
# generated token, the log-probabilities of the k most likely tokens — the raw
# float32 log-softmax of that step's logits — so the two runs can be compared
# bit for bit, not only token by token.
#
# First with `batch_invariant=False`: the torch tier's faster paths of the
# past, whose numbers depend on the batch.

# %%
invariant = LLM("smollm2-135m")  # batch_invariant=True is the default
variant = LLM(invariant.loaded, batch_invariant=False)  # the same weights, the batch-variant paths
busy_config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4)
busy = {
    True: LLM(invariant.loaded, engine_config=busy_config),
    False: LLM(invariant.loaded, engine_config=busy_config, batch_invariant=False),
}

PROMPT = TEXT[:1400] + "\n\nIn one sentence: what does Mrs. Bennet want?"  # ~400 tokens with the template
OTHERS = ["Write a haiku about rain.", "List three uses of copper.", "What is 17 times 23?"]
params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=5)


def alone_and_busy(batch_invariant: bool, trace: bool):
    """The prompt alone, then third of four in the busy engine: (alone, busy) outputs and, when
    `trace`, their tracers with row digests (else None)."""
    llm = invariant if batch_invariant else variant
    with Tracer(timing=False, digests=True) if trace else nullcontext() as alone_trace:
        alone = llm.generate([PROMPT], params, chat=True)[0]
    with Tracer(timing=False, digests=True) if trace else nullcontext() as busy_trace:
        outs = busy[batch_invariant].generate(OTHERS[:2] + [PROMPT] + OTHERS[2:], params, chat=True)
    return alone, outs[2], alone_trace, busy_trace


def first_token_apart(a, b) -> int | None:
    """The first generated token where two runs chose differently (None: the same text)."""
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)


runs = {bi: alone_and_busy(bi, trace=not (QUICK and bi)) for bi in (False, True)}  # quick: one traced pair
for bi, (alone, in_batch, _, _) in runs.items():
    steps = (alone.logprobs.values - in_batch.logprobs.values).abs().amax(dim=1)  # [steps]
    same_tokens = alone.token_ids == in_batch.token_ids
    print(f"batch_invariant={bi}:")
    print(f"  alone: {alone.text!r}")
    print(f"  busy:  {in_batch.text!r}")
    print(f"  tokens identical: {same_tokens}; first token apart: {first_token_apart(alone, in_batch)}")
    print(f"  steps whose logprobs differ: {int((steps > 0).sum())} of {len(steps)}; "
          f"largest |difference| of a logprob: {steps.max().item():.3g}")  # fmt: skip

# %% [markdown]
# With invariance off, the busy run's logits differ from the run alone from
# the first generated token on. A difference in the last bits becomes a
# different greedy token as soon as the two best logits of some step are
# closer than it — with bfloat16 activations such near-ties are common — and
# from that token on the two runs write different text. With invariance on
# (the default), every logprob of every step is the same bits in both runs.

# %% [markdown]
# ## Why: the order of a sum, chosen by the shape of the call
#
# Addition of floating-point numbers rounds after every step, so the order
# matters:

# %%
a, b, c = torch.tensor(0.1), torch.tensor(1e8), torch.tensor(-1e8)  # float32
print(f"(0.1 + 1e8) - 1e8 = {((a + b) + c).item():.8g}")
print(f"0.1 + (1e8 - 1e8) = {(a + (b + c)).item():.8g}")
g = torch.Generator().manual_seed(0)
terms = torch.randn(576, generator=g)  # one dot product's products, say
front_to_back = torch.tensor(0.0)
for t in terms:  # one float32 chain, the way one accumulator adds them
    front_to_back = front_to_back + t
lanes = torch.zeros(16)
for start in range(0, 576, 16):  # 16 accumulators side by side (a vector register), then summed
    lanes = lanes + terms[start : start + 16]
in_lanes = torch.tensor(0.0)
for lane in lanes:
    in_lanes = in_lanes + lane
print(f"576 terms, one chain vs 16 lanes: {front_to_back.item():.9g} vs {in_lanes.item():.9g}")

# %% [markdown]
# A matrix product `x @ w` is many such sums (one dot product per output), and
# the CPU's BLAS library picks a kernel — and with it an order of the terms —
# from the shape. Here is one row `x[0]`, multiplied inside calls of M rows:

# %%
K, N = 576, 64
w = torch.randn(N, K, generator=g).t()  # [K, N], stored like the model's weights
probe = torch.randn(K, generator=g)
results = {}
for m in (1, 2, 3, 4, 5, 8, 16, 64):
    x = torch.randn(m, K, generator=g)
    x[0] = probe
    results[m] = (x @ w)[0]
first = results[1]
for m, row in results.items():
    print(f"M = {m:3}: the same row, max |diff| to M = 1: {(row - first).abs().max().item():.3g}")
padded = {m: chunked_attention.padded_rows(m) for m in results}
print("rows each call is padded to by the batch-invariant tier:", padded)

# %% [markdown]
# Attention has the same problem along its keys. The textbook multiplies a
# sequence's queries by *all* its keys in one product per call; a row's sums
# then depend on how many query rows the call has (a decode row, a 16-token
# chunk of a prompt, a whole prompt, a verify of k + 1 guesses):

# %%
H, Hkv, d, L = 9, 3, 64, 600
q = torch.randn(L, H, d, generator=g)
k, v = torch.randn(L, Hkv, d, generator=g), torch.randn(L, Hkv, d, generator=g)
p = 500  # one query position, computed as a decode row and inside prefill chunks of other sizes
for name, fn in (("one product", attention_torch.prefill), ("fixed 64-key chunks", chunked_attention.sequence_rows)):
    rows = []
    for start, end in ((p, p + 1), (p - 2, p + 3), (496, 512), (448, 512), (0, L)):  # chunks around p
        rows.append(fn(q[start:end], k[:end], v[:end], d**-0.5)[p - start])
    distinct = len({tuple(r.flatten().tolist()) for r in rows})
    print(f"{name:20}: position {p} in calls of 1, 5, 16, 64 and {L} rows -> {distinct} distinct result(s)")

# %% [markdown]
# ## Finding the op: row digests
#
# The runs above were traced with `Tracer(digests=True)`: for every request,
# the tracer kept an 8-byte hash of each of its rows of every stage's output,
# keyed by (layer, stage, output, position) — keys that do not depend on the
# batch or the chunking. Comparing the keys of the two runs names the first op
# whose output differed while all of its inputs were equal; every later
# difference follows from it.

# %%
for bi, (alone, in_batch, alone_trace, busy_trace) in runs.items():
    if alone_trace is None:  # quick mode traces the invariance-off pair only
        same = torch.equal(alone.logprobs.values, in_batch.logprobs.values)
        print(f"batch_invariant={bi}: not traced in quick mode; every logprob the same bits: {same}")
        continue
    div = first_divergence(alone_trace, alone.request_id, busy_trace, in_batch.request_id)
    first_logits = first_token_divergence(alone_trace, alone.request_id, busy_trace, in_batch.request_id)
    print(f"batch_invariant={bi}: first op that differs: {div.describe() if div else 'none'}")
    if first_logits is not None:
        print(f"  first LM-head row that differs: after position {first_logits} "
              f"(prompt: {len(alone.prompt_token_ids)} tokens)")  # fmt: skip

# %% [markdown]
# With invariance off the op named is attention, inside the prompt: the busy
# run prefilled the prompt in chunks, and each chunk's query rows met their
# keys in one product of another shape than the whole prompt's (its rows up
# to the end of the chunk, not of the prompt). Nothing before it differs —
# the embedding, the norms and the int4 GEMMs give a row the same bits
# whatever the batch (PyTorch's CPU int4 kernel computes each output as one
# chain over K).

# %% [markdown]
# ## The fix: one arithmetic for every row
#
# The torch tier (the default) follows one rule for every op: a row is reduced
# in the same order whatever the number of rows in its call.
#
# - **Attention** (`stages/chunked_attention.py`): every query row — decode,
#   prefill, chunk, verify — over the same fixed 64-key chunks at absolute
#   positions 0, 64, 128, ..., each chunk's partial sums added in chunk order.
#   A chunk past a row's last key adds exact zeros, so a longer neighbour or
#   a later row changes nothing. This is flash decoding's split-KV with a
#   fixed split *size* instead of a fixed *count* (a count chosen from the
#   batch is the classic way to lose invariance on a GPU).
# - **GEMMs**: the rows of every call padded to a multiple of 4, the BLAS's
#   many-row kernel, where every output is the same chain of K terms for any
#   M (`tuning/gemm_forms.py`); the int4 kernel needs nothing.
# - **Norms, RoPE, softmax, sampling**: one row at a time already; sampling
#   draws from a per-request random stream.
#
# The check, on the same position as above, decoded alone and as the last
# row of a prefill of its prefix:

# %%
S = chunked_attention.padded_length(p + 1)  # keys padded to whole 64-key chunks
kp = torch.nn.functional.pad(k[: p + 1], (0, 0, 0, 0, 0, S - p - 1)).unsqueeze(0)
vp = torch.nn.functional.pad(v[: p + 1], (0, 0, 0, 0, 0, S - p - 1)).unsqueeze(0)
decoded = chunked_attention.decode_rows(q[p : p + 1], kp, vp, torch.tensor([p + 1]), d**-0.5)[0]
prefilled = chunked_attention.sequence_rows(q[: p + 1], k[: p + 1], v[: p + 1], d**-0.5)[p]
textbook = attention_torch.prefill(q[: p + 1], k[: p + 1], v[: p + 1], d**-0.5)[p]
print("decode row == prefill row, bit for bit:", torch.equal(decoded, prefilled))
print(f"and within float32 rounding of the textbook: max |diff| {(decoded - textbook).abs().max().item():.3g}")

# %% [markdown]
# ## Measure: what it costs
#
# The chunked form does the same multiplications as the textbook's one
# product, plus a pass per chunk for the partial sums and their prefix sum;
# the padded GEMM rows cost arithmetic that a decode step, bound by streaming
# the weights, mostly hides. Attention for one prompt of SmolLM2's heads, the
# two forms alternated (medians; `benchmarks/README.md` has the engine-level
# costs of decode, time to first token, batching and speculation):

# %% tags=["timing"]
lengths = [64, 256] if QUICK else [64, 256, 1024]
cost = {}
for T in lengths:
    qt = torch.randn(T, H, d, generator=g)
    kt, vt = torch.randn(T, Hkv, d, generator=g), torch.randn(T, Hkv, d, generator=g)
    t = compare(
        {
            "one product": lambda qt=qt, kt=kt, vt=vt: attention_torch.prefill(qt, kt, vt, d**-0.5),
            "64-key chunks": lambda qt=qt, kt=kt, vt=vt: chunked_attention.sequence_rows(qt, kt, vt, d**-0.5),
        },
        repeats=3 if QUICK else 7,
        warmup=1,
    )
    cost[T] = (t["one product"].median_ms, t["64-key chunks"].median_ms)
    print(f"prompt of {T:5} tokens: one product {cost[T][0]:7.2f} ms, chunks {cost[T][1]:7.2f} ms "
          f"({cost[T][1] / cost[T][0]:.2f}x)")  # fmt: skip

# %% [markdown]
# ## Picture: where the two runs part, and how it spreads
#
# Each row of the left panel is one op of the forward pass (layer by layer,
# stage by stage), each column one position of the request; a dark cell is a
# row whose bits differ between the run alone and the busy run, invariance
# off. The first dark cell is the op named above; from there the difference
# reaches every later layer of that position, and, through attention, every
# later position. The right panel is the largest logprob difference per
# generated token, invariance off and on (on: zero at every step, drawn on
# the floor of the log scale).

# %%
alone, in_batch, alone_trace, busy_trace = runs[False]
da = alone_trace.row_digests[alone.request_id]
db = busy_trace.row_digests[in_batch.request_id]
ops = sorted(alone_trace.op_order, key=alone_trace.op_order.get)
positions = sorted({key[4] for key in da})
grid = torch.zeros(len(ops), len(positions))
op_index = {op: i for i, op in enumerate(ops)}
pos_index = {pos: j for j, pos in enumerate(positions)}
for key, digest in da.items():
    other = db.get(key)
    if other is not None and other != digest:
        grid[op_index[key[:3]], pos_index[key[4]]] = 1.0

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
left.imshow(grid, aspect="auto", cmap="Greys", interpolation="nearest")
left.set_xlabel("position in the request (prompt, then generated tokens)")
left.set_ylabel("op (embedding, then layer by layer, then the LM head)")
left.axvline(len(alone.prompt_token_ids) - 0.5, color="tab:red", lw=1, label="end of the prompt")
left.legend(loc="lower right")
left.set_title("rows that differ, invariance off")
floor = 1e-9
for bi, style in ((False, "o-"), (True, "s--")):
    a_run, b_run = runs[bi][0], runs[bi][1]
    steps = (a_run.logprobs.values - b_run.logprobs.values).abs().amax(dim=1).clamp(min=floor)
    right.semilogy(range(len(steps)), steps.tolist(), style, label=f"batch_invariant={bi}")
right.set_xlabel("generated token")
right.set_ylabel("max |logprob alone - logprob busy|")
right.set_title("logits, alone vs busy")
right.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## In vLLM
#
# `VLLM_BATCH_INVARIANT=1` switches vLLM to its batch-invariant mode
# (`vllm/model_executor/layers/batch_invariant.py`, after Thinking Machines'
# `batch_invariant_ops`): a persistent Triton matmul with one tile
# configuration for every M in place of cuBLAS's shape-chosen kernels,
# log-softmax and means computed one row per program, and attention backends
# whose split-KV uses a fixed split size. Its test suite
# (`tests/v1/generation/test_batch_invariance.py`) compares a prompt's
# logprobs alone and inside batches of random prompts, as
# `tests/engine/test_batch_invariance.py` does here. In vLLM the mode is
# opt-in; here it is the default.

# %% [markdown]
# ## Takeaways
#
# - A request's logits depend on its batch unless every op reduces a row in
#   the same order whatever the call: the number of rows, the chunking of the
#   prompt, the slot, the mode.
# - The culprits are reductions whose order a library picks from the shape:
#   GEMM kernels chosen by M, attention in one product per call, split-KV with
#   a split *count* chosen from the batch.
# - The rule that fixes them: one arithmetic for every M — fixed-size key
#   chunks in a fixed order, padded rows, per-row norms, per-request random
#   streams — and a sweep per op (M = 1 .. 2048, any slot, 1 and 2 threads) to
#   prove it (`tests/stages/test_batch_invariance_ops.py`).
# - `LLM(batch_invariant=False)` (CLI `--no-batch-invariant`) keeps the faster
#   batch-variant paths; the tests use it as their negative control.
# - Out of scope: results across tiers, dtypes or tensor-parallel degrees, and
#   the textbook `naive` tier, which stays the formula a reader checks.
#
# ## Exercises
#
# A GPU decode kernel splits a long row's keys across programs and merges
# their partial results (flash decoding). Make that op batch-invariant.
#
# 1. Write `my_key_splits(num_keys, num_programs)`: the (start, end) key
#    ranges the splits reduce. A kernel would like `num_programs` shares (the
#    batch decides how many programs are idle); the answer must not depend on
#    it, and a row's splits must start at the same absolute positions whatever
#    its length.

# %%
from stagewise.exercises import check  # noqa: E402


def my_key_splits(num_keys: int, num_programs: int) -> list[tuple[int, int]]:
    raise NotImplementedError


check("17.key_splits", my_key_splits)

# %% [markdown]
# 2. Write `my_combine_splits(parts)`: merge the splits' partial states, each
#    `(m, l, acc)` = (the split's max score, its sum of exp(score - m), its
#    exp-weighted sum of values), in split order, into softmax(scores) @ values.
#    A batch pads a row to its longest neighbour's length: empty splits
#    `(-inf, 0, zeros)` follow the real ones, and they must change no bit of
#    the result.

# %%
def my_combine_splits(parts: list[tuple]) -> torch.Tensor:
    raise NotImplementedError


check("17.combine_splits", my_combine_splits)

# %% [markdown]
# The tests that cover this notebook's rule, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/stages/test_batch_invariance_ops.py tests/engine/test_batch_invariance.py
#     .venv/bin/python -m pytest -q tests/exercises -k 17
