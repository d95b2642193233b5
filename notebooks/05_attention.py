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
#   softmax `P` for every head: **O(N^2)** extra memory, written to memory and
#   read back.
#
# **FlashAttention** never builds `S`: it holds a tile of `BLOCK_M` query rows
# on chip, streams K/V past it `BLOCK_N` keys at a time and keeps, per query
# row, a running max `m`, a running sum `l` and an accumulator (the **online
# softmax**). Same result. What becomes **O(N)** is the *extra memory*: `m`
# and `l` per row instead of `N x N` matrices. The *memory traffic* does not
# become O(N): every query tile reads K and V again, `N / BLOCK_M` passes over
# `N` keys, so it stays quadratic, `Theta(N^2 d^2 / M)` per head for an on-chip
# memory of `M` bytes (Dao et al. 2022, since a tile of `BLOCK_M ~ M / d` rows
# must fit). That is far fewer bytes than the naive path's `N^2` score
# round trips whenever `d^2 < M`. (The seeds summarise it as "HBM reads and
# writes from O(N^2) to O(N)"; the counted bytes below show what is really
# linear and what is not.) This notebook shows both paths, checks they agree,
# and measures what each costs.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the
# timing stops at shorter sequences and uses fewer repeats. The Triton kernel
# always runs on a few dozen tokens: without a GPU it runs in Triton's CPU
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
import numpy as np
import torch

from stagewise import viz
from stagewise.bench.harness.timing import compare
from stagewise.config import PRESETS
from stagewise.kernels.attention_common import online_softmax_reference
from stagewise.kernels.flash_attention import INTERPRETER_BLOCKS, flash_attention_plan
from stagewise.kernels.targets import gpu_target
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.base import stage_of

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
torch.set_num_threads(1)  # one thread: ratios between paths, not peak speed

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
        if stage_of(stage, STAGES).name == "attention" and layer == self.layer:  # module or name
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
q, k, v, cu = inputs["q"], inputs["k"], inputs["v"], inputs["metadata"].cu_seqlens_q  # the step's metadata
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

labels = [tok.decode([i]) for i in seqs[0]]
viz.attention_probs(p, labels, f"P = softmax(S) for layer 2, head {head} (KV head {kv_head})")
plt.show()

# %% [markdown]
# The picture is lower-triangular (the causal mask) and every row sums to 1.
# This head mostly looks at the current and the previous token (a "local"
# head); other heads spread out. How much does each head of this layer give the
# first token, the "attention sink" whose huge residual row we saw in notebook
# 02? The weight on key 0, averaged over the queries after it:

# %%
sink = []
for h in range(H):
    s_h = (q[:L0, h] @ k[:L0, h // (H // Hkv)].T) * scale
    p_h = torch.softmax(s_h.masked_fill(~causal, float("-inf")), dim=-1)  # [L0, L0]
    sink.append(float(p_h[1:, 0].mean()))  # weight on key 0, queries 1.. L0-1
print("mean weight on the first token, per head:", " ".join(f"{w:.2f}" for w in sink))
uniform = float((1 / torch.arange(2, L0 + 1)).mean())  # query i spreading evenly over its i + 1 keys
print(f"largest: head {max(range(H), key=sink.__getitem__)} gives it {max(sink):.0%} of its attention; a uniform "
      f"head would give it {uniform:.0%}; heads giving it most (> 50%) of their weight: {sum(w > 0.5 for w in sink)}")

# %% [markdown]
# Read the lines together: a head well above the uniform share leans on the
# first token, a head near it does not single it out, and the last count says
# whether any head of this layer gives it most of its weight. Other layers can
# behave differently: `RecordAttention(layer=...)` above records any layer, and
# these lines measure it.
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
viz.online_softmax_tiles(scores.tolist(), m_hist, l_hist, BLOCK_N,
                         f"online softmax state: layer 2, head {head}, last query of sequence 0")  # fmt: skip
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
    one = AttentionMetadata.over_batch(torch.tensor([0, e - a], dtype=torch.int32))  # one sequence
    alone = attention.naive(q=q[a:e], k=k[a:e], v=v[a:e], metadata=one, scale=scale)
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
#
# The stage receives these offsets, each sequence's key count `seq_lens` and
# their host copies as one `AttentionMetadata` object
# (`stages/attention_metadata.py`), built once per engine step and handed to
# every layer: the loop above slices with its host ints, so it never reads a
# device tensor back.

# %%
num_tokens = 24 if QUICK else 48
example = attention.example_inputs(cfg, num_tokens, torch.device("cpu"), torch.float32)
meta = example["metadata"]  # the step's AttentionMetadata: offsets and lengths, device and host
cq, ck, lens = meta.cu_seqlens_q_host, meta.cu_seqlens_k_host, meta.seq_lens_host
print("cu_seqlens_q", cq, " cu_seqlens_k", ck, " seq_lens", lens)
visible = np.zeros((cq[-1], ck[-1]), dtype=bool)  # [Tq, Tk] for the picture
for b in range(len(cq) - 1):
    lq, lk = cq[b + 1] - cq[b], lens[b]
    for i in range(lq):
        visible[cq[b] + i, ck[b] : ck[b] + i + (lk - lq) + 1] = True

viz.visible_keys(visible, cq, ck, "who may see whom: block diagonal, causal, aligned bottom-right")
plt.show()

# %% [markdown]
# ## Optimized: the Triton FlashAttention kernel
#
# `attention.triton` (`kernels/flash_attention.py`): one program per
# (tile of BLOCK_M rows, sequence, KV head). The rows of a tile are (query,
# query head) pairs of the `G = H / Hkv` query heads that share that KV head
# (the GQA index map run backwards: nothing is copied), so every K/V tile the
# program loads serves all of them. It loads its Q tile once, walks the
# sequence's keys BLOCK_N at a time folding each K/V tile into `(acc, m, l)`,
# and stops at the diagonal — keys that no row of the tile may see are never
# loaded. The `[Lq, Lk]` matrix never exists.
#
# Check against the naive stage, on the example batch with cached prefixes and
# on the real packed batch (interpreter):

# %%
for name, args in [("example batch (cached prefixes)", example), ("real packed batch, layer 2", inputs)]:
    ref = attention.naive(**args)
    tri = attention.triton(**args)
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

# %% tags=["timing"]
lengths = [128, 256, 512, 1024] if QUICK else [128, 256, 512, 1024, 2048, 4096]
g = torch.Generator().manual_seed(0)
naive_ms = []
for T in lengths:
    qt = torch.randn(T, H, d, generator=g)
    kt, vt = torch.randn(T, Hkv, d, generator=g), torch.randn(T, Hkv, d, generator=g)
    cut = AttentionMetadata.over_batch(torch.tensor([0, T], dtype=torch.int32))
    t = compare(
        {"naive": lambda qt=qt, kt=kt, vt=vt, cut=cut: attention.naive(qt, kt, vt, cut, scale)},
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
# (the cell prints both models' head shapes). The score matrices soon outgrow
# the whole model's weights (the dashed line; the cell prints where). That is the "memory wall"
# FlashAttention breaks: O(N^2) -> O(N) *extra memory*. Its traffic is the next
# section.

# %%
Ts = np.logspace(7, 17, 41, base=2)  # 128 .. 131072 tokens
panels = []
for name, elem in [("smollm2-135m", 4), ("llama-3-8b", 2)]:
    c = PRESETS[name]
    print(f"{name}: H = {c.num_heads} query heads, Hkv = {c.num_kv_heads} KV heads, "
          f"G = {c.num_heads // c.num_kv_heads}, d = {c.head_dim}")
    naive_bytes = 2 * c.num_heads * Ts**2 * 4  # S and P, float32 scores
    flash_bytes = (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim * Ts * elem  # Q, K, V, out
    weights_bytes = c.num_parameters() * elem
    passes = Ts[np.argmax(naive_bytes > weights_bytes)]
    print(f"{name}: S and P outgrow all the weights ({weights_bytes / 1e9:.2f} GB) at T ~ {passes:,.0f} tokens; "
          f"at T = {Ts[-1]:,.0f}: {naive_bytes[-1] / 1e12:,.1f} TB per layer")
    panels.append({"title": f"{name}: attention memory per layer", "xlabel": "sequence length T (tokens)",
                   "ylabel": "bytes per layer", "hline": (weights_bytes, "all the model's weights"), "curves": [
                       (Ts, naive_bytes, "-", "tab:red", "naive: S and P, 2 x H x T^2 (fp32)"),
                       (Ts, flash_bytes, "-", "tab:green", "tiled: holds only Q, K, V, out, O(T)")]})
ref_t = np.array(lengths, dtype=float)
panels.append({"title": "naive attention time, one sequence, SmolLM2 heads", "xlabel": "sequence length T",
               "ylabel": "ms (CPU)", "curves": [
                   (lengths, naive_ms, "o-", "tab:red", "naive stage, measured"),
                   (ref_t, naive_ms[-1] * (ref_t / ref_t[-1]) ** 2, "--", "gray", "slope T^2")]})
viz.loglog_panels(panels)
plt.show()

# %% [markdown]
# ## Measure: the bytes each path moves
#
# Memory *held* is one question; bytes *moved* between memory and the chip is
# the other, and it decides a memory-bound kernel's time. We count both paths'
# traffic for one causal prefill of N tokens, one layer, all heads:
#
# * **naive**: read Q, K, V, write the output, and in between write `S`, read it
#   back for the softmax, write `P`, read it back for `P @ V`: at least four
#   passes over `H x N^2` float32 scores;
# * **tiled kernel**: read each Q tile once and write its output once, and read
#   K/V once *per row tile*, as far as the tile's causal bound (the kernel's own
#   loop bounds: a tile whose last query is `i` loads keys `0..i`, in whole
#   `BLOCK_N` tiles).
#
# The tile sizes are the launcher's own (`flash_attention_plan`): the CPU
# interpreter's, and, on an H100 (sm_90) in bf16, where the autotuner picks
# among candidates, the smallest and the largest `BLOCK_M` it may choose.
# Left: SmolLM2's heads; right: Llama 3 8B's (its `d` and `G`, printed above,
# are both larger).

# %%
def tiled_bytes_moved(T: int, c, block_m: int, block_n: int, elem: int) -> int:
    """K/V bytes the tiled kernel loads for a causal prefill of T tokens (one layer), plus Q read and out written."""
    G = c.num_heads // c.num_kv_heads
    rows = G * T  # (query, group head) rows of one KV head
    keys = 0
    for f0 in range(0, rows, block_m):
        last_query = (min(f0 + block_m, rows) - 1) // G
        keys += min(-(-(last_query + 1) // block_n) * block_n, T)  # whole BLOCK_N tiles up to the diagonal
    return c.num_kv_heads * keys * 2 * c.head_dim * elem + 2 * T * c.q_size * elem


def naive_bytes_moved(T: int, c, elem: int) -> int:
    """Q, K, V read and out written, plus S and P (float32) each written once and read once."""
    return (2 * c.q_size + 2 * c.kv_size) * T * elem + 4 * c.num_heads * T * T * 4


traffic_T = [256, 512, 1024, 2048, 4096, 8192] if QUICK else [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
panels = []
for name in ["smollm2-135m", "llama-3-8b"]:
    c = PRESETS[name]
    G = c.num_heads // c.num_kv_heads
    plan = flash_attention_plan(4096, G, c.head_dim, torch.bfloat16, gpu_target(90))
    tiles = sorted({(cf.kwargs["BLOCK_M"], cf.kwargs["BLOCK_N"]) for cf in plan.configs})
    tiles = {"H100 bf16, smallest BLOCK_M": tiles[0], "H100 bf16, largest BLOCK_M": tiles[-1]}
    tiles["CPU interpreter"] = (INTERPRETER_BLOCKS["BLOCK_M"], INTERPRETER_BLOCKS["BLOCK_N"])
    naive_b = [naive_bytes_moved(T, c, 2) for T in traffic_T]
    curves = [(traffic_T, naive_b, "o-", "tab:red", "naive: S and P to memory and back")]
    for (label, (bm, bn)), colour in zip(tiles.items(), ["tab:green", "tab:olive", "tab:gray"]):
        tiled = [tiled_bytes_moved(T, c, bm, bn, 2) for T in traffic_T]
        curves.append((traffic_T, tiled, "s-", colour, f"tiled, {label} ({bm}x{bn})"))
        print(f"{name:13} {label:28} BLOCK_M {bm:3}: T = {traffic_T[-1]:,}: {tiled[-1] / 1e9:7.2f} GB, "
              f"naive {naive_b[-1] / 1e9:8.1f} GB ({naive_b[-1] / tiled[-1]:5.0f}x more)")
    linear = [(2 * c.q_size + 2 * c.kv_size) * T * 2 for T in traffic_T]  # every input read once, out written once
    curves.append((traffic_T, linear, "--", "black", "O(N): read Q, K, V once, write out once"))
    panels.append({"title": f"{name}: attention traffic of one causal prefill", "xlabel": "prompt length N (tokens)",
                   "ylabel": "bytes moved, one layer (bf16 inputs)", "curves": curves})
viz.loglog_panels(panels, width=7)
plt.show()

# %% [markdown]
# Both curves bend up like `N^2` — neither path's traffic is O(N); only the
# dashed line is. What tiling changes is the constant: the naive path moves
# `16 H` bytes per (query, key) pair (four float32 passes per head), the
# kernel about `2 d x bytes x G / BLOCK_M` per KV head (K and V, once per row
# tile of `BLOCK_M / G` queries), so a bigger `BLOCK_M` (more
# on-chip memory) means fewer passes over K/V: that is the `d^2 / M` of
# FlashAttention's bound. The tiny interpreter tiles need many more passes
# than a GPU's; the interpreter is there to prove correctness, not speed.

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `Attention` in `vllm/attention/layer.py` is the layer a model calls; the
# work is done by a backend: `FlashAttentionImpl.forward` in
# `vllm/v1/attention/backends/flash_attn.py` (the FlashAttention CUDA kernels,
# varlen over `cu_seqlens`), or, in Triton, `unified_attention` in
# `vllm/attention/ops/triton_unified_attention.py`, whose inner loop is this
# notebook's online softmax over tiles of keys.

# %% [markdown]
# ## Takeaways
#
# * naive attention is `softmax(q k^T / sqrt(d) + mask) v` per sequence and
#   head, and it materialises `[Lq, Lk]` matrices: O(T^2) extra memory, written
#   and read back;
# * the online softmax keeps `(m, l, acc)` per row and folds in one tile of
#   keys at a time — exactly the same result, with only O(T) extra memory;
# * the tiled kernel's traffic is still quadratic — K/V are read once per query
#   tile, `Theta(T^2 d^2 / M)` per head — but far below the naive path's score
#   round trips;
# * varlen batches carry `cu_seqlens`; the causal mask is aligned
#   bottom-right so the same rule serves prefill, decode and chunked prefill;
# * the Triton FlashAttention kernel matches the naive stage.
#
# Next: `06_ffn`, where most of a layer's FLOPs are.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the package's own reference on fresh inputs and prints **PASS**,
# **FAIL** with the worst mismatch, or **not yet** while the stub is untouched.
# Solutions: `notebooks/solutions/nb05.py`.
# A check cell with `save=True` keeps your answer, once it passes, in
# `notebooks/my_parts.py`: the capstone (notebook 16) builds your engine from
# that file.
#
# **1. Causal attention for one sequence.** `q [L, H, d]`, `k, v [L, Hkv, d]`
# -> `[L, H, d]`: per query head `h`, scores against KV head `h // (H // Hkv)`,
# times `scale`, causal mask (query `i` sees keys `j <= i`), softmax, times V.
# Materialise the scores; that is the naive path.

# %%
from stagewise.exercises import check  # noqa: E402


def my_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    raise NotImplementedError


# %%
check("05.causal_attention", my_causal_attention, save=True)

# %% [markdown]
# **2. One step of the online softmax.** The check owns the loop: it starts
# from `m = -inf`, `l_sum = 0`, `acc = 0` and hands your function one tile of
# keys at a time (`l_sum` is the running sum `l` above: a lone `l` reads too
# much like `1` in code). `my_online_step(m [R], l_sum [R], acc [R, d],
# scores [R, n], values [n, d])` returns the state after folding that tile in:
# the new running max `m`, `l_sum = alpha * l_sum + sum exp(s - m_new)` and
# `acc = alpha * acc + exp(s - m_new) @ values`, with `alpha = exp(m - m_new)`
# (careful with the very first tile, where `m` is `-inf`; scores may hold
# `-inf` for masked keys). After every tile the state must equal the softmax
# statistics of the keys seen so far; at the end `acc / l_sum` is the output.


# %%
def my_online_step(
    m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, values: torch.Tensor
):
    raise NotImplementedError


# %%
check("05.online_softmax", my_online_step, save=True)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kernels/test_flash_attention.py
#     .venv/bin/python -m pytest -q tests/stages/test_stages_oracle.py -k attention
#     .venv/bin/python -m pytest -q tests/exercises -k 05
