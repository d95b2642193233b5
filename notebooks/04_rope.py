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
# # 04 · RoPE: rotary position embedding
#
#     positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, d]  ->  q, k rotated (same shapes)
#
# Attention compares tokens through dot products `q_m . k_n`. A dot product
# knows nothing about *where* the two tokens are: shuffle the sequence and
# every score is unchanged. RoPE puts the position into q and k themselves,
# by **rotating** them:
#
# * split each head's `d` features into `d/2` pairs — rotate-half convention:
#   feature `i` pairs with feature `i + d/2`;
# * rotate pair `i` of a token at position `p` by the angle `p * f_i`, with
#   frequencies `f_i = theta^(-2i/d)` from fast (`f_0 = 1` radian per token)
#   to very slow;
# * do it to q and k (never to v).
#
# Since rotating both vectors of a dot product by angles `a` and `b` leaves
# `cos(a - b)` behind, `rot(q, m) . rot(k, n)` depends on `m - n` only: the
# model sees **relative** positions, for free, inside the ordinary attention
# dot product.
#
# SmolLM2: `d = 64` (32 pairs), `theta = 100,000`.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing uses fewer tokens and repeats. The Triton kernel runs on a handful of
# tokens either way (Triton's CPU interpreter without a GPU: correctness, not
# speed).
#
# PyTorch runs on **one thread** here: the comparisons are about ratios between
# paths doing the same work, not about the machine's peak speed.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
import torch

from stagewise.bench.harness.timing import compare
from stagewise.models.gguf_loader import unpermute_rows
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.qkv_proj import split_qkv
from stagewise.stages.rope import build_cos_sin_cache
from stagewise.viz import stages as viz_stages

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed

loaded = load_model("smollm2-135m")
cfg, weights, tok = loaded.config, loaded.weights, loaded.tokenizer
d, theta = cfg.head_dim, cfg.rope_theta
rope = STAGES["rope"]
print(f"head_dim {d} ({d // 2} pairs), rope_theta {theta:g}, max_position {cfg.max_position_embeddings}")

# %% [markdown]
# ## The frequencies, and the precomputed cache
#
# `build_cos_sin_cache(max_position, d, theta)` computes every angle once:
# row `p` is `[cos(p f_0) .. cos(p f_31), sin(p f_0) .. sin(p f_31)]`. A
# forward pass then *gathers* rows by position instead of calling `sin` and
# `cos` for every token of every batch: the seeds' "space for time". For
# SmolLM2 that is `max_position x d` float32 numbers, once (the cell prints the
# size).
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
cache = build_cos_sin_cache(cfg.max_position_embeddings, d, theta)  # [max_position, d]
inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # f_i, [d/2]
wavelength = 2 * torch.pi / inv_freq  # tokens per full turn
print("cache", tuple(cache.shape), f"{cache.numel() * 4 / 1e6:.1f} MB")
for i in [0, 1, 8, 16, 24, 31]:
    print(f"pair {i:2}: f = {inv_freq[i]:.2e} rad/token, one full turn every {wavelength[i]:12,.0f} tokens")

# %% [markdown]
# Fast pairs (small `i`) turn every few tokens and tell neighbours apart;
# slow pairs barely move over thousands of tokens and carry coarse, long-range
# position. A larger `theta` stretches the slow end, one of the knobs models
# turn for longer contexts.
#
# ## Naive: rotate with the cache
#
# Worked example: put a unit vector in pair 0 (`q[0] = 1`, its partner
# `q[32] = 0`) and in pair 8, and run the stage at positions 0, 1, 2, ...
# Pair 0 turns 1 radian per token; pair 8 turns `f_8` radians per token.

# %%
num_pos = 24
positions = torch.arange(num_pos)
unit = torch.zeros(num_pos, 1, d)  # [T, heads=1, d]: the same vector at every position
unit[:, 0, 0] = 1.0  # pair 0: features (0, 32)
unit[:, 0, 8] = 1.0  # pair 8: features (8, 40)
rotated, _ = rope.naive(positions=positions, q=unit, k=unit, cos_sin_cache=cache)  # (k is rotated too; unused)
pair0 = rotated[:, 0, [0, 32]]  # [T, 2]: (x_0, x_32) at each position
pair8 = rotated[:, 0, [8, 40]]
print(f"position 1, pair 0: {pair0[1].tolist()}   expected (cos 1, sin 1) = ({np.cos(1):.7f}, {np.sin(1):.7f})")
assert torch.allclose(pair0[1], torch.tensor([np.cos(1.0), np.sin(1.0)], dtype=torch.float32), atol=1e-6)

# %% [markdown]
# ## Check: the score depends only on the distance
#
# Take a real query and key (layer 0, head 0, of the prompt's second token,
# `" capital"`) and place them at every pair of positions `(m, n)`. The score
# `rot(q, m) . rot(k, n)` should be the same for every pair with the same
# `m - n`.

# %%
ids = torch.tensor(tok.encode("The capital of France is"))
layer = weights.layers[0]
h = STAGES["embedding"].naive(ids=ids, weight=weights.embed)
x, _ = STAGES["rmsnorm"].naive(x=h, weight=layer.attn_norm, eps=cfg.rms_norm_eps)
q_all, k_all, _ = split_qkv(STAGES["qkv_proj"].naive(x=x, w_qkv=layer.w_qkv), cfg)
q_vec, k_vec = q_all[1, 0], k_all[1, 0]  # one query head and its KV head, for the token " capital": [d] each

P = 64
grid_pos = torch.arange(P)
q_rot, k_rot = rope.naive(
    positions=grid_pos, q=q_vec.expand(P, 1, d), k=k_vec.expand(P, 1, d), cos_sin_cache=cache
)  # the same q and k placed at positions 0..P-1
scores = q_rot[:, 0] @ k_rot[:, 0].T  # [P, P]: scores[m, n] = rot(q, m) . rot(k, n)
for delta in [0, 1, 5, 20]:
    diag = torch.diagonal(scores, offset=-delta)  # all (m, n) with m - n = delta
    spread = (diag.max() - diag.min()).item()
    print(f"m - n = {delta:2}: {diag.numel():2} pairs, score {diag.mean():8.4f}, spread (max - min) {spread:.1e}")
    assert spread < 1e-3 * scores.abs().max()

# %% [markdown]
# ## Optimized: the Triton kernel, in place on the views
#
# The naive path builds new tensors: `x1`, `x2`, four products, a `cat`.
# The kernel (`kernels/rope.py`) runs one program per tile of tokens (and
# block of heads): it loads each token's cos/sin row once, rotates all of its
# q *and* k heads in float32, and writes them **back where they were**. It accepts the
# strided views `split_qkv` returns, so the rotation happens inside the fused
# `qkv` buffer itself: q and k are each read once and written once, nothing is
# allocated.
#
# Check against the naive rotation on real q, k of the prompt (interpreter):

# %%
qkv = STAGES["qkv_proj"].naive(x=x, w_qkv=layer.w_qkv)  # [T, 960]
q, k, _ = split_qkv(qkv, cfg)  # strided views into qkv
pos = torch.arange(len(ids))
q_ref, k_ref = rope.naive(positions=pos, q=q, k=k, cos_sin_cache=cache)  # new tensors; q, k untouched
before = qkv.clone()
q_out, k_out = rope.triton(positions=pos, q=q, k=k, cos_sin_cache=cache)  # in place
print("returns the same objects:", q_out is q and k_out is k)
print("max |triton - naive|: q", (q_out - q_ref).abs().max().item(), " k", (k_out - k_ref).abs().max().item())
assert torch.allclose(q_out, q_ref, atol=1e-5) and torch.allclose(k_out, k_ref, atol=1e-5)
changed = (qkv != before).any(dim=0)  # which of the 960 columns of the fused buffer were rewritten
print(
    f"columns of qkv rewritten in place: q {int(changed[:576].sum())}/576, k {int(changed[576:768].sum())}/192, "
    f"v {int(changed[768:].sum())}/192"
)

# %% [markdown]
# ## llama.cpp's row permutation (and why the loader undoes it)
#
# Two conventions pair the features differently:
#
# * **rotate-half** (Hugging Face, and this package): pair `i` is features `(i, i + d/2)`;
# * **interleaved** (the original RoPE paper, llama.cpp): pair `i` is features `(2i, 2i + 1)`.
#
# They are the same rotation on differently *ordered* features. When
# llama.cpp converts a Hugging Face checkpoint to GGUF, it permutes the rows of
# `W_q` and `W_k` (so q and k come out as `[x0, y0, x1, y1, ...]` instead of
# `[x0, x1, ..., y0, y1, ...]`) to suit its interleaved RoPE. Our GGUF loader
# undoes it with `unpermute_rows`, so the rotate-half stage is right for
# weights from either source. On one head with `d = 8`:

# %%
d_small = 8
hf_order = np.arange(d_small)  # feature indices in rotate-half order: x0 x1 x2 x3 | y0 y1 y2 y3
gguf_order = np.stack([hf_order[: d_small // 2], hf_order[d_small // 2 :]], axis=1).reshape(-1)  # llama.cpp's rows
print("rows as llama.cpp stores them:    ", gguf_order.tolist())
print("after unpermute_rows (our loader):", unpermute_rows(gguf_order[:, None], num_heads=1)[:, 0].tolist())

# %% [markdown]
# And the equivalence, numerically: rotate-half RoPE on our q, then reorder
# the features llama.cpp's way, equals interleaved RoPE applied to q in
# llama.cpp's order. (The interleaved rotation below is a 3-line illustration
# of llama.cpp's convention, not part of the package.) Since attention only
# uses dot products `q . k`, and the same reordering is applied to q and k,
# the scores are identical either way — as long as the weights and the RoPE
# convention match. A mismatch (llama.cpp's rows with rotate-half RoPE) would
# pair the wrong features and silently produce a worse model: the GGUF tests
# (`tests/models/test_loaders.py`) compare against Hugging Face to catch exactly that.

# %%
perm = torch.from_numpy(np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1))
q_gguf = q_all[..., perm]  # q in llama.cpp's feature order, before RoPE


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Illustration: rotate pairs (2i, 2i+1) of x [T, heads, d] by positions * f_i."""
    cos, sin = cache[positions].chunk(2, dim=-1)  # [T, d/2] each
    x0, x1 = x[..., 0::2], x[..., 1::2]  # [T, heads, d/2]
    return torch.stack([x0 * cos[:, None] - x1 * sin[:, None], x1 * cos[:, None] + x0 * sin[:, None]], -1).flatten(-2)


q_half, _ = rope.naive(positions=pos, q=q_all, k=k_all, cos_sin_cache=cache)
diff = (rope_interleaved(q_gguf, pos) - q_half[..., perm]).abs().max().item()
print("max |interleaved RoPE on llama.cpp order - (rotate-half RoPE) reordered| =", diff)
assert diff < 1e-5

# %% [markdown]
# ## Measure: gather from the cache vs compute the angles
#
# The cache trades a few MB of memory for never computing `sin`/`cos` during
# inference. On the CPU, for a batch of tokens at random positions: gather
# `cache[positions]` vs compute `cos(p f), sin(p f)` from scratch.

# %% tags=["timing"]
num_tokens = 4096 if QUICK else 32768
rand_pos = torch.randint(0, cfg.max_position_embeddings, (num_tokens,))
inv_freq32 = inv_freq.float()


def on_the_fly():
    angles = torch.outer(rand_pos.float(), inv_freq32)  # [T, d/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # [T, d]


assert torch.allclose(on_the_fly(), cache[rand_pos], atol=1e-3)  # same numbers (up to float32 angle rounding)
timings = compare(
    {"gather cache[positions]": lambda: cache[rand_pos], "compute cos/sin": on_the_fly},
    repeats=10 if QUICK else 30,
    warmup=2,
)
for name, t in timings.items():
    print(f"{name:24} {t.median_ms * 1e3:9.1f} us for {num_tokens} tokens")
ratio = timings["compute cos/sin"].median_ms / timings["gather cache[positions]"].median_ms
print(f"computing the angles costs {ratio:.1f}x the gather here")

# %% [markdown]
# How to read the ratio: above 1, the gather wins on this machine — it only
# copies `d` numbers per token, while the other path evaluates `sin` and `cos`
# (many instructions each) for every element. Near or below 1, this machine
# computes special functions about as fast as it moves memory, and the cache
# buys memory traffic you did not need to save; either way the numbers are the
# same. This is a CPU measurement: a GPU has other ratios of arithmetic to
# bandwidth, and the same two lines timed there are the only way to know.
# The gathered rows are the same in every layer of a step: `rope.naive`, the
# textbook, gathers them in each layer anyway; the torch tier
# (`stagewise/stages/rope_torch.py`, the CPU default) rotates q and k as one
# tensor instead, and its docstring has its measurements.
#
# ## Pictures
#
# **Left — the rotation.** Pair 0 and pair 8 of the unit vector above, as the
# position goes 0..23. Pair 0 (1 radian per token) goes round the circle
# the number of times the cell prints; pair 8 (`f_8`) creeps along an arc. The length never
# changes: RoPE only rotates.
#
# **Middle — the score depends on `m - n` only.** `rot(q, m) . rot(k, n)` for
# the real query/key above at every pair of positions 0..63: constant along
# every diagonal (a Toeplitz matrix). The causal mask would keep only the
# lower triangle (`n <= m`).
#
# **Right — `cos_sin_cache` as an image**: positions 0..511 down, the 32 cos
# columns then the 32 sin columns across. Left columns (fast pairs) flicker
# from row to row; right columns (slow pairs) barely change over 512 tokens.

# %%
for i in (0, 8):
    turns = (num_pos - 1) * float(inv_freq[i]) / (2 * np.pi)
    print(f"pair {i}, positions 0..{num_pos - 1}: {turns:.2f} turns of the circle")

pairs = [(pair0, "pair 0: 1 rad/token", "tab:blue"), (pair8, f"pair 8: {inv_freq[8]:.3f} rad/token", "tab:orange")]
viz_stages.rope_pictures(pairs, scores.detach(), cache, d)
plt.show()

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `RotaryEmbedding` in `vllm/model_executor/layers/rotary_embedding/base.py`:
# `_compute_cos_sin_cache` builds the `[max_position, rotary_dim]` cache once,
# `forward_native` gathers `cos_sin_cache[positions]` and rotates q and k
# (`is_neox_style=True` is the rotate-half convention used here); `get_rope` in
# `rotary_embedding/__init__.py` picks the scaled variants (Llama 3's
# `Llama3RotaryEmbedding`, YaRN, ...).

# %% [markdown]
# ## Takeaways
#
# * RoPE rotates each (i, i + d/2) pair of q and k by `position * theta^(-2i/d)`;
#   the scores then depend only on the distance between tokens;
# * the angles are precomputed once into `cos_sin_cache [max_position, d]` and
#   gathered by position;
# * the Triton kernel rotates q and k in place, inside the fused qkv buffer;
# * llama.cpp stores W_q/W_k rows interleaved for its RoPE; the GGUF loader
#   puts them back in rotate-half order.
#
# Next: `05_attention`.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb04.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. Build the cache.** `my_cos_sin_cache(max_position, rotary_dim, theta)` ->
# `[max_position, rotary_dim]` float32: row `p` holds `cos(p f_i)` for the
# `rotary_dim / 2` frequencies `f_i = theta^(-2i / rotary_dim)`, then `sin(p f_i)`.

# %%
from stagewise.exercises import check  # noqa: E402


def my_cos_sin_cache(max_position: int, rotary_dim: int, theta: float) -> torch.Tensor:
    raise NotImplementedError


# %%
check("04.cos_sin_cache", my_cos_sin_cache, save=True)

# %% [markdown]
# **2. Rotate.** `my_rope(positions [T], x [T, heads, d], cos_sin_cache)` -> `x`
# rotated, rotate-half convention: with halves `x1 = x[..., :d/2]`,
# `x2 = x[..., d/2:]` and the row's `cos`, `sin` halves,
# `[x1 cos - x2 sin, x2 cos + x1 sin]`. The check applies it to q and to k.


# %%
def my_rope(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError


# %%
check("04.rope", my_rope, save=True)

# %% [markdown]
# **3. Turn the knob (no check).** Rebuild the score picture of the middle panel
# with another `rope_theta`: try 100 and 10,000,000. Which diagonals change,
# and why does a small theta make distant tokens look alike (think of the
# wavelengths printed at the top)?

# %%
my_theta = 100.0  # try other values
my_cache = build_cos_sin_cache(P, d, my_theta)
mq, mk = rope.naive(positions=grid_pos, q=q_vec.expand(P, 1, d), k=k_vec.expand(P, 1, d), cos_sin_cache=my_cache)
viz_stages.rope_scores((mq[:, 0] @ mk[:, 0].T).detach(), f"rot(q, m) . rot(k, n), theta = {my_theta:g}")
plt.show()

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels/test_rope.py tests/stages/test_rope_scaling.py
#     .venv/bin/python -m pytest -q tests/stages/test_stages_oracle.py -k rope
#     .venv/bin/python -m pytest -q tests/exercises -k 04
