# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Attention: the naive formula vs FlashAttention's tiles
#
#     q [Tq, H, d], k [Tk, Hkv, d], v [Tk, Hkv, d]  ->  out [Tq, H, d]
#     out = softmax(q k^T / sqrt(d) + causal_mask) v          per sequence, per head
#
# Attention is the one stage where tokens talk to each other: each query row
# mixes the value rows of the keys it may see (itself and earlier tokens). Two
# facts make it the hard part of inference (seeds, chapter 5 and 8):
#
# * it cannot be shared across requests: every sequence attends to its *own*
#   keys, so batching does not amortise it the way it amortises weight reads;
# * done naively, it materialises the `[Lq, Lk]` score matrix `S` and its
#   softmax `P` for every head: **O(N^2)** memory and memory traffic.
#
# **FlashAttention** never builds `S`: it streams K/V past a tile of queries
# `BLOCK_N` keys at a time and keeps, per query row, a running max `m`, a
# running sum `l` and an accumulator (the **online softmax**). Same result,
# **O(N)** extra memory (its traffic stays quadratic: K/V are re-read once per
# tile of queries, but no `N x N` matrix ever reaches memory). This notebook
# shows both, checks they agree, and measures what the naive path costs.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`, set by the test harness): the
# timing stops at shorter sequences and uses fewer repeats. The Triton kernel
# always runs on a few dozen tokens: without a GPU it runs in Triton's CPU
# interpreter, which checks correctness, not speed.
#
# PyTorch is pinned to **one thread** in every mode: on a shared or busy CPU,
# two OpenMP threads stall whenever another process holds a core (we have seen
# 20x slower steps), and the comparisons here are about ratios, not peak speed.

# %%
import os

import matplotlib.pyplot as plt
import numpy as np
import torch

from stagewise.bench.timing import compare
from stagewise.config import PRESETS
from stagewise.kernels.attention_common import online_softmax_reference
from stagewise.models.forward_batch import ForwardBatch, NoKVCache
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.stages import STAGES

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # stable timings on a shared CPU (see above)

loaded = load_model("smollm2-135m")
cfg, tok = loaded.config, loaded.tokenizer
H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
scale = d**-0.5
attention = STAGES["attention"]

# %% [markdown]
# ## Real q, k, v
#
# We run the real model on a packed batch of **three prompts** (a flat token
# batch, no padding; `cu_seqlens` marks where each sequence starts) and record
# the attention stage's inputs in layer 2, with a `StageOps` subclass that
# watches the stage calls.


# %%
class RecordAttention(StageOps):
    """Naive stages; keeps a copy of the attention stage's keyword arguments in one layer."""

    def __init__(self, layer: int):
        super().__init__("naive")
        self.layer, self.kwargs = layer, None

    def __call__(self, stage, layer=None, **kwargs):
        if stage == "attention" and layer == self.layer:
            self.kwargs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return super().__call__(stage, layer, **kwargs)


prompts = [
    "Paged attention stores the keys and values of every token in fixed-size blocks, and a block table "
    "maps each sequence's logical positions to physical blocks in memory.",
    "The capital of France is Paris.",
    "Attention cannot be shared across requests.",
]
seqs = [tok.encode(p) for p in prompts]
batch = ForwardBatch.from_sequences(seqs, start_positions=[0, 0, 0], device="cpu")
recorder = RecordAttention(layer=2)
LlamaModel(loaded, recorder).forward(batch, NoKVCache(batch.cu_seqlens_q))
inputs = recorder.kwargs
q, k, v, cu = inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"]
print("q", tuple(q.shape), " k", tuple(k.shape), " v", tuple(v.shape), " cu_seqlens", cu.tolist())

# %% [markdown]
# ## Naive: softmax(q k^T / sqrt(d) + mask) v
#
# The naive stage loops over sequences and, per sequence, computes every
# head's full score matrix at once: `[Hkv, group, Lq, Lk]` (GQA by reshaping
# q, see notebook 03). For the first sequence and one head, the probabilities
# `P` it builds internally look like this (we recompute them for the picture,
# then check `P @ v` against the stage's output):

# %%
out_naive = attention.naive(**inputs)  # [T, H, d]
L0 = int(cu[1])  # first sequence: rows 0 .. L0-1
head = 1
kv_head = head // (H // Hkv)  # GQA index map
s = (q[:L0, head] @ k[:L0, kv_head].T) * scale  # [L0, L0] scores of one head
causal = torch.ones(L0, L0, dtype=torch.bool).tril()  # query i may see key j <= i
p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)  # [L0, L0]
assert torch.allclose(p @ v[:L0, kv_head], out_naive[:L0, head], atol=1e-5)
print(f"sequence 0: {L0} tokens -> S and P are [{L0}, {L0}] per head, x {H} heads")

fig, ax = plt.subplots(figsize=(6.5, 5.5))
im = ax.imshow(p, cmap="magma", vmax=min(1.0, float(p.max())))
labels = [tok.decode([i]) for i in seqs[0]]
ax.set_xticks(range(L0), labels, rotation=90, fontsize=6)
ax.set_yticks(range(L0), labels, fontsize=6)
ax.set_title(f"P = softmax(S) for layer 2, head {head} (KV head {kv_head})")
ax.set_xlabel("key")
ax.set_ylabel("query")
fig.colorbar(im, ax=ax, fraction=0.046)
plt.tight_layout()
plt.show()

# %% [markdown]
# The picture is lower-triangular (the causal mask) and every row sums to 1.
# This head mostly looks at the current and the previous token (a "local"
# head); other heads spread out, or put most of their weight on the first
# token — the "attention sink" whose huge residual row we saw in notebook 02.
#
# ## The online softmax, tile by tile
#
# A softmax needs the row's maximum (for numerical stability) and its sum
# before any probability is known — that is why the naive version holds the
# whole row. The online softmax walks the keys in tiles of `BLOCK_N` and keeps
# three running values per query row:
#
#     m    the largest score so far
#     l    sum of exp(s - m) over the keys so far
#     acc  sum of exp(s - m) * v over the keys so far         [d]
#
# and for each new tile of scores `s_j`:
#
#     m_new = max(m, max_j s_j)
#     alpha = exp(m - m_new)          # rescales everything summed under the old max
#     l     = alpha * l   + sum_j exp(s_j - m_new)
#     acc   = alpha * acc + sum_j exp(s_j - m_new) v_j
#
# and `out = acc / l` at the end. `online_softmax_reference` in
# `kernels/attention_common.py` is exactly this loop in PyTorch (the Triton
# kernels run the same update in registers, in base 2).
#
# We follow one query row — the last token of sequence 0, in the head whose
# running max changes most often — through tiles of 8 keys. After tile j the
# loop's state must equal the softmax statistics of the keys seen so far:
# `m_j = max(s[:end_j])`, `l_j = sum(exp(s[:end_j] - m_j))`, and `acc_j / l_j`
# = attention over those keys alone. We compute those from the prefixes, and
# the partial output with `online_softmax_reference` itself on the prefix.

# %%
BLOCK_N = 8
row = L0 - 1  # the last query of sequence 0 sees all L0 keys


def row_scores(h: int) -> torch.Tensor:
    return (k[:L0, h // (H // Hkv)] @ q[row, h]) * scale  # [L0]


def max_increases(sc: torch.Tensor) -> int:
    tile_max = [sc[i : i + BLOCK_N].max() for i in range(0, len(sc), BLOCK_N)]
    return sum(int(tile_max[j] > max(tile_max[:j])) for j in range(1, len(tile_max)))


head = max(range(H), key=lambda h: max_increases(row_scores(h)))
scores = row_scores(head).double()  # [L0]
values = v[:L0, head // (H // Hkv)].double()  # [L0, d]
final = online_softmax_reference(scores[None], values, BLOCK_N)[0]  # [d]
ends = list(range(BLOCK_N, L0, BLOCK_N)) + [L0]
m_hist, l_hist, dist = [], [], []
for end in ends:
    m_j = scores[:end].max()
    m_hist.append(float(m_j))
    l_hist.append(float(torch.exp(scores[:end] - m_j).sum()))
    partial = online_softmax_reference(scores[None, :end], values[:end], BLOCK_N)[0]  # out over keys seen so far
    dist.append(float((partial - final).norm() / final.norm()))
for j, (end, m_j, l_j, dj) in enumerate(zip(ends, m_hist, l_hist, dist)):
    print(f"tile {j}: keys 0..{end - 1:2}  m = {m_j:6.3f}  l = {l_j:7.3f}  |out_so_far - out| / |out| = {dj:.3f}")

# %% [markdown]
# ### Check: identical to the full softmax
#
# For that row, then for every row of every head of the packed batch: the
# tile-by-tile loop (masked keys are `-inf` scores, i.e. zero weight) gives
# the naive stage's output, to float64 rounding of a float32 computation.

# %%
full = torch.softmax(scores, dim=0) @ values
print("one row:  max |online - full softmax| =", (final - full).abs().max().item())
assert torch.allclose(final, full, atol=1e-12)

worst = 0.0
for b in range(len(seqs)):
    a, e = int(cu[b]), int(cu[b + 1])
    mask = torch.ones(e - a, e - a, dtype=torch.bool).tril()
    for h in range(H):
        s_bh = (q[a:e, h] @ k[a:e, h // (H // Hkv)].T).double() * scale
        o = online_softmax_reference(s_bh.masked_fill(~mask, float("-inf")), v[a:e, h // (H // Hkv)], BLOCK_N)
        worst = max(worst, (o - out_naive[a:e, h].double()).abs().max().item())
print(f"all {len(seqs)} sequences x {H} heads: max |online softmax - naive stage| = {worst:.1e}")
assert worst < 1e-5

# %% [markdown]
# ### Picture: m and l per tile
#
# Left: the scores of the row (grey bars, grouped by tile), the running max
# `m` (a step function that only goes up) and the running sum `l`. Right: how
# each tile's `l` is made: whenever a tile brings a larger score, `m` jumps
# and what was summed so far is first *multiplied* by `alpha = exp(m_old -
# m_new) < 1` (re-expressed relative to the new max; grey), then the tile's own
# terms `exp(s_j - m_new)` are added (blue). That is why `l` can go down.

# %%
fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4.5))
tiles = np.arange(len(ends))
key_x = np.arange(L0) / BLOCK_N - 0.5 + 0.5 / BLOCK_N  # key j drawn inside its tile's slot
left.bar(key_x, scores.numpy(), width=0.9 / BLOCK_N, color="lightgray", label="scores s, per key")
left.step(tiles, m_hist, where="mid", color="tab:red", lw=2, label="running max m")
left.set_xlabel(f"tile (BLOCK_N = {BLOCK_N} keys)")
left.set_ylabel("score", color="tab:red")
left.legend(loc="lower right", fontsize=8)
twin = left.twinx()
twin.plot(tiles, l_hist, "o-", color="tab:blue")
twin.set_ylabel("running sum l = sum exp(s - m)", color="tab:blue")
left.set_title(f"online softmax state: layer 2, head {head}, last query of sequence 0")

carried = [0.0] + [l_hist[j - 1] * np.exp(m_hist[j - 1] - m_hist[j]) for j in range(1, len(ends))]  # alpha * l_old
new_terms = [l_hist[j] - carried[j] for j in range(len(ends))]  # sum over the tile of exp(s - m_new)
right.bar(tiles, carried, color="lightgray", label="alpha * l_old (rescaled old sum)")
right.bar(tiles, new_terms, bottom=carried, color="tab:blue", label="this tile: sum exp(s_j - m_new)")
for j in range(1, len(ends)):
    alpha = np.exp(m_hist[j - 1] - m_hist[j])
    right.text(j, l_hist[j], f"alpha={alpha:.2f}", ha="center", va="bottom", fontsize=8)
right.set_xlabel("tile")
right.set_ylabel("l after the tile")
right.set_title("l = alpha * l_old + this tile's terms")
right.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Variable-length batches: `cu_seqlens`
#
# An engine step packs sequences of different lengths end to end:
# `q [sum of Lq, H, d]`, with `cu_seqlens_q = [0, L0, L0+L1, ...]` saying
# where each starts. Attention must never mix sequences. Check: attention on
# the packed batch equals attention on each sequence alone.

# %%
worst = 0.0
for b in range(len(seqs)):
    a, e = int(cu[b]), int(cu[b + 1])
    one = torch.tensor([0, e - a], dtype=torch.int32)
    alone = attention.naive(q=q[a:e], k=k[a:e], v=v[a:e], cu_seqlens_q=one, cu_seqlens_k=one, scale=scale)
    worst = max(worst, (alone - out_naive[a:e]).abs().max().item())
print("packed vs one sequence at a time: max difference", worst)
assert worst == 0.0

# %% [markdown]
# With a KV cache, a sequence's new queries sit on top of keys already
# cached: `Lq < Lk`. The mask is then aligned **bottom-right**: query `i` may
# see key `j` iff `j <= i + (Lk - Lq)` (a decode step is `Lq = 1`: the one
# query sees everything). The registry's example inputs build exactly such a
# batch: three sequences, the second and third on cached prefixes of 5 and 17
# keys, so `cu_seqlens_k` differs from `cu_seqlens_q`. The picture below shows
# which keys each query may see.

# %%
num_tokens = 24 if QUICK else 48
example = attention.example_inputs(cfg, num_tokens, torch.device("cpu"), torch.float32)
cq, ck = example["cu_seqlens_q"].tolist(), example["cu_seqlens_k"].tolist()
print("cu_seqlens_q", cq, " cu_seqlens_k", ck)
visible = np.zeros((cq[-1], ck[-1]), dtype=bool)  # [Tq, Tk] for the picture
for b in range(len(cq) - 1):
    lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
    for i in range(lq):
        visible[cq[b] + i, ck[b] : ck[b] + i + (lk - lq) + 1] = True

fig, ax = plt.subplots(figsize=(8, 4.5))
ax.imshow(visible, cmap="Greens", aspect="auto", interpolation="nearest")
for c in cq[1:-1]:
    ax.axhline(c - 0.5, color="gray", lw=0.8)
for c in ck[1:-1]:
    ax.axvline(c - 0.5, color="gray", lw=0.8)
ax.set_xlabel("key row (packed, cu_seqlens_k)")
ax.set_ylabel("query row (packed, cu_seqlens_q)")
ax.set_title("who may see whom: block diagonal, causal, aligned bottom-right")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Optimized: the Triton FlashAttention kernel
#
# `attention.optimized` (`kernels/flash_attention.py`): one program per
# (tile of BLOCK_M query rows, sequence, query head). It loads its Q tile once,
# walks the sequence's keys BLOCK_N at a time folding each K/V tile into
# `(acc, m, l)`, and stops at the diagonal — keys that no row of the tile may
# see are never loaded. The `[Lq, Lk]` matrix never exists. The KV head is
# computed from the query head (the GQA index map), nothing is copied.
#
# Check against the naive stage, on the example batch with cached prefixes and
# on the real packed batch (interpreter):

# %%
for name, args in [("example batch (cached prefixes)", example), ("real packed batch, layer 2", inputs)]:
    ref = attention.naive(**args)
    tri = attention.optimized(**args)
    err = (tri - ref).abs().max().item()
    print(f"{name:32} out {tuple(tri.shape)}: max |flash - naive| = {err:.1e}")
    assert torch.allclose(tri, ref, atol=1e-5, rtol=1e-5)

# %% [markdown]
# ## Measure: what the naive path costs
#
# **Time.** The naive stage on one causal sequence of growing length T, with
# SmolLM2's heads, on this CPU. The FLOPs grow as T^2 (`4 * H * d * T^2`,
# counted for the full matrix the naive path computes before masking), and
# so does the time, once the fixed costs are amortised.

# %%
lengths = [128, 256, 512, 1024] if QUICK else [128, 256, 512, 1024, 2048, 4096]
g = torch.Generator().manual_seed(0)
naive_ms = []
for T in lengths:
    qt = torch.randn(T, H, d, generator=g)
    kt, vt = torch.randn(T, Hkv, d, generator=g), torch.randn(T, Hkv, d, generator=g)
    cut = torch.tensor([0, T], dtype=torch.int32)
    t = compare(
        {"naive": lambda qt=qt, kt=kt, vt=vt, cut=cut: attention.naive(qt, kt, vt, cut, cut, scale)},
        repeats=3 if QUICK else 5,
        warmup=1,
    )["naive"].median_ms
    naive_ms.append(t)
    gflop = 4 * H * d * T * T / 1e9
    print(f"T = {T:5}: {t:8.1f} ms   {gflop:6.2f} GFLOP   S and P: {2 * H * T * T * 4 / 1e6:8.1f} MB per layer")

# %% [markdown]
# **Memory.** Per layer, the naive path holds `S` and `P`: `2 x H x T^2`
# float32 numbers. FlashAttention holds just `Q, K, V, out`: `(2H + 2Hkv)
# x d x T` numbers. Left: SmolLM2 (float32 here); right: Llama 3 8B in bf16
# with its 32 heads. The score matrices pass the whole model's weights well
# before 100k tokens; at 128k tokens Llama 3 8B's would be terabytes, per
# layer. That is the "memory wall" FlashAttention breaks: O(N^2) -> O(N)
# memory. (Its *traffic* stays quadratic — K/V are re-read once per tile of
# BLOCK_M query rows, Theta(T^2 d / BLOCK_M) — but that is BLOCK_M / d times
# fewer numbers than the T^2 scores per head.)

# %%
Ts = np.logspace(7, 17, 41, base=2)  # 128 .. 131072 tokens
fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
for ax, (name, elem) in zip(axes[:2], [("smollm2-135m", 4), ("llama-3-8b", 2)]):
    c = PRESETS[name]
    naive_bytes = 2 * c.num_heads * Ts**2 * 4  # S and P, float32 scores
    flash_bytes = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim * Ts * elem  # Q, K, V, out
    weights_bytes = c.num_parameters() * elem
    ax.loglog(Ts, naive_bytes, label="naive: S and P, 2 x H x T^2 (fp32)", color="tab:red")
    ax.loglog(Ts, flash_bytes, label="tiles: Q, K, V, out  O(T)", color="tab:green")
    ax.axhline(weights_bytes, color="gray", ls="--", lw=1, label="all the model's weights")
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("bytes per layer")
    ax.set_title(f"{name}: attention memory per layer")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")

axes[2].loglog(lengths, naive_ms, "o-", color="tab:red", label="naive stage, measured")
ref_t = np.array(lengths, dtype=float)
axes[2].loglog(ref_t, naive_ms[-1] * (ref_t / ref_t[-1]) ** 2, "--", color="gray", label="slope T^2")
axes[2].set_xlabel("sequence length T")
axes[2].set_ylabel("ms (CPU)")
axes[2].set_title("naive attention time, one sequence, SmolLM2 heads")
axes[2].legend(fontsize=8)
axes[2].grid(alpha=0.3, which="both")
plt.tight_layout()
plt.show()

# %% [markdown]
# **Takeaways**
#
# * naive attention is `softmax(q k^T / sqrt(d) + mask) v` per sequence and
#   head, and it materialises `[Lq, Lk]` matrices: O(T^2) memory;
# * the online softmax keeps `(m, l, acc)` per row and folds in one tile of
#   keys at a time — exactly the same result, with only O(T) extra memory;
# * varlen batches carry `cu_seqlens`; the causal mask is aligned
#   bottom-right so the same rule serves prefill, decode and chunked prefill;
# * the Triton FlashAttention kernel matches the naive stage.
#
# Next: `06_ffn`, where most of a layer's FLOPs are.
