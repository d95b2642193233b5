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
# # 15 · Speculative decoding: guess cheaply, verify in one step
#
# The seeds' chapter 8 is an asymmetry. A decode step streams *every weight*
# from memory to produce one token per sequence, so the arithmetic units sit
# idle; a step over a few more query tokens reads the same weights once and
# costs about the same. Speculative decoding spends that idle arithmetic:
#
# 1. a cheap **proposer** guesses the next k tokens (here: an n-gram lookup in
#    the text so far, or a small draft model);
# 2. the target model runs **one verify step** over the last real token plus
#    the k guesses: k + 1 query rows, and the LM head on all of them;
# 3. the **rejection sampler** keeps the longest run of guesses the target
#    agrees with, plus one token of the target's own.
#
# Every step therefore produces between 1 and k + 1 tokens, and the text is
# exactly what the target alone would write: identical for greedy decoding,
# identically *distributed* for sampling.
#
# Path: motivation (what a step of n rows costs, measured) -> the acceptance
# arithmetic -> the rejection sampler, proved by simulation -> the n-gram
# proposer at work on a real prompt, traced -> exercises.
#
# **Quick mode** (`STAGEWISE_NOTEBOOK_QUICK=1`): fewer step shapes and
# repeats, fewer simulated draws, a shorter generated answer. What each
# section shows is the same.
#
# *The seeds* are the two source articles this project is built from: the README names them and
# what they cover (section "The seeds: the two source articles").

# %%
import contextlib
import io
import os

import matplotlib.pyplot as plt
import torch

from stagewise import LLM, SamplingParams
from stagewise.bench.commands.spec import WORKLOADS
from stagewise.bench.commands.spec_steps import step_costs
from stagewise.config import PRESETS, EngineConfig
from stagewise.models.registry import load_model
from stagewise.stages import STAGES
from stagewise.trace.tracer import Tracer
from stagewise.viz import stages as viz_stages

# %matplotlib inline

QUICK = os.environ.get("STAGEWISE_NOTEBOOK_QUICK") == "1"
loaded = load_model("smollm2-135m", device="cpu")  # float32 weights on the CPU
tok = loaded.tokenizer
with contextlib.redirect_stderr(io.StringIO()):  # the first LLM() times this CPU's GEMM forms, once
    LLM(loaded)

# %% [markdown]
# ## 1. What does a step of n query tokens cost?
#
# `step_costs` (from `bench spec`) times the target's forward pass over the
# paged KV cache for **one** sequence with a fixed context already cached,
# feeding n new tokens at once, the LM head on all n rows (as a verify step
# runs it). n = 1 is an ordinary decode step. If each extra row cost as much
# as a whole step, the curve would follow the dashed line `n x decode`.

# %% tags=["timing"]
rows = [1, 2, 5] if QUICK else [1, 2, 3, 5, 9, 17, 33]
costs = step_costs(loaded, "torch", context=128, rows=rows, repeats=2 if QUICK else 10)
for n in rows:
    print(f"{n:>2} rows: {costs[n]:7.1f} ms  ({costs[n] / costs[1]:.2f}x a decode step)")
verify = costs[5] / costs[1]  # 4 guesses and the last real token
cheap = verify < 1.5  # under half a decode step more for four more rows
print(f"a verify step of 5 rows costs {verify:.2f}x a decode step here: "
      + ("the extra rows are cheap" if cheap else "the extra rows are not cheap on this machine"))  # fmt: skip

viz_stages.step_cost(rows, costs, "one sequence, 128 tokens of context (float32, torch tier)")
plt.show()

# %% [markdown]
# How to read the printed ratios. **Near 1** (the measured curve flat, far
# below the dashed line): the step is bound by streaming the weights, which
# happens once whether they multiply one row or five, so the extra rows are
# nearly free and the gap between the two curves is what speculation can win.
# **Growing towards n**: on this machine the extra rows cost real arithmetic
# (a CPU's arithmetic is not idle during decode the way a GPU's is, and
# attention over the cache for several query rows takes the prefill path);
# then a verify step is expensive and speculation pays only when most guesses
# are kept, which section 2 makes exact. Either way the ratio printed above is
# the price of a verify step here.

# %% [markdown]
# ## 2. The acceptance arithmetic
#
# Suppose each guess is kept with probability a, independently, and a step
# carries k guesses. The step yields guess 1 with probability a, guesses 1
# and 2 with probability a^2, ..., and always one token of the target's own,
# so the expected number of tokens per step is
#
#     E = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)
#
# With step cost c(k) = (cost of k + 1 rows) / (cost of 1 row), speculation
# pays when E / c(k) > 1 (ignoring what the proposer itself costs: nothing
# for an n-gram lookup, a few small forwards for a draft model).


# %%
def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a == 1 else (1 - a ** (k + 1)) / (1 - a)


generator = torch.Generator().manual_seed(0)
a, k = 0.7, 4
kept = torch.rand(20000, k, generator=generator) < a  # each guess kept with probability a
run = torch.cumprod(kept.int(), dim=1).sum(dim=1)  # the run of guesses kept before the first miss
print(f"a={a}, k={k}: formula {expected_tokens(a, k):.3f}, simulated {float(run.float().mean()) + 1:.3f}")

ks = [n - 1 for n in rows if n > 1]  # the guesses per step whose step cost was measured
rates = (0.5, 0.7, 0.8, 0.9)
expected = {a: [expected_tokens(a, k) for k in range(0, 9)] for a in rates}
speedup = {a: (ks, [expected_tokens(a, k) / (costs[k + 1] / costs[1]) for k in ks]) for a in rates}
viz_stages.speculation_gain(expected, speedup)
plt.show()

# %% [markdown]
# High acceptance makes long guesses pay; at low acceptance the extra rows are
# mostly wasted, and a proposer should guess fewer tokens or none (the n-gram
# proposer here backs off a request whose guesses keep failing).

# %% [markdown]
# ## 3. The rejection sampler, proved by simulation
#
# For sampling, "the target agrees" is a coin flip. A guess x drawn from the
# proposer's distribution q is kept with probability min(1, p(x) / q(x)); when
# it is not, the replacement is drawn from the residual max(0, p - q),
# normalised. Then the token that comes out is distributed exactly as p:
#
#     P(y) = q(y) min(1, p(y)/q(y)) + P(reject) max(0, p(y) - q(y)) / Z
#          = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y)
#
# because Z, the residual's mass, equals P(reject) = 1 - sum min(p, q). The
# stage `rejection_sampling` does this for a whole batch (its docstring has
# the proof in full). Its randomness is an input: a uniform u per guess for
# the accept test, and Exp(1) noise E per sequence for the one draw, made by
# the *exponential race* argmax r / E (distributed as r, no normalising).
#
# Below: many one-guess sequences with a q that is far from p. The tokens that
# come out follow p, not q.

# %%
p = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05])
q = torch.tensor([0.05, 0.10, 0.15, 0.30, 0.40])  # the proposer prefers what the target does not
n, vocab = (3000 if QUICK else 30000), 5
g = torch.Generator().manual_seed(1)
guesses = torch.multinomial(q, n, replacement=True, generator=g)  # [n]: one guess per sequence
out, counts = STAGES["rejection_sampling"].naive(
    draft_token_ids=guesses,
    cu_num_draft_tokens=torch.arange(n + 1, dtype=torch.int32),  # one guess each
    draft_probs=q.repeat(n, 1),  # [n, V]
    target_probs=torch.stack([p, torch.full((vocab,), 1 / vocab)]).repeat(n, 1),  # [2n, V]: guess row, bonus row
    is_greedy=torch.zeros(n, dtype=torch.bool),
    uniform=torch.rand(n, generator=g),
    exponential=torch.empty(n, vocab).exponential_(generator=g),
)
first = out[:, 0]  # the token at the guessed position: the kept guess, or its replacement
freq = torch.bincount(first, minlength=vocab).double() / n
chi2 = float((((freq - p) ** 2) / p).sum() * n)
kept_share, theory = float((counts == 2).double().mean()), float(torch.minimum(p, q).sum())
print(f"kept {kept_share:.1%} of the guesses (theory: sum of min(p, q) = {theory:.1%})")
print(f"chi-square against p: {chi2:.1f} (4 degrees of freedom; above 18.5 happens 1 time in 1000 when the law is p)")

viz_stages.side_by_side(
    [
        ("q (the proposer)", q, "tab:orange"),
        ("tokens out (measured)", freq, "tab:green"),
        ("p (the target)", p, "tab:blue"),
    ],
    xlabel="token",
    ylabel="probability",
)
plt.show()

# %% [markdown]
# The Triton version (`stagewise.kernels.rejection_sampling`: one program per
# sequence walks its guesses, then one pass over the vocabulary makes the
# draw) must give the *same tokens*, not just the same distribution: it sees
# the same random numbers and computes the same float32 operations. On a CPU
# it runs in Triton's interpreter, so the batch here is small.

# %%
# seven sequences of 0-3 guesses over the tiny model's 512-token vocabulary (draft q given)
inputs = STAGES["rejection_sampling"].example_inputs(PRESETS["tiny"], 7, torch.device("cpu"), torch.float32)
want = STAGES["rejection_sampling"].naive(**inputs)
got = STAGES["rejection_sampling"].triton(**inputs)
same = torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
print("tokens out per sequence (naive):", want[1].tolist(), "| triton gives the same tokens:", same)

# %% [markdown]
# ## 4. The n-gram proposer at work
#
# Prompt lookup needs no second model: take the last n tokens of the text
# (prompt and answer so far), find where they occurred before, and guess the
# k tokens that followed there. When the answer copies the prompt (quoting,
# summarising, editing code) the guesses are often right. The prompt below
# asks SmolLM2 to repeat a passage; the trace shows each verify step's guesses
# and how many the target kept.

# %%
_, prompt = WORKLOADS["copy"][0]
params = SamplingParams(max_tokens=16 if QUICK else 80, temperature=0)
ecfg = EngineConfig(max_num_seqs=1, max_model_len=512)
plain = LLM(loaded, engine_config=ecfg).generate(prompt, params, chat=True)[0]
spec_llm = LLM(loaded, engine_config=ecfg, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
with Tracer(timing=False) as tracer:
    spec = spec_llm.generate(prompt, params, chat=True)[0]
print("identical to plain greedy decoding:", spec.token_ids == plain.token_ids)
print(f"{len(spec.token_ids)} tokens in {len(tracer.steps)} steps (plain decoding: one step per token)")
per_step = []
for s in tracer.steps:
    (r,) = s.requests
    if r["phase"] == "verify":
        guesses = tok.decode(r["draft_token_ids"])
        kept = tok.decode(r["kept_token_ids"])
        print(f"step {s.index:>2}: guessed {guesses!r:<40} kept {r['accepted']} + 1 -> {kept!r}")
    per_step.append(len(r["kept_token_ids"]) if r["phase"] == "verify" else 1)
m = spec.metrics
print(f"acceptance {m.acceptance_rate:.0%}, {m.mean_accepted_tokens:.2f} guesses kept per verify step")

viz_stages.bars(
    dict(enumerate(per_step)),
    "n-gram speculation on a quoting prompt: several tokens per step",
    colors="tab:green",
    xlabel="engine step",
    ylabel="tokens produced",
    figsize=(7, 3),
)
plt.show()

# %% [markdown]
# ## In vLLM (v0.11.0)
#
# `NgramProposer.propose` in `vllm/v1/spec_decode/ngram_proposer.py` finds the
# last n tokens earlier in the sequence and proposes what followed; the target
# model scores all guesses in one step and `RejectionSampler` in
# `vllm/v1/sample/rejection_sampler.py` keeps the accepted prefix (greedy: equal to
# the argmax; random: accept with probability min(1, p/q), else redraw from the
# residual).

# %% [markdown]
# ## Takeaways
#
# * Where a decode step is bound by reading the weights, a few more query
#   rows in the same step cost little, and that is what speculative decoding
#   spends; section 1 measures the price of those rows on the machine at
#   hand, and the gain is the expected tokens divided by that price.
# * Expected tokens per step with acceptance a and k guesses:
#   (1 - a^(k+1)) / (1 - a). Divide by the verify step's cost to get the
#   speed-up; low acceptance calls for shorter guesses or none.
# * Rejection sampling keeps the output's law exactly the target's: accept
#   with min(1, p/q), otherwise draw from max(0, p - q). Greedy is the special
#   case "keep while it is the argmax".
# * The randomness is an input tensor, so the textbook loop and the fused
#   Triton kernel give the same tokens.
# * Prompt lookup (n-gram) costs nothing and shines when the answer copies
#   its prompt.
#
# ## Exercises
#
# Each task has a stub to fill in and a check cell below it. The check runs your
# function and the rejection sampler stage on the same inputs and prints
# **PASS**, **FAIL** with the first difference, or **not yet** while the stub is
# untouched. Solutions: `notebooks/solutions/nb15.py`.
#
# **1. Greedy acceptance.** `drafts` (k guessed token ids) and `target_probs
# [k + 1, V]` -> the tokens the step keeps: guesses while each equals the
# argmax of its row, then the target's argmax at the first wrong guess (or, if
# all k were right, the argmax of the last row).

# %%
from stagewise.exercises import check  # noqa: E402


def my_greedy_accept(drafts: list[int], target_probs: torch.Tensor) -> list[int]:
    raise NotImplementedError


# %%
check("15.greedy_accept", my_greedy_accept)

# %% [markdown]
# **2. The rejection step.** `p [V]` (target), `q [V]` (proposer), the guess
# `x`, its uniform `u` in [0, 1) and the noise `exponential [V]` -> `(accepted,
# token)`: keep x when `u * q[x] < p[x]`; otherwise draw from the residual
# max(0, p - q) by the exponential race, `argmax(r / exponential)` over the
# tokens with r > 0 (and from p itself if the residual is zero everywhere).


# %%
def my_rejection_step(p: torch.Tensor, q: torch.Tensor, x: int, u: float, exponential: torch.Tensor):
    raise NotImplementedError


# %%
check("15.rejection_step", my_rejection_step)

# %% [markdown]
# The tests that cover this notebook's stage, and its exercises run on the solutions:
#
#     .venv/bin/python -m pytest -q tests/engine/test_spec_greedy.py tests/engine/test_spec_sampling.py
#     .venv/bin/python -m pytest -q tests/stages/test_rejection_sampling.py
#     .venv/bin/python -m pytest -q tests/exercises -k 15
