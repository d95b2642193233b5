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
# # 06 · The FFN: fused gate/up GEMM, `silu_and_mul`, down GEMM
#
# The second half of every transformer block is a SwiGLU feed-forward network:
#
#     x [T, hidden] @ w_gate_up [hidden, 2*inter]  -> gate_up [T, 2*inter]     one wide GEMM
#     silu(gate) * up                               -> h [T, inter]            silu_and_mul
#     h @ w_down [inter, hidden]                    -> out [T, hidden]         down GEMM
#
# SmolLM2: hidden 576, inter 1536, so each token widens to 3072 numbers, is
# gated down to 1536, and projected back to 576. It is where most of a layer's
# weights — and so most of its FLOPs and, in decode, most of its bytes — are.
#
# What the optimized path changes (seeds, step 7):
#
# * **fused gate/up**: W_gate and W_up read the same `x`, so their columns are
#   concatenated into one `[hidden, 2*inter]` weight: one wide GEMM instead of
#   two medium ones;
# * **`silu_and_mul`**: one kernel reads both halves of `gate_up` and writes
#   `silu(gate) * up` — instead of writing `silu(gate)` to memory and reading
#   it back for the multiply.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing uses a smaller prefill batch and fewer repeats. The Triton kernels
# always run on a handful of tokens: without a GPU they run in Triton's CPU
# interpreter, which checks correctness, not speed.
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

from stagewise.bench.harness.timing import compare
from stagewise.calc.counts import attention_flops, linear_flops
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.base import stage_of
from stagewise.stages.ffn import silu_and_mul_naive
from stagewise.viz import stages as viz_stages

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed

loaded = load_model("smollm2-135m")
cfg, weights, tok = loaded.config, loaded.weights, loaded.tokenizer
hidden, inter = cfg.hidden_size, cfg.intermediate_size
ffn = STAGES["ffn"]
print(
    f"hidden {hidden}, inter {inter}: w_gate_up {tuple(weights.layers[0].w_gate_up.shape)}, "
    f"w_down {tuple(weights.layers[0].w_down.shape)}"
)

# %% [markdown]
# ## The input: real FFN inputs
#
# We run the model on a prompt and record the FFN stage's input `x` (the
# normalised residual stream) in layer 10, with a `StageOps` subclass.


# %%
class RecordFFN(StageOps):
    """Naive stages; keeps the ffn stage's input x in one layer."""

    def __init__(self, layer: int):
        super().__init__("naive")
        self.layer, self.x = layer, None

    def __call__(self, stage, layer=None, **kwargs):
        if stage_of(stage, STAGES).name == "ffn" and layer == self.layer:  # module or name
            self.x = kwargs["x"].clone()
        return super().__call__(stage, layer, **kwargs)


ids = tok.encode("The feed-forward network holds most of the weights of a transformer block, and so most of its work.")
batch = ForwardBatch.from_sequences([ids], start_positions=[0], device="cpu")
LAYER = 10
recorder = RecordFFN(LAYER)
LlamaModel(loaded, recorder).forward(batch, NoKVCache(batch.cu_seqlens_q))
x = recorder.x  # [T, hidden]
lw = weights.layers[LAYER]
print("x", tuple(x.shape))

# %% [markdown]
# ## Naive: two GEMMs, or one fused
#
# The fused weight is `[W_gate | W_up]` side by side; its column halves are
# the two original matrices.

# %%
w_gate, w_up = lw.w_gate_up.split(inter, dim=1)  # column views: [hidden, inter] each
gate_up = x @ lw.w_gate_up  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
two = torch.cat([x @ w_gate, x @ w_up], dim=1)
print("gate_up", tuple(gate_up.shape), " max |fused - two GEMMs| =", (gate_up - two).abs().max().item())
assert torch.allclose(gate_up, two, rtol=1e-5, atol=1e-5)

# %% [markdown]
# ## SiLU and the gate
#
# `silu(g) = g * sigmoid(g)`: close to 0 for very negative `g`, close to `g`
# for large positive `g`, smooth in between (with a small dip below zero,
# whose minimum the cell below prints). In SwiGLU the activated gate *multiplies* the
# "up" projection elementwise: the gate decides, per feature, how much of `up`
# passes. Worked example:

# %%
g_grid = torch.linspace(-3, 0, 30001, dtype=torch.float64)
silu_grid = torch.nn.functional.silu(g_grid)
print(f"silu's dip: minimum {silu_grid.min():.3f} at g = {g_grid[silu_grid.argmin()]:.3f}")
tiny = torch.tensor([[-4.0, -1.0, 0.0, 2.0, 1.0, 1.0, 1.0, 3.0]])  # gate = first 4, up = last 4
print("silu(gate)      ", torch.nn.functional.silu(tiny[:, :4]).numpy().round(4))
print("silu(gate) * up ", silu_and_mul_naive(tiny).numpy().round(4))  # [1, 8] -> [1, 4]

# %% [markdown]
# The whole naive stage — GEMM, `silu_and_mul`, GEMM — on the real input:

# %%
h = silu_and_mul_naive(gate_up)  # [T, 2*inter] -> [T, inter]
out = ffn.naive(x=x, w_gate_up=lw.w_gate_up, w_down=lw.w_down)  # [T, hidden]
assert torch.allclose(out, h @ lw.w_down, atol=1e-5)
print("x", tuple(x.shape), "-> gate_up", tuple(gate_up.shape), "-> h", tuple(h.shape), "-> out", tuple(out.shape))

# %% [markdown]
# ## Optimized: Triton GEMM -> Triton `silu_and_mul` -> Triton GEMM
#
# `ffn.triton` runs the tiled Triton GEMM (`kernels/matmul.py`), the fused
# activation (`kernels/activation.py`: each program loads a tile of `gate`
# and the matching tile of `up`, computes in float32, stores the product —
# one read of `[T, 2*inter]`, one write of `[T, inter]`), and the GEMM again.
# Check both the activation alone and the whole stage (interpreter, a few
# real rows):

# %%
from stagewise.kernels.activation import silu_and_mul  # noqa: E402  (importing kernels selects GPU or interpreter)

few = x[:6]
gu_few = few @ lw.w_gate_up
act_err = (silu_and_mul(gu_few) - silu_and_mul_naive(gu_few)).abs().max().item()
print(f"silu_and_mul: Triton vs naive, max abs error {act_err:.1e}")
assert act_err < 1e-5

ref = ffn.naive(x=few, w_gate_up=lw.w_gate_up, w_down=lw.w_down)
tri = ffn.triton(x=few, w_gate_up=lw.w_gate_up, w_down=lw.w_down)
err = (tri - ref).abs().max().item()
print(f"ffn stage: Triton vs naive, max abs error {err:.1e} (outputs up to {ref.abs().max():.1f})")
assert torch.allclose(tri, ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Measure: where the FFN's time goes
#
# The three pieces of the naive FFN (the textbook tier: plain `x @ w`; the
# torch tier asks the BLAS for the same GEMMs in the form it measured fastest,
# `stagewise/stages/gemm_torch.py`), timed separately on the CPU, in a decode
# step (T = 1) and a prefill. Next to each, its FLOPs and the bytes it must
# move at least (weights + activations, float32), and their ratio, the
# **arithmetic intensity** (FLOPs per byte):
#
# * the GEMMs do `2 * T * in * out` FLOPs on `in * out` weights: at T = 1 that
#   is 0.5 FLOP per byte — a matrix-*vector* product that only streams the
#   weights (memory-bound); at large T each weight is reused T times and
#   the GEMM becomes compute-bound;
# * `silu_and_mul` does a handful of FLOPs per output element (counted as 5
#   below) and moves 3 float32 numbers for it (read gate and up, write h), at
#   any T: its intensity never grows. Whether it is then limited by the bytes
#   or by the `exp` inside the sigmoid (one "FLOP" in the count, many
#   instructions in fact) depends on the machine: the GB/s it reaches, next to
#   the plain copy-like floor of the next section, tells which.

# %% tags=["timing"]
prefill_tokens = 128 if QUICK else 512
print(f"one layer's FFN weights: {4 * 3 * hidden * inter / 1e6:.1f} MB in float32")
g = torch.Generator().manual_seed(0)
rows = []
for num_tokens in [1, prefill_tokens]:
    xt = torch.randn(num_tokens, hidden, generator=g)
    gut = xt @ lw.w_gate_up
    ht = silu_and_mul_naive(gut)
    parts = {
        "gate/up GEMM": (
            lambda xt=xt: xt @ lw.w_gate_up,
            2 * num_tokens * hidden * 2 * inter,
            4 * (hidden * 2 * inter + num_tokens * (hidden + 2 * inter)),
        ),
        "silu_and_mul": (lambda gut=gut: silu_and_mul_naive(gut), 5 * num_tokens * inter, 4 * num_tokens * 3 * inter),
        "down GEMM": (
            lambda ht=ht: ht @ lw.w_down,
            2 * num_tokens * inter * hidden,
            4 * (inter * hidden + num_tokens * (inter + hidden)),
        ),
    }
    timings = compare({name: fn for name, (fn, _, _) in parts.items()}, repeats=10 if QUICK else 50, warmup=2)
    print(f"T = {num_tokens}")
    for name, (_, flops, nbytes) in parts.items():
        ms = timings[name].median_ms
        rows.append((num_tokens, name, ms, flops, nbytes))
        print(
            f"  {name:13} {ms * 1e3:8.1f} us  {flops / 1e6:8.2f} MFLOP  {nbytes / 1e6:6.2f} MB  "
            f"{flops / nbytes:6.1f} FLOP/B  -> {flops / ms / 1e6:6.1f} GFLOP/s, {nbytes / ms / 1e6:5.1f} GB/s"
        )

# %% [markdown]
# Read the last two columns. In decode (T = 1) a GEMM does half a FLOP per
# byte: its speed is a bandwidth, and its GFLOP/s are low. In prefill the same
# GEMMs reach several times more GFLOP/s, because every weight loaded serves T
# tokens. (Timing one layer's weights over and over — the size is printed
# above — lets the CPU's caches hold them, which flatters the decode bandwidth
# here; in a real decode step the weights of every layer stream through in
# turn.) `silu_and_mul` is a small share of the time, but its FLOPs per byte
# never improve with T: where the GEMMs are fast (a GPU), such elementwise
# passes are what fusion removes.
#
# ## Measure the fusion: `silu(gate) * up` in one pass or two
#
# Unfused, PyTorch runs two kernels: `silu(gate)` reads `gate` and writes a
# temporary `s`, then `s * up` reads `s` and `up` and writes `h`: **five**
# passes over `[T, inter]` float32 tensors. Fused (the Triton kernel, vLLM's
# `silu_and_mul`), one pass reads `gate` and `up` and writes `h`: **three**.
# The temporary never reaches memory.
#
# On the CPU we can get the fused traffic without a new kernel: run the two
# PyTorch ops on a **tile of rows** at a time, small enough that the tile's
# temporary stays in the CPU cache, writing straight into the output
# (`out=`). That is fusion by tiling, the same idea as the GPU kernel's
# registers. As a floor, an elementwise op that moves exactly the fused bytes:
# `torch.add(gate, up, out=h)`.

# %% tags=["timing"]
F = torch.nn.functional
fusion_tokens = 1024 if QUICK else 8192
gate_up_big = torch.randn(fusion_tokens, 2 * inter, generator=g)
h_out = torch.empty(fusion_tokens, inter)
TILE_ROWS = 32  # 32 x inter float32 = the temporary of one tile, a few hundred KB: fits in cache


def unfused():
    gate, up = gate_up_big.chunk(2, dim=-1)
    return F.silu(gate) * up  # two kernels, a [T, inter] temporary in between


def fused_by_tiles():
    for r in range(0, fusion_tokens, TILE_ROWS):
        gate, up = gate_up_big[r : r + TILE_ROWS].chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=h_out[r : r + TILE_ROWS])  # the tile's temporary stays in cache
    return h_out


def same_bytes_floor():
    gate, up = gate_up_big.chunk(2, dim=-1)
    return torch.add(gate, up, out=h_out)  # read gate and up, write h: the fused traffic, trivial arithmetic


assert torch.allclose(fused_by_tiles(), silu_and_mul_naive(gate_up_big), atol=1e-6)
pass_bytes = fusion_tokens * inter * 4  # one pass over a [T, inter] float32 tensor
fusion_bytes = {"unfused: silu, then mul": 5 * pass_bytes, "fused by row tiles": 3 * pass_bytes,
                "floor: add, same bytes as fused": 3 * pass_bytes}
fusion_t = compare(
    {"unfused: silu, then mul": unfused, "fused by row tiles": fused_by_tiles,
     "floor: add, same bytes as fused": same_bytes_floor},
    repeats=5 if QUICK else 20,
    warmup=2,
)
print(f"T = {fusion_tokens}, inter = {inter}: one pass = {pass_bytes / 1e6:.1f} MB")
for name, t in fusion_t.items():
    moved = fusion_bytes[name]
    print(f"  {name:32} {moved / 1e6:6.1f} MB moved  {t.median_ms:7.2f} ms  {moved / t.median_ms / 1e6:5.1f} GB/s")
speedup = fusion_t["unfused: silu, then mul"].median_ms / fusion_t["fused by row tiles"].median_ms
print(f"bytes: unfused / fused = {5 / 3:.2f}x;  measured time: unfused / fused = {speedup:.2f}x")
above_floor = fusion_t["fused by row tiles"].median_ms / fusion_t["floor: add, same bytes as fused"].median_ms
print(f"fused / floor = {above_floor:.2f}x: the same bytes, plus the sigmoid's exp")
if torch.cuda.is_available():  # on a GPU: the Triton kernel itself against the two PyTorch kernels
    gu_gpu = gate_up_big.cuda()
    gpu_paths = {
        "unfused (cuda)": lambda: silu_and_mul_naive(gu_gpu),
        "Triton silu_and_mul": lambda: silu_and_mul(gu_gpu),
    }
    gpu_t = compare(gpu_paths, repeats=20, warmup=3)
    for name, t in gpu_t.items():
        print(f"  {name:32} {t.median_ms * 1e3:8.1f} us")

# %% [markdown]
# Read the last two lines. The fused path moves fewer bytes for the same
# result, and the floor moves the same bytes with trivial arithmetic. Each
# ratio answers its own question:
#
# * **unfused / fused time against the bytes ratio.** Near it: the bytes
#   decide. Above it: the unfused path lost more than its bytes — its fresh
#   `[T, inter]` temporary costs page faults on a CPU on every call. Below it,
#   even below 1: caches held part of the tensors, or the fused loop's many
#   small calls cost more than the bytes they saved.
# * **fused / floor.** Near 1: the pass is limited by its bytes. Well above 1:
#   the sigmoid's `exp` costs more than moving the bytes here, so this pass
#   is partly compute-bound on this machine, and no reduction in bytes makes
#   it faster than its arithmetic.
#
# All of these outcomes happen on real CPUs. A GPU has far more arithmetic per
# byte of memory bandwidth, which is why fused elementwise kernels pay off
# there; when one is present the cell also times the Triton kernel against the
# two PyTorch kernels.
#
# ## The FFN's share of a layer
#
# Per token and per layer, counting multiply-adds as 2 FLOPs:
#
# * QKV projection `2 * hidden * (H + 2*Hkv) * d`, output projection `2 * H*d * hidden`,
# * FFN `2 * 3 * hidden * inter`,
# * attention `4 * H * d * n` for a token that sees `n` keys (QK^T and PV).
#
# The projections and the FFN are fixed per token; attention grows with the
# context. Bytes per decode step per layer: the weights (read once per step)
# plus the KV cache read by attention, `2 * Hkv * d * n` numbers.

# %%
qkv_w = hidden * cfg.qkv_size
o_w = cfg.q_size * hidden
ffn_w = 3 * hidden * inter
per_layer_w = qkv_w + o_w + ffn_w
print(f"matmul weights per layer: QKV {qkv_w:,}  O {o_w:,}  FFN {ffn_w:,}  -> FFN = {ffn_w / per_layer_w:.0%}")
contexts = [128, 1024, 8192]
flop_shares, byte_shares = [], []
for n in contexts:
    attn_per_token = attention_flops(cfg, context=n, new_tokens=n).value / cfg.num_layers / n  # prefill average
    parts = {"QKV": 2 * qkv_w, "O": 2 * o_w, "attention": attn_per_token, "FFN": 2 * ffn_w}
    flop_shares.append({k: val / sum(parts.values()) for k, val in parts.items()})
    kv_read = 2 * cfg.num_kv_heads * cfg.head_dim * n  # numbers of K and V read by one decode step, per layer
    moved = {"QKV": qkv_w, "O": o_w, "attention": kv_read, "FFN": ffn_w}
    byte_shares.append({k: val / sum(moved.values()) for k, val in moved.items()})
    print(
        f"context {n:5}: FFN = {flop_shares[-1]['FFN']:.0%} of prefill FLOPs, "
        f"{byte_shares[-1]['FFN']:.0%} of decode bytes (per layer)"
    )
print(f"GQA: {cfg.num_heads} query heads share {cfg.num_kv_heads} KV heads, "
      f"so the KV cache is {cfg.num_heads // cfg.num_kv_heads}x smaller than with one KV head per query head")

# cross-check against the package's calculator: all layers' matmuls for one token, LM head excluded
head = 2 * cfg.vocab_size * hidden
assert linear_flops(cfg, num_tokens=1).value - head == 2 * per_layer_w * cfg.num_layers

# %% [markdown]
# ## Pictures
#
# **Left — SiLU vs ReLU.** ReLU zeroes every negative input; SiLU lets small
# negative values through (the dip) and is smooth at 0. Behind them, the
# histogram of the real gate pre-activations of layer 10 for our prompt:
# most gates sit in the region where SiLU and ReLU differ.
#
# **Middle and right — the FFN's share of a SmolLM2 layer** for contexts of
# 128, 1k and 8k tokens: of the FLOPs of a prefill (per token), and of the
# bytes of a decode step. At short contexts the FFN is most of both — the
# weights of a layer are mostly FFN (the share is printed above). As the context grows,
# attention's share grows (its work per token is proportional to the
# context), and in decode the KV cache bytes join the weights; GQA (notebook
# 03) is what keeps that slice from being `num_heads / num_kv_heads` times
# larger (printed above).

# %%
gates = gate_up[:, :inter]  # [T, inter]: layer LAYER's gate pre-activations, before SiLU
viz_stages.ffn_pictures(gates.numpy(), contexts, flop_shares, byte_shares, LAYER)
plt.show()

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `LlamaMLP` in `vllm/model_executor/models/llama.py`: `gate_up_proj`
# (a `MergedColumnParallelLinear`, the fused `[W_gate | W_up]`), `act_fn =
# SiluAndMul()`, `down_proj` (a `RowParallelLinear`). `SiluAndMul` in
# `vllm/model_executor/layers/activation.py`: `forward_native` is
# `F.silu(x[..., :d]) * x[..., d:]`, `forward_cuda` the fused one-pass kernel.

# %% [markdown]
# ## Takeaways
#
# * the FFN is `x @ [W_gate | W_up]`, `silu(gate) * up`, `@ W_down`:
#   `[T, hidden] -> [T, 2*inter] -> [T, inter] -> [T, hidden]`;
# * fusing gate and up makes one wide GEMM; fusing silu and mul makes the
#   activation one read and one write (3 passes instead of 5); its intensity
#   is fixed at any T, and whether bytes or the `exp` limit it is measured,
#   not assumed;
# * the FFN holds most of a SmolLM2 layer's weights, so it dominates FLOPs at
#   short contexts and weight bytes in decode, until long contexts hand the
#   lead to attention and its KV cache.
#
# Next: `07_lm_head_sampling`, the last stages: from the final hidden state to the next token.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb06.py`.
#
# **1. SwiGLU's activation.** `gate_up [T, 2*inter]` -> `silu(gate) * up`
# `[T, inter]`, with `silu(g) = g * sigmoid(g)` written out (no `F.silu`).
# The gate is the first half of the columns.

# %%
from stagewise.exercises import check  # noqa: E402


def my_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("06.silu_and_mul", my_silu_and_mul)

# %% [markdown]
# **2. The whole FFN.** `x [T, hidden]`, `w_gate_up [hidden, 2*inter]`,
# `w_down [inter, hidden]` -> `[T, hidden]`. Then count, for SmolLM2, how many
# bytes of weights one decode step reads for the FFN of all layers.


# %%
def my_ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("06.ffn", my_ffn)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels/test_activation.py
#     .venv/bin/python -m pytest -q tests/stages/test_stages_oracle.py -k 'ffn or silu'
#     .venv/bin/python -m pytest -q tests/exercises -k 06
