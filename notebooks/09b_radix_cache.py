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
# # 09b · The radix prefix cache: a tree of token runs beside the hash chain
#
# Notebook 09's prefix cache names each *full* block by a chained digest
# (vLLM's design): a prompt finds the longest run of its full blocks that some
# earlier request computed. Two things fall through that net:
#
# * a match ends at a **block boundary**. Two prompts that share 45 tokens with
#   blocks of 16 share only 32 of them as far as the hash chain can tell; the
#   last 13 shared tokens are computed again;
# * a **partial block** is never named. The end of a finished chat turn (its
#   answer's last tokens) sits in a partial block, so the next turn of the same
#   conversation recomputes it.
#
# SGLang's RadixAttention keeps instead a **radix tree** of token runs: every
# edge holds a run of token ids and the KV blocks behind it; children are
# filed under the first token of their run. A lookup walks from the root
# comparing tokens, so it can stop *anywhere*, in the middle of a run and of a
# block. The engine then shares the whole blocks before that point and
# **copies** the block the match ends in (copy-on-write: the new request will
# write its own tokens after the matched ones, into its own copy).
#
#     radix tree                          hash chain (same requests)
#     root ─ "system… passage" ─┬─ "Q1 …"     h0 → h1 → h2 → h3(Q1)
#                               └─ "Q2 …"     h0 → h1 → h2 → h3'(Q2)
#
# A node is **locked** while a running request's path passes through it, and
# never evicted then. When blocks run out the cache evicts unlocked **leaves,
# least recently used first**; a parent whose last child goes becomes a leaf.
# Finished requests' tokens (prompt *and* answer) stay in the tree until then.
#
# Path: the same requests through both caches -> the tree beside the chains ->
# check (same tokens with either cache, and without one) -> count what each
# reused -> write match, insert and evict yourself.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): the answers are 6 tokens long
# instead of 16; everything else is the same.

# %%
import contextlib
import io
import os

from stagewise import LLM, SamplingParams
from stagewise.bench.harness.workloads import SEED_TEXT
from stagewise.config import EngineConfig
from stagewise.models.registry import load_model
from stagewise.trace.export import to_json
from stagewise.trace.tracer import Tracer
from stagewise.viz.radix import radix_beside_hash

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
loaded = load_model("smollm2-135m", device="cpu")  # float32 on the CPU: exact comparisons
tok = loaded.tokenizer

# %% [markdown]
# ## 1. The same requests through both caches
#
# Three conversations with one system text and passage: two users ask different
# questions, then the first user asks a follow-up (turn 2 carries turn 1's
# question *and answer* as history). Small blocks (8 tokens) keep the picture
# readable. Each request runs alone, one after another, in an engine with the
# hash cache and in one with the radix cache; the tracer records, for each
# request, how many prompt tokens its first step reused and from where.

# %%
BLOCK = 8
passage = " ".join(SEED_TEXT.split()[:30])
system = {"role": "system", "content": f"Answer in one sentence about this text: {passage}"}
answer = SamplingParams(max_tokens=6 if QUICK else 16, temperature=0)


TURN_1 = [system, {"role": "user", "content": "What does a KV cache keep?"}]
OTHER = [system, {"role": "user", "content": "Why is static batching wasteful?"}]


def turn_2(first_answer: str) -> list[dict]:
    """User A's follow-up: the first turn, its answer, a new question."""
    return [*TURN_1, {"role": "assistant", "content": first_answer}, {"role": "user", "content": "And why?"}]


def run(cache: str):
    """The three requests, one after another, through a fresh engine with `cache`; -> the LLM,
    each request's output, and (tokens reused by its first step, where from) from the trace."""
    ecfg = EngineConfig(block_size=BLOCK, num_kv_blocks=64, max_model_len=256, max_num_seqs=2)
    with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once
        llm = LLM(loaded, mode="paged", prefix_cache=cache, engine_config=ecfg)
    outs, reused = {}, {}
    for name in ("user A, turn 1", "user B, turn 1", "user A, turn 2"):
        messages = {"user A, turn 1": TURN_1, "user B, turn 1": OTHER}.get(name)
        if messages is None:
            messages = turn_2(outs["user A, turn 1"].text)
        with Tracer(timing=False) as t:
            outs[name] = llm.generate([messages], answer, chat=True)[0]
        first_step = to_json(t)["steps"][0]["requests"][0]
        reused[name] = (first_step.get("reused_tokens", 0), first_step.get("reused_from"))
    return llm, outs, reused


runs = {cache: run(cache) for cache in ("none", "hash", "radix")}
for name, out in runs["radix"][1].items():
    print(f"{name}: prompt {len(out.prompt_token_ids)} tokens; answer {out.text!r}")
    for cache in ("hash", "radix"):
        tokens, source = runs[cache][2][name]
        print(f"    {cache:5s} cache: first step reused {tokens:3d} tokens (from {source})")

# %% [markdown]
# User B's prompt shares the system text with user A's: the hash cache reuses
# the whole blocks of that shared part, the radix cache every shared token up
# to the first token that differs. User A's second turn starts with the
# whole first turn, answer included: the radix tree holds the finished
# request's generated tokens too, so the match runs to the end of what turn 1
# computed (its last token was sampled, never fed back: the only token of the
# history the cache cannot hold).
#
# ## 2. Check: the same tokens with either cache, and with none
#
# Reuse must be exact: a copied partial block holds the very K/V the first
# request wrote, so every answer is the same token for token as without a
# prefix cache.

# %%
for name in runs["none"][1]:
    want = runs["none"][1][name].token_ids
    assert all(runs[c][1][name].token_ids == want for c in ("hash", "radix")), name
print("every answer is the same with no cache, the hash cache and the radix cache")
saved = {c: sum(t for t, _ in runs[c][2].values()) for c in ("hash", "radix")}
print(f"prompt tokens not computed again: hash {saved['hash']}, radix {saved['radix']}")

# %% [markdown]
# ## 3. The picture: the tree beside the chains
#
# Above, the radix tree the engine holds now: each box is a node, with its run
# of text, how many tokens it holds from which position, and the KV blocks
# behind them (a block can appear in two nodes when a run boundary falls inside
# it). Below, the hash chains of the same requests (prompt and answer): one
# digest per full block, chained to the one before it, with the block it
# names; the digests two requests share are drawn in one colour, the others
# grey. The chain has no box for the tokens after the last full block.

# %%
radix_llm, radix_outs, _ = runs["radix"]
hash_llm, hash_outs, _ = runs["hash"]
tree = radix_llm.engine.block_manager.prefixes.describe()
hashes = hash_llm.engine.block_manager.prefixes
chains = {}
for name, out in hash_outs.items():
    ids = out.prompt_token_ids + out.token_ids
    chain = [(d.hex()[:6], hashes.cached.get(d, "-")) for d in hashes.block_hashes(ids)]
    chains[f"{name} ({len(ids)} tokens)"] = chain


def label(ids):
    return tok.decode(list(ids))


fig = radix_beside_hash(tree, chains, label, f"the same three requests, blocks of {BLOCK} tokens")

# %% [markdown]
# ## 4. Parallel samples share the prompt
#
# `SamplingParams(n=4)` asks for four samples of one prompt. The first
# computes the prompt; the others share its full blocks (reference counts, no
# copy) and each gets its own copy of the last, partial block, where it writes
# its own tokens. Right after the prompt is computed, the pool holds the
# prompt's blocks once plus one partial block per extra sample. The trace
# shows each sample's first step: the first found the system text in the tree
# (from radix) and computed the rest of the prompt; the others took the whole
# prompt but its last token, from the running first sample (from fork) or
# from the tree, where the first sample's prompt is filed by then (from radix),
# and computed only that token, whose logits each samples with its own seed
# (seed + i).

# %%
ask = [system, {"role": "user", "content": "Give the text a title."}]
four = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=5)
with Tracer(timing=False) as t:
    samples = radix_llm.generate([ask], four, chat=True)[0].samples
for i, s in enumerate(samples):
    print(f"sample {i} (seed {5 + i}): {s.text!r}")
firsts = {}  # each sample's first scheduled step: what it reused, and from where
for step in to_json(t)["steps"]:
    for r in step["requests"]:
        firsts.setdefault(r["request_id"], (r.get("reused_tokens", 0), r.get("reused_from"), r["num_scheduled"]))
for rid, (tokens, source, computed) in firsts.items():
    print(f"{rid}: reused {tokens} prompt tokens (from {source}), computed {computed}")

# %% [markdown]
# ## In SGLang and vLLM
#
# * SGLang, `python/sglang/srt/mem_cache/radix_cache.py`, `RadixCache`:
#   `match_prefix`, `insert` (with `_split_node` when a new key parts inside a
#   node's run), `evict` (a heap of unlocked leaves by last access time),
#   `inc_lock_ref` / `dec_lock_ref` for the paths running requests hold.
# * vLLM, `vllm/v1/core/kv_cache_utils.py`, `hash_block_tokens`: the chained
#   block hashes of notebook 09, the design this notebook sets the tree beside.
# * Here: `stagewise/kv/radix_cache.py` and `stagewise/kv/hash_cache.py`, behind
#   one interface (`stagewise/kv/prefix_cache.py`), chosen with
#   `LLM(prefix_cache="hash" | "radix" | "none")` or `--prefix-cache`;
#   `stagewise bench prefix` compares them on chat, few-shot and n-sample work.
#
# ## Takeaways
#
# * The hash chain finds whole blocks; the radix tree finds tokens. On a
#   multi-turn chat the difference is the shared tokens after the last full
#   block, about half a block per turn on average.
# * A match that ends inside a block shares the blocks before it and copies
#   the block it ends in; writes go to the copy (copy-on-write).
# * Locked paths (running requests) are never evicted; eviction takes unlocked
#   leaves, least recently used first, and a parent whose last child goes is a
#   leaf in turn.
# * Either cache leaves every token as it was without one: reuse is exact.
#
# ## Exercises
#
# The checks build a real radix cache (`BlockManager(prefix_cache="radix")`,
# blocks of 4 tokens), copy its tree into plain `Node`s (`tokens`: the run on
# the edge into the node; `children`: first token -> child; `parent`; `lock`;
# `last_use`: smaller = longer ago) and compare your function with the
# package's on the same tree. Solutions: `notebooks/solutions/nb09b.py`.
#
# **1. Match.** `my_match(root, token_ids)` returns how many leading tokens of
# `token_ids` the tree holds, walking from the root and comparing token by
# token; a match may end inside a run (and so inside a block). The last token
# is never matched: its logits are needed, so it must be computed.

# %%
from stagewise.exercises import check  # noqa: E402
from stagewise.exercises.radix_checks import Node  # noqa: E402, F401 (the tree's nodes)


def my_match(root, token_ids: list[int]) -> int:
    raise NotImplementedError


# %%
check("09b.radix_match", my_match)

# %% [markdown]
# **2. Insert.** `my_insert(root, token_ids)` makes `token_ids` a path from the
# root and returns how many tokens it added (0 if the path was there already,
# even ending inside a run). Where the sequence parts from a run, split the
# node in two: the upper part keeps the shared tokens (and the lock and
# last use), the lower part the rest, and the new tokens become a second child
# of the upper part. A sequence that runs on past a leaf extends below it as a
# new child.


# %%
def my_insert(root, token_ids: list[int]) -> int:
    raise NotImplementedError


# %%
check("09b.radix_insert", my_insert)

# %% [markdown]
# **3. Evict.** `my_evict(root, count)` removes `count` nodes (fewer if fewer
# can go) and returns their runs in the order removed: always the least
# recently used leaf whose `lock` is 0; a locked node is never removed; once a
# parent's last child is gone, the parent (if unlocked) is a leaf and may go
# next.


# %%
def my_evict(root, count: int) -> list[tuple]:
    raise NotImplementedError


# %%
check("09b.radix_evict", my_evict)

# %% [markdown]
# The tests that cover this notebook's part, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/kv/test_radix_cache.py tests/engine/test_radix_engine.py
#     .venv/bin/python -m pytest -q tests/exercises/test_radix_wrong_answers.py
