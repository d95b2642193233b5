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
# # 14 · Quantized weights: fewer bytes per weight, a faster decode
#
# Notebook 11 put a decode step on the roofline: about 2 FLOPs per weight
# against a ridge point of hundreds, so a step takes the time to **stream the
# weights from memory**. The lever is then not arithmetic but bytes: store each
# weight in 4 bits instead of 32 and the floor drops almost 8x.
#
# That is what a GGUF file does. SmolLM2's file keeps its projections as
# **Q4_1** (blocks of 32 four-bit codes with a scale and a minimum) and its
# embedding, which is also the LM head, as **Q8_0**. stagewise can keep them so
# for the life of the model (`LLM(..., quantization="auto")`) instead of
# expanding them to float32 at load.
#
# Path: bytes per weight -> the decode floor, computed by the calculator -> one
# Q4_1 block of the real file, bit by bit -> dequantize it by hand -> the
# dequantize-GEMM stage in its three tiers, measured -> what the faster tiers'
# rounding costs, down to the perplexity of a text -> exercises.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): fewer repeats, a shorter text
# for the perplexity, a narrower slice of the matrix for the Triton
# interpreter. What each section shows is the same.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import os
import statistics
import time

import gguf
import matplotlib.pyplot as plt
import numpy as np
import torch

from stagewise.bench.commands.perplexity import perplexity
from stagewise.bench.harness.english_text import SOURCE, TEXT
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.roofline import analyze
from stagewise.calc.weight_formats import FORMATS, get_format, uniform, weight_bytes_of
from stagewise.config import PRESETS
from stagewise.models.files import smollm2_gguf_path
from stagewise.models.gguf_loader import open_gguf
from stagewise.models.registry import load_model
from stagewise.quant.dequantize import dequantize_rows, unpack_codes
from stagewise.stages import dequant_gemm
from stagewise.viz import stages as viz_stages

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(2)  # one setting for every timing below
packed = load_model("smollm2-135m", device="cpu", quantization="auto")  # the file's Q4_1 / Q8_0 kept as they are
cfg = packed.config

# %% [markdown]
# ## 1. Bytes per weight, and the decode floor
#
# A block format stores a group of G consecutive weights (along the input
# axis) as G small integer codes, plus a float16 **scale** d per group (and,
# in the "_1" formats, a float16 **minimum** m). The scales are part of the
# bill: Q4_0 is not 0.5 bytes per weight but (16 + 2) / 32. The calculator
# (`stagewise.calc.weight_formats`) keeps llama.cpp's table:

# %%
for f in FORMATS.values():
    print(
        f"{f.name:>5}: {f.block_bytes:>3} B per {f.group:>3} weights = {f.bytes_per_weight:.4f} B/weight  ({f.layout})"
    )

# %% [markdown]
# A decode step of one sequence reads every matrix once (with a tied
# embedding, the whole table as the LM head). `calc --weights` turns
# that into bytes per token: the file's own tensors (`--weights gguf`) against
# the same model dequantized to float32, which is what a token streams when
# the weights are expanded at load. Then the seeds' kind of model, Llama 3 8B,
# in each format on an H100: the speed-of-light time per token.

# %%
h100 = HARDWARE["h100"]
file_bytes = weight_bytes_of(cfg, "gguf", "fp32", "smollm2-135m")
smol_file = analyze(cfg, h100, context=1, dtype="fp32", weights=file_bytes).decode
smol_f32 = analyze(cfg, h100, context=1, dtype="fp32").decode
print(f"SmolLM2, one decode token: {smol_file.bytes.value / 1e6:.1f} MB as the file stores it "
      f"({file_bytes.name}), {smol_f32.bytes.value / 1e6:.1f} MB in float32: "
      f"{smol_f32.bytes.value / smol_file.bytes.value:.2f}x more")  # fmt: skip

big = PRESETS["llama-3-8b"]
names = ["fp32", "bf16", "q8_0", "q6_k", "q4_1", "q4_0"]
floors = {}
for name in names:
    step = analyze(big, h100, context=4096, weights=uniform(big, get_format(name))).decode
    floors[name] = step.time.value * 1e3  # ms per token, batch 1, 4k tokens of bf16 KV
    print(f"Llama 3 8B, {name:>4}: {step.bytes.value / 1e9:6.2f} GB per token -> {floors[name]:.2f} ms "
          f"({step.bound}, intensity {step.intensity.value:.2f} FLOP/B)")  # fmt: skip

print(f"bf16 / q4_0: {floors['bf16'] / floors['q4_0']:.2f}x (16 bits / 4 bits would be 4x)")

viz_stages.bars(
    floors,
    "Llama 3 8B decode on an H100, batch 1, N = 4096: the floor is the bytes",
    colors=["gray", "gray", "tab:blue", "tab:blue", "tab:green", "tab:green"],
    ylabel="ms per token (speed of light)",
)
plt.show()

# %% [markdown]
# Every step is memory-bound in every format, so the floor scales with the
# bytes. A 4-bit format gains less than the 4x that 16 bits / 4 bits suggests
# (the ratio printed above): the scales, the float32 norms and the KV cache
# still have to be read.

# %% [markdown]
# ## 2. One Q4_1 block of the real file, bit by bit
#
# The file's first FFN down projection, `blk.0.ffn_down.weight`, is a
# [576 rows, 1536 inputs] matrix in Q4_1: each row is 1536 / 32 = 48 blocks of
# 20 bytes. A block is
#
#     bytes 0-1   d, float16 (little-endian)   the scale
#     bytes 2-3   m, float16                   the minimum
#     bytes 4-19  16 bytes of codes: byte i holds code i in its low nibble
#                 and code i + 16 in its high nibble
#
# and its 32 weights are `w_j = d * q_j + m`, q_j in 0..15. Below: the raw
# bytes of row 0, block 0, as the file holds them.

# %%
reader = open_gguf(smollm2_gguf_path())
tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
raw = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1)  # [576 rows, 48 * 20 bytes] uint8
block = raw[0, :20]  # row 0, block 0
print(tensor.tensor_type.name, "row bytes", raw.shape[1], "| block:", " ".join(f"{b:02x}" for b in block))
d, m = block[:2].view(np.float16)[0], block[2:4].view(np.float16)[0]
codes = block[4:]
q = np.concatenate([codes & 0x0F, codes >> 4])  # [32]: low nibbles are codes 0..15, high ones 16..31
print(f"d = {d} (bits {int(block[:2].view(np.uint16)[0]):016b}), m = {m}")
print("codes:", q.tolist())

viz_stages.q4_1_code_bytes(codes)  # [16] uint8: two 4-bit codes per byte
plt.show()

# %% [markdown]
# ## 3. Dequantize by hand
#
# `w = d * q + m`, in float32. llama.cpp's reference (`gguf.quants.dequantize`,
# shipped with the `gguf` package) must give the same 32 numbers, and so must
# the block formula the package's naive tier reads (`quant/dequantize.py`), on
# the same block of the loaded model, whose `w_down` is a `PackedWeight` holding
# the file's codes and scales.

# %%
by_hand = np.float32(d) * q.astype(np.float32) + np.float32(m)  # [32]
reference = gguf.quants.dequantize(block[None, :], gguf.GGMLQuantizationType.Q4_1)[0]  # [32]
w_down = packed.weights.layers[0].w_down  # PackedWeight, [K=1536, N=576]
ours = dequantize_rows(w_down, slice(0, 1))[0, :32]  # row 0's first group
print(w_down, "| codes", tuple(w_down.codes.shape), w_down.codes.dtype, "| scales", tuple(w_down.scales.shape))
print("the package's codes of that block:", unpack_codes(w_down)[0, 0].tolist() == q.tolist())
print("by hand == llama.cpp:", np.array_equal(by_hand, reference), "| == stagewise naive:",
      np.array_equal(by_hand, ours.numpy()))  # fmt: skip

viz_stages.block_weights(by_hand, float(m), float(d))
plt.show()

# %% [markdown]
# Sixteen levels, evenly spaced d apart from m to m + 15 d: the quantizer
# picked m and d so that the block's smallest and largest weights land on the
# two ends. Every weight of the block is one of those sixteen numbers.

# %% [markdown]
# ## 4. The dequantize-GEMM in three tiers
#
# `qkv_proj`, `o_proj`, `ffn` and `lm_head` call the dequantize-GEMM
# (`stages/dequant_gemm.py`) in their own tier when their weight is packed:
#
# * **naive**: dequantize every block to float32 (the formula above), then
#   `x @ w`. Exact, and it writes and reads a whole float32 matrix: more bytes
#   than a float32 model, not fewer.
# * **torch**: PyTorch's stock kernel that reads the codes directly
#   (`_weight_int4pack_mm_for_cpu` for 4 bits: scale and zero rounded to
#   bfloat16, bfloat16 activations). With `STAGEWISE_CPU_KERNELS=1` (and a C++
#   compiler) it is a compiled kernel that works llama.cpp's way
#   (`cpu/int8_dot.py`): the activations are rounded to int8 per block of 32
#   too, so each block's dot product is an exact integer sum, done 32 products
#   per instruction; faster, and it moves greedy near-ties more often.
# * **triton**: one kernel that loads a tile of codes and their scales,
#   expands it in registers and multiplies (`kernels/dequant_matmul.py`). On a
#   CPU it runs in Triton's interpreter, so it is checked here on a slice of
#   the matrix, not timed.
#
# One decode row through `w_down` (1536 -> 576), timed against a float32
# matrix of the same numbers.

# %% tags=["timing"]
stage = dequant_gemm.STAGE  # the stage record: naive, torch and triton tiers
x = torch.randn(1, w_down.shape[0], generator=torch.Generator().manual_seed(0))  # [1, K]
w_f32 = dequantize_rows(w_down).t().contiguous()  # [K, N] float32: the same numbers, 4 bytes each


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(sorted(times)[: max(1, repeats // 2)])  # median of the faster half


repeats = 10 if QUICK else 60
exact = x @ w_f32  # [1, N]
tiers = {"float32 x @ w": lambda: x @ w_f32, "naive": lambda: stage.naive(x=x, w=w_down),
         "torch": lambda: stage.torch(x=x, w=w_down)}  # fmt: skip
for fn in tiers.values():
    fn()  # warm-up (the torch tier builds its kernel's form of the codes once)
timings = {name: best_ms(fn, repeats) for name, fn in tiers.items()}
for name, fn in tiers.items():
    err = (fn() - exact).abs().max().item()
    rel = err / exact.abs().max().item()
    print(f"{name:>14}: {timings[name]:7.3f} ms   max |difference| from float32: {err:.3g} ({rel:.2%} of max |y|)")

n_slice = 32 if QUICK else 128
part = w_down.out_features(slice(0, n_slice))  # the first n_slice output features, whole groups
tri = stage.triton(x=x, w=part)
print(f"triton (interpreter, N = {n_slice} of 576): max |difference| {(tri - exact[:, :n_slice]).abs().max():.3g}")
print(f"bytes of this matrix: float32 {w_f32.numel() * 4 / 1e6:.2f} MB, packed {w_down.nbytes / 1e6:.2f} MB")

viz_stages.bars(
    timings,
    "one decode row through w_down, 1536 -> 576",
    colors=["gray", "tab:orange", "tab:green"],
    xlabel="ms per call, log scale (median of the faster half)",
    horizontal=True,
    log=True,
    figsize=(6.5, 3.2),
)
plt.show()

# %% [markdown]
# The naive tier's difference is summation order only (it multiplies the
# same float32 numbers, laid out differently); the torch tier's is its
# rounding of the activations (to bfloat16, or to int8 per block with the
# opt-in compiled kernel). What to conclude from the times: the naive tier pays for
# the expansion on every call. Whether the torch tier beats the float32
# product on one matrix this small depends on the machine: the whole float32
# matrix may sit in its caches, and then streaming bytes is not what limits a
# call, while the per-call overhead of a kernel is. The lever shows at the size
# of a model, where the weights do not fit in any cache: the bytes per token of
# section 1, and the benchmark `python -m stagewise.bench.scripts.weight_formats`,
# which times whole decode steps in both formats.

# %% [markdown]
# ## 5. What the rounding costs
#
# The naive tier reproduces the file's values exactly, so its logits are the
# float32 model's, bit for bit. The torch tier rounds the activations: to
# bfloat16 along with each group's scale and zero (8 bits of mantissa against
# float16's 11; PyTorch's int4 kernel), or, with the opt-in integer-dot kernel
# (`STAGEWISE_CPU_KERNELS=1`), to 8-bit integers per block of 32 (one scale per
# block, as llama.cpp does). Either way its products differ a little,
# and now and then a near tie between two tokens falls the other way. The measure that matters is the
# model's: the **perplexity** of a fixed text, exp of the mean of
# -log p(next token), the same text through both tiers.

# %%
ids = packed.tokenizer.encode(TEXT)[: 96 if QUICK else 512]
ppl = {tier: perplexity(packed, tier, ids) for tier in ("naive", "torch")}
print(f"{len(ids)} tokens of {SOURCE.split(';')[0]}")
for tier, value in ppl.items():
    print(f"  {tier:>5} tier: perplexity {value:.4f}")
print(f"  torch / naive: {ppl['torch'] / ppl['naive'] - 1:+.3%}")

# %% [markdown]
# Rounding the activations moves the perplexity by a fraction of a percent;
# `stagewise bench perplexity` measures the whole text and the greedy
# agreement over several prompts (how many generated tokens equal the float32
# model's before the first difference); `--backends torch,torch-stock` puts
# the two roundings side by side. The 4-bit format itself, the step from
# the original bfloat16 checkpoint to sixteen levels a block, happened when the
# file was made; its cost is not in this comparison (both sides read the same
# 4-bit numbers).

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# * `vllm/model_executor/layers/quantization/gguf.py`, `GGUFLinearMethod.apply`
#   -> `_fused_mul_mat_gguf(x, qweight, qweight_type)`: the GGUF blocks stay
#   packed on the GPU; for a few rows it calls `ops.ggml_mul_mat_vec_a8` (a
#   fused dequantize-GEMV, llama.cpp's MMVQ kernel), for more rows
#   `ops.ggml_mul_mat_a8` (MMQ), and otherwise `ops.ggml_dequantize` followed
#   by a plain `x @ weight.T`: the naive tier, on a GPU.
# * The same file's `GGUFEmbeddingMethod.embedding` gathers the token rows of a
#   packed table and dequantizes only those, like `quant/dequantize.py`'s
#   `gather_rows`. The CUDA kernels live in `csrc/quantization/gguf/`.
#
# ## Takeaways
#
# * Decode streams every weight once per token, so bytes per weight set its
#   floor; a block format's bytes include its scales (Q4_0 0.5625, Q4_1 0.625,
#   Q8_0 1.0625 bytes per weight).
# * A Q4_1 block is 2 bytes of d, 2 of m and 16 of codes, two per byte; its
#   weights are `d * q + m`, sixteen evenly spaced levels.
# * Dequantizing by the textbook formula reproduces llama.cpp's reference bit
#   for bit; it is exact and slow, because it writes a float32 copy.
# * The fast tiers read the codes directly and round differently; the
#   perplexity of a fixed text says what that costs.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The checks compare
# your answer with llama.cpp's own table and reference dequantizer (the `gguf`
# package) and print **PASS**, **FAIL** with the first difference, or **not yet**
# while the stub is untouched. Solutions: `notebooks/solutions/nb14.py`.
#
# **1. Bytes per weight.** A format stores groups of `group_size` weights as
# `bits`-bit codes, plus a float16 scale per group and, when `has_min`, a
# float16 minimum. Return its bytes per weight (the check tries Q4_0, Q4_1,
# Q5_0, Q5_1 and Q8_0).

# %%
from stagewise.exercises import check  # noqa: E402


def my_bytes_per_weight(bits: int, group_size: int, has_min: bool) -> float:
    raise NotImplementedError


# %%
check("14.bytes_per_weight", my_bytes_per_weight)

# %% [markdown]
# **2. Dequantize a Q4_0 block.** A Q4_0 block is 18 bytes: a float16 scale d
# (bytes 0-1, little-endian; `block[:2].view(torch.float16)` reads it), then 16
# bytes of codes in Q4_1's nibble order. There is no minimum: the codes 0..15
# stand for -8..7, so `w_j = d * (q_j - 8)`. `block` is a `[18]` uint8 tensor;
# return the 32 weights as a float32 tensor. Try it on a block of your own:
# `gguf.quants.quantize(np.random.randn(1, 32).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)[0]`.


# %%
def my_dequant_q4_0(block: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("14.dequant_q4_0", my_dequant_q4_0)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/quant/test_packed_weight.py tests/stages/test_dequant_gemm_torch.py
#     .venv/bin/python -m pytest -q tests/calc/test_calc_weights.py tests/bench/test_perplexity.py
#     .venv/bin/python -m pytest -q tests/exercises -k 14
