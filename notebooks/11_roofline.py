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
# # 11 · Prefill vs decode, and the roofline
#
# The seeds' chapter 8 names the core asymmetry of LLM inference:
#
# | | prefill | decode (one step) |
# |---|---|---|
# | input | N prompt tokens at once | 1 token per sequence |
# | matmuls | GEMM `[N, d] @ [d, d']` | GEMV `[1, d] @ [d, d']` |
# | memory traffic | read the weights once, write N tokens of K/V | read the weights once, read the whole KV cache |
# | bound by | compute (FLOP/s) | memory bandwidth (bytes/s) |
#
# The tool that decides "compute-bound or memory-bound" is the **roofline**.
# A step that does F FLOPs and moves B bytes takes at least
#
#     time >= max(F / peak_FLOPs,  B / bandwidth)
#
# Its **arithmetic intensity** `I = F / B` (FLOP per byte) is compared with the
# machine's **ridge point** `peak / bandwidth`. Below the ridge the step
# waits for memory; above it, for arithmetic. An H100's ridge is a few hundred
# FLOP/B; a prefill of 100k tokens on Llama 3 405B sits far above it, one
# decode step far below (the first cell prints all three).
#
# This notebook uses the calculator `stagewise.calc.roofline` (the same numbers
# as the `stagewise calc` command): motivation -> the calculator -> the seeds'
# worked numbers recomputed (check) -> intensity of prefill and decode ->
# the roofline for an H100 and for *this* machine, with points measured on the
# real model (measure) -> KV memory of MHA vs GQA (picture).
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the machine probe runs for
# 2.5 s instead of 4 s, and the measured SmolLM2 points use a 128-token
# prompt and 6 decode steps instead of 512 tokens and 12 steps.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import contextlib
import io
import os
import statistics
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt

from stagewise import LLM, SamplingParams, viz
from stagewise.bench.harness.timing import stream_timed
from stagewise.bench.harness.workloads import single_prompt
from stagewise.calc.hardware import HARDWARE, probe_this_machine
from stagewise.calc.plots import RooflinePoint, plot_kv_memory, plot_roofline, points_from_steps
from stagewise.calc.roofline import analyze, seeds_table
from stagewise.calc.units import human, seconds, si
from stagewise.config import PRESETS
from stagewise.models.prepare import CALIBRATE_BYTES
from stagewise.models.registry import load_model
from stagewise.tuning.gemm_forms import BUCKET_M, CPU_FORMS

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
FIGURES_DIR = tempfile.TemporaryDirectory(prefix="stagewise_nb11_")  # calc.plots also writes PNGs: not into the repo
FIGURES = Path(FIGURES_DIR.name)
h100 = HARDWARE["h100"]

# %% [markdown]
# ## 1. The calculator
#
# `analyze(model, hardware, context=N, batch=B, dtype)` returns every number
# at once; each one is a `Quantity` with its value, unit and the formula with
# the numbers plugged in. Llama 3 405B (the shape-only preset) on one H100,
# N = 100k, B = 1, as in the seeds:

# %%
print(f"H100: {si(h100.peak_flops('bf16'), 'FLOP/s')} bf16, {si(h100.memory_bandwidth, 'B/s')} "
      f"-> ridge {h100.ridge_point('bf16'):.0f} FLOP/B")
a = analyze(PRESETS["llama-3-405b"], h100, context=100_000, batch=1, dtype="bf16")
for name, q in (
    ("parameters", a.parameters),
    ("weights in memory", a.weight_bytes),
    ("KV per token (GQA, 8 KV heads)", a.kv_per_token),
    ("KV of one 100k sequence", a.kv_at_n),
):
    print(f"{name:>32}: {human(q):>28}   {q.formula}")
print()
print(f"{'step':>10} {'FLOPs':>12} {'bytes':>10} {'FLOP/B':>10} {'ridge':>6} {'speed of light':>15}  bound")
for step in (a.prefill, a.decode, a.naive):
    print(
        f"{step.name:>10} {si(step.flops.value, 'FLOP'):>12} {si(step.bytes.value, 'B'):>10} "
        f"{step.intensity.value:>10,.4g} {step.ridge.value:>6.0f} {seconds(step.time.value):>15}  {step.bound}"
    )
print(f"\nthe weights alone: {si(a.weight_bytes.value, 'B')} = "
      f"{a.weight_bytes.value / h100.memory_bytes:.1f} H100s' memory")

# %% [markdown]
# (The weights alone fill several H100s, as printed; the calculator still
# gives the per-step physics, which is the same on one ideal device or eight
# real ones. `HARDWARE["h100"].scaled(8)` models eight as one.)
#
# ## 2. Check: the seeds' numbers, recomputed
#
# `seeds_table()` recomputes every worked number of chapters 5-8 under the
# seeds' own assumptions (d = 16384, L = 126, P = 405e9, fp16, a 1 PFLOP/s /
# 3.3 TB/s H100) and, next to it, the exact value for the real architecture
# (GQA with 8 KV heads, SwiGLU with inter = 53248, causal attention).

# %%
rows = seeds_table()
print(f"{'ch':<5} {'quantity':<50} {'unit':>6} {'seeds':>10} {'ours':>10} {'diff':>7} {'exact':>10}")
for r in rows:
    exact = "same" if r["exact"] is None else f"{r['exact']:,.4g}"
    print(
        f"{r['chapter']:<5} {r['quantity'][:50]:<50} {r['unit']:>6} {r['seed']:>10,.4g} {r['ours']:>10,.4g} "
        f"{r['rel_diff']:>+7.2%} {exact:>10}"
    )
assert all(abs(r["rel_diff"]) <= r["tolerance"] for r in rows), "a seeds' number is not reproduced"
print(f"\nall {len(rows)} numbers reproduced within the seeds' rounding")

# %% [markdown]
# Where "exact" differs, the table's notes say why; the main ones:

# %%
for r in rows:
    if r["exact"] is not None and abs(r["exact"] - r["ours"]) > 0.05 * abs(r["ours"]):
        print(f"- {r['quantity']}: {r['note']}")

# %% [markdown]
# ## 3. Arithmetic intensity: why prefill and decode live on different sides
#
# * **Prefill**: the weights are read once and used by all N tokens, so the
#   FLOPs grow with N while the bytes barely do: intensity ~ N.
# * **Decode**: the weights are read once and used by the B sequences of the
#   batch — intensity ~ B. But each sequence also reads its *own* KV cache
#   (attention cannot be shared across requests, the seeds' point 9), so at
#   long contexts adding sequences adds bytes as fast as FLOPs, and the
#   intensity stops growing however large the batch.
#
# Llama 3 8B on an H100 in bf16:

# %%
llama8b = PRESETS["llama-3-8b"]
prefill_n = [2**i for i in range(4, 18)]  # 16 .. 128k tokens
prefill_i = [analyze(llama8b, h100, context=n, dtype="bf16").prefill.intensity.value for n in prefill_n]
batches = [2**i for i in range(0, 11)]  # 1 .. 1024 sequences
decode_i = {
    n: [analyze(llama8b, h100, context=n, batch=b, dtype="bf16").decode.intensity.value for b in batches]
    for n in (1_000, 8_000, 32_000)
}
ridge = h100.ridge_point("bf16")

ridge_line = (ridge, f"H100 ridge {ridge:.0f} FLOP/B")
prefill_panel = {
    "title": "prefill: intensity grows with the prompt",
    "xlabel": "prompt length N (tokens)",
    "ylabel": "arithmetic intensity (FLOP/B)",
    "curves": [(prefill_n, prefill_i, "o-", "tab:purple", "prefill of N tokens (B=1)")],
    "hline": ridge_line,
}
decode_panel = {
    "title": "decode: intensity ~ B, capped by each sequence's own KV reads",
    "xlabel": "batch B (sequences decoding together)",
    "ylabel": "arithmetic intensity (FLOP/B)",
    "curves": [(batches, ys, "o-", None, f"decode at N={n:,}") for n, ys in decode_i.items()],
    "hline": ridge_line,
}
viz.loglog_panels([prefill_panel, decode_panel], width=7)
plt.show()

# %% [markdown]
# The left curve crosses the ridge after a few hundred tokens: any realistic
# prompt is compute-bound. On the right, batching is what pulls decode up
# toward the ridge (continuous batching exists to keep B large, notebook 10),
# but at 32k tokens of context the KV reads dominate and even B = 1024 stays
# far below the ridge: long-context decode is memory-bound, full stop.
#
# ## 4. The roofline of an H100
#
# `plot_roofline` draws `min(peak, I x bandwidth)` on log-log axes and places
# each step at its intensity, on the roof (the speed of light). Points for
# Llama 3 8B and 405B: a 100k-token prefill, a decode step at 100k context
# with B = 1, and a decode step of a batch of 64 at 1k context.

# %%
points = []
for preset, tag in (("llama-3-405b", "405B"), ("llama-3-8b", "8B")):
    cfg = PRESETS[preset]
    long_ctx = analyze(cfg, h100, context=100_000, batch=1, dtype="bf16")
    batched = analyze(cfg, h100, context=1_000, batch=64, dtype="bf16")
    points += points_from_steps([long_ctx.prefill, long_ctx.decode], f" {tag} N=100k")
    points += points_from_steps([batched.decode], f" {tag} N=1k B=64")
fig = plot_roofline(h100, points, FIGURES / "roofline_h100.png", dtype="bf16")
fig  # noqa: B018 (a Figure as the last expression of a cell is shown inline)

# %% [markdown]
# Prefill points sit on the flat roof (compute-bound: their time is FLOPs /
# peak), decode points on the slope (memory-bound: their time is bytes /
# bandwidth). Batching 64 sequences moves the decode point to the right, up
# the slope; it does not change the roof.
#
# ## 5. This machine
#
# `probe_this_machine` measures this computer with torch: the bandwidth of a
# GEMV over a matrix several times larger than the last-level cache (exactly
# what a decode step does to the weights; the size is in the printed notes)
# and the FLOP/s of square GEMMs (what a prefill does). It is a short
# measurement: rerun it if the numbers look off — a peak below what the model
# achieves in the next cell is a sure sign.

# %% tags=["timing"]
here = probe_this_machine(seconds=2.5 if QUICK else 4.0, device="cpu")  # on a GPU box, device="cuda" probes the GPU
print(here.notes)
for dt in ("fp32", "bf16"):
    print(f"{dt}: peak {si(here.peak_flops(dt), 'FLOP/s')}, ridge {here.ridge_point(dt):.1f} FLOP/B")
print(f"bandwidth {si(here.memory_bandwidth, 'B/s')}  (H100: {si(h100.memory_bandwidth, 'B/s')}, "
      f"{h100.memory_bandwidth / here.memory_bandwidth:.0f}x more)")

# %% [markdown]
# ### Measured points: SmolLM2 on this CPU
#
# Now run the real model (float32) and turn its times into achieved FLOP/s:
# the prefill of an N-token prompt (its time to first token, best of 3 runs)
# and the decode steps right after it (time between tokens, median). FLOPs come from the calculator
# for the same N; a point's height is FLOPs / measured seconds, its x is the
# step's intensity. The distance below the roof is what the implementation
# leaves on the table.

# %% tags=["timing"]
loaded = load_model("smollm2-135m", device="cpu")  # float32, on the CPU this probe measured
smol = loaded.config
with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once (printed below)
    llm = LLM(loaded, mode="kv")
n_prompt = 128 if QUICK else 512
n_out = 6 if QUICK else 12
prompt = single_prompt(loaded.tokenizer, n_prompt, seed=0)
params = SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True)
stream_timed(llm, [single_prompt(loaded.tokenizer, 16)], [params])  # warm-up
runs = [stream_timed(llm, [prompt], [params])[0].metrics() for _ in range(3)]
ttft = min(m.ttft for m in runs)  # best of 3 prefills: other jobs on the machine only ever add time
tbt = statistics.median(g for m in runs for g in m.tbt)  # median decode step

mid = n_prompt + n_out // 2  # the context of a typical decode step
sol_prefill = analyze(smol, here, context=n_prompt, dtype="fp32").prefill
sol_decode = analyze(smol, here, context=mid, dtype="fp32").decode
measured = [
    RooflinePoint(f"prefill N={n_prompt}, measured", sol_prefill.intensity.value, sol_prefill.flops.value / ttft),
    RooflinePoint(f"decode N={mid}, measured", sol_decode.intensity.value, sol_decode.flops.value / tbt),
]
speed_of_light = points_from_steps([sol_prefill, sol_decode], " (speed of light)")
for p, step, t in zip(measured, (sol_prefill, sol_decode), (ttft, tbt)):
    print(f"{p.label:>28}: {t * 1000:7.1f} ms, speed of light {step.time.value * 1000:6.1f} ms "
          f"-> {100 * step.time.value / t:5.1f}% of the roofline ({step.bound})")
decode_bw = sol_decode.bytes.value / tbt
print(f"ridge here (fp32) {here.ridge_point('fp32'):.1f} FLOP/B vs H100 (bf16) {h100.ridge_point('bf16'):.0f}; "
      f"decode intensity {sol_decode.intensity.value:.2f}, prefill {sol_prefill.intensity.value:.0f} FLOP/B; "
      f"one decode step moves {si(sol_decode.bytes.value, 'B')}")
print(f"decode streams {si(decode_bw, 'B/s')} of weights + KV = {100 * decode_bw / here.memory_bandwidth:.0f}% "
      "of the probed GEMV bandwidth")
for p in measured:
    roof = min(here.peak_flops("fp32"), p.intensity * here.memory_bandwidth)
    if p.flops_per_s > roof:
        print(f"note: '{p.label}' runs above the probed roof ({si(p.flops_per_s, 'FLOP/s')} > {si(roof, 'FLOP/s')}): "
              "the short probe underestimated this machine, not the model beating physics")

# %%
fig = plot_roofline(
    here, speed_of_light + measured, FIGURES / "roofline_here.png", dtype="fp32",
    title=f"Roofline of this machine, fp32 ({here.notes.split(':')[0]}) — SmolLM2-135M",
)
fig  # noqa: B018 (a Figure as the last expression of a cell is shown inline)

# %% [markdown]
# Where this machine sits: a CPU's ridge is far lower than an H100's (little
# bandwidth, but also little compute; both printed above). SmolLM2's decode
# step is below even that low ridge (memory-bound: it must stream all its
# float32 weights per token), and its prefill is above it (compute-bound). A
# measured point below the roof shows what the implementation leaves on the
# table (framework overhead, imperfect GEMMs, anything else the machine was
# doing meanwhile). A measured point *above* the roof means the
# roof is wrong: the probe's short GEMMs underestimated the machine's peak
# (its CPU GEMMs are small and briefly timed), while the model's prefill
# runs larger, longer matmuls. Measuring the machine is a
# measurement too, with its own error bars.
#
# ### Eight decode rows for the price of one?
#
# On the slope a decode step's time is its bytes over the bandwidth, and
# the bytes are the weights. Eight sequences decoding together read the same
# weights as one, so the roofline says eight rows should cost about what one
# row costs. Whether they do depends on how the BLAS library is asked for
# the product. When `LLM` loaded the model above with the default tier,
# `backend="torch"`, it timed three ways of asking for the same `x @ w` on
# these very weights, at a few row counts M, and kept the fastest for each
# (`stagewise/tuning/gemm_forms.py`); the projections' torch tier
# (`stagewise/stages/gemm_torch.py`) then asks for that form. Their docstrings
# explain the three forms: the plain call, a transposed tall-skinny product,
# and one batched call over 64-column blocks of the weight.

# %%
stream_ms = 1e3 * llm.model.weights.decode_bytes() / here.memory_bandwidth  # the slope's time for these weights
print(f"reading the projection weights once at the probed bandwidth: {stream_ms:.1f} ms")
if not CPU_FORMS.measured_ms:
    print(f"(no calibration in this process: it runs for a CPU model whose projection weights are "
          f"{CALIBRATE_BYTES / 2**20:.0f} MiB or more, with torch-tier projections)")
for bucket, times in CPU_FORMS.measured_ms.items():
    forms = ", ".join(f"{form} {ms:.1f} ms ({ms / stream_ms:.1f}x)" for form, ms in times.items())
    print(f"M = {BUCKET_M[bucket]:2d} rows: {forms}  -> uses {CPU_FORMS.chosen[bucket]}")
if {"decode", "small batch"} <= set(CPU_FORMS.measured_ms):
    one, eight = CPU_FORMS.measured_ms["decode"], CPU_FORMS.measured_ms["small batch"]
    print(f"8 rows cost {eight['plain'] / one['plain']:.1f}x one row with the plain call, "
          f"{min(eight.values()) / min(one.values()):.1f}x with the fastest form")

# %% [markdown]
# Read the printed ratios against the slope. At M = 1 the best form should
# sit close to 1x the streaming time: one row is pure weight streaming. At
# M = 8 the FLOPs are eight times larger but still far below this machine's
# ridge, so any cost beyond the single row's is the library, not physics.
# A BLAS that first copies ("packs") each weight panel into a buffer and
# then multiplies reads the bytes twice. Same FLOPs, same bytes, a different
# number of passes over memory: that is why a serving engine measures its
# matmuls on the machine in front of it instead of trusting one formulation
# everywhere.
#
# ## 6. The KV cache's memory: MHA vs GQA
#
# Chapter 6's "TB-scale arithmetic": with full multi-head attention (as many
# KV heads as query heads) Llama 3 405B would need megabytes of KV per token
# and terabytes for a million tokens. Its real GQA (128 query heads sharing 8
# KV heads) divides that by `H / Hkv` (the cell prints both). `plot_kv_memory` draws KV bytes
# per sequence against the context length, MHA dashed and GQA solid, under an
# H100's memory and what the weights leave of it (dotted).

# %%
big = analyze(PRESETS["llama-3-405b"], h100, context=1_000_000, dtype="bf16")
print(f"Llama 3 405B, 1M tokens: MHA {si(big.kv_per_token_mha.value, 'B')}/token, {si(big.kv_at_n_mha.value, 'B')}; "
      f"GQA {si(big.kv_per_token.value, 'B')}/token, {si(big.kv_at_n.value, 'B')} "
      f"({big.kv_per_token_mha.value / big.kv_per_token.value:.0f}x less)")
contexts = [int(1000 * 1000 ** (i / 30)) for i in range(31)]  # 1k .. 1M tokens
configs = [PRESETS["llama-3-8b"], PRESETS["llama-3-70b"], PRESETS["llama-3-405b"]]
fig = plot_kv_memory(configs, contexts, FIGURES / "kv_memory.png", dtype_bytes=2, hardware=h100)
fig  # noqa: B018 (a Figure as the last expression of a cell is shown inline)

# %% [markdown]
# And what that means for serving: the largest batch of N-token sequences
# whose KV cache fits next to the weights (`analysis.capacity`), for Llama 3 8B
# on one H100 in bf16:

# %%
print(f"{'N':>8} {'KV/seq GQA':>12} {'max batch GQA':>14} {'KV/seq MHA':>12} {'max batch MHA':>14} {'batch ratio':>12}")
for n in (1_000, 8_000, 32_000, 128_000):
    cap = analyze(llama8b, h100, context=n, dtype="bf16").capacity
    gqa, mha = int(cap.max_batch.value), int(cap.max_batch_mha.value)
    ratio = f"{gqa / mha:.2f}x" if mha else "MHA: none"
    print(f"{n:>8,} {si(cap.kv_per_sequence.value, 'B'):>12} {gqa:>14,} "
          f"{si(cap.kv_per_sequence_mha.value, 'B'):>12} {mha:>14,} {ratio:>12}")
print(f"KV per sequence, MHA / GQA: {cap.kv_per_sequence_mha.value / cap.kv_per_sequence.value:.0f}x = H / Hkv "
      f"= {llama8b.num_heads} / {llama8b.num_kv_heads}")
for b in (1, 32):
    step = analyze(llama8b, h100, context=8_000, batch=b, dtype="bf16").decode
    print(f"decode step at N=8k, B={b:>2}: moves {si(step.bytes.value, 'B')} ({step.bytes.formula.split(' = ')[0]})")

# %% [markdown]
# GQA makes every sequence's KV cache `H / Hkv` times smaller (the two KV/seq
# columns). The batch that fits is a whole number of sequences, so it grows by
# about that factor only while many sequences fit; at long contexts the ratio
# column departs from it, and where MHA fits no sequence at all GQA still
# fits a few. A larger batch is exactly what moves decode up the roofline.
# At 128k tokens even GQA fits only a handful of sequences: the
# KV cache, not the weights, becomes the memory that matters (the seeds:
# "when the KV cache approaches the size of the weights, a larger batch no
# longer raises throughput").
#
# ## In vLLM (v0.11.0)
#
# vLLM has no roofline calculator: it measures. `vllm bench latency`
# (`vllm/benchmarks/latency.py`) times prefill and decode of a fixed batch, and
# `vllm bench throughput` (`vllm/benchmarks/throughput.py`) a whole workload; the
# knobs that move a step along the roofline are the scheduler's
# `max_num_batched_tokens` and `max_num_seqs` (`SchedulerConfig` in `vllm/config/scheduler.py`).
#
# ## Takeaways
#
# * Intensity = FLOPs / bytes. Ridge = peak / bandwidth (a few hundred FLOP/B
#   for an H100 in bf16, far less for a CPU). Below the ridge memory decides,
#   above it compute.
# * Prefill: intensity ~ N, compute-bound for any real prompt. Decode:
#   intensity ~ B, capped by each sequence's KV reads; memory-bound.
# * The calculator reproduces every worked number of the seeds (section 2) and
#   shows where the real architecture differs (GQA, SwiGLU, causal attention).
# * GQA shrinks the KV cache by H / Hkv, which is batch size, which is
#   decode throughput.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb11.py`.
#
# **1. The speed of light.** A step does `flops` FLOPs and moves `bytes_moved`
# bytes on a machine with `peak_flops` FLOP/s and `bandwidth` B/s. How long
# does it take at least? (The check tries compute-bound and memory-bound
# steps on every machine in `HARDWARE`.)

# %%
from stagewise.exercises import check  # noqa: E402


def my_roofline_time(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> float:
    raise NotImplementedError


# %%
check("11.roofline_time", my_roofline_time)

# %% [markdown]
# **2. Why batching helps decode.** A decode step of `batch` sequences does
# `flops_per_seq` FLOPs per sequence, reads the weights (`weight_bytes`) once
# for the whole batch, and reads/writes `kv_bytes_per_seq` of KV per sequence.
# Return its intensity (FLOP/B). Then evaluate it for Llama 3 8B at 1k and 32k
# tokens for B = 1 .. 1024 and find where each curve flattens.


# %%
def my_decode_intensity(batch: int, flops_per_seq: float, weight_bytes: float, kv_bytes_per_seq: float) -> float:
    raise NotImplementedError


# %%
check("11.decode_intensity", my_decode_intensity)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/calc
#     .venv/bin/python -m pytest -q tests/exercises -k 11
