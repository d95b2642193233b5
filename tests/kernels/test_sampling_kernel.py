"""The fused Triton sampling kernel vs the naive reference (`stagewise.stages.sampling`).

The kernel draws from its own random stream (Philox + Gumbel-max), so random
rows cannot match `torch.multinomial` token for token. The chain instead:
the host seed mixing -> greedy rows equal the reference -> the set of tokens
each row may draw equals `processed_probs > 0` over a grid of settings, with
and without ties -> rows split into several chunks (programs) give what one
chunk gives -> a chi-square test that the draws follow `processed_probs`
-> determinism and batch independence -> bf16 -> the registry stage -> the
launcher's errors.

Costs in the CPU interpreter (2 cores): ~10 ms per row without top-k/top-p
(Philox alone is ~8 ms), ~100 ms per row with both searches (62 passes).
"""

import itertools

import pytest
import torch

from stagewise.config import get_preset
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.sampling import sample, sample_with_mask, stream_seeds
from stagewise.sampling_params import SamplingParams
from stagewise.stages import STAGES
from stagewise.stages.sampling import SamplingTensors, naive, processed_probs, stream_seed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tensors(params, seen=None, offsets=None, seeds=None, vocab=512) -> SamplingTensors:
    b = len(params)
    seen = torch.zeros(b, vocab, dtype=torch.bool) if seen is None else seen
    offsets = [0] * b if offsets is None else offsets
    seeds = [0] * b if seeds is None else seeds
    return SamplingTensors.from_params(params, seen, offsets, seeds, DEVICE)


def random_logits(b: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    """2 * N(0, 1) logits; with ties, rounded to multiples of 0.25 (many exact ties, at the max too)."""
    logits = 2.0 * torch.randn(b, vocab, generator=torch.Generator().manual_seed(seed))
    return ((logits * 4).round() / 4 if ties else logits).to(DEVICE)


def random_seen(b: int, vocab: int, seed: int, fraction: float = 0.1) -> torch.Tensor:
    return (torch.rand(b, vocab, generator=torch.Generator().manual_seed(seed)) < fraction).to(DEVICE)


def assert_same_allowed_set(logits, t, params, chunk=None):
    """The kernel's allowed set == naive processed_probs > 0, and every drawn token lies in it."""
    tokens, allowed = sample_with_mask(logits, t, chunk=chunk)
    expected = processed_probs(logits, t) > 0  # [B, V]
    bad = (allowed != expected).any(dim=-1).nonzero().flatten().tolist()
    details = [
        f"row {r} {params[r]}: kernel keeps {int(allowed[r].sum())}, naive {int(expected[r].sum())}" for r in bad[:5]
    ]
    assert not bad, f"{len(bad)} rows differ:\n" + "\n".join(details)
    rows = torch.arange(len(params), device=tokens.device)
    assert bool(expected[rows, tokens].all()), "a row drew a token outside its allowed set"


# ---- the host side: per-row Philox seeds ----


def test_stream_seeds_match_the_reference_mixing():
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(2**63), 2**63 - 1, (200,), generator=gen), torch.tensor([0, -1, 2**63 - 1])])
    offsets = torch.cat([torch.randint(0, 2**40, (200,), generator=gen), torch.tensor([0, 5, 2**62])])
    mixed = stream_seeds(seeds, offsets).tolist()  # int64: the uint64 bits, signed
    expected = [stream_seed(s, o) for s, o in zip(seeds.tolist(), offsets.tolist())]
    assert [m % 2**64 for m in mixed] == expected


# ---- greedy ----


def test_greedy_worked_examples():
    # penalty 2 on the seen token 0 turns [3, 2, 0, -1] into [1.5, 2, 0, -1]: token 1
    small = torch.tensor([[3.0, 2.0, 0.0, -1.0]], device=DEVICE)
    seen = torch.tensor([[True, False, False, False]], device=DEVICE)
    assert sample(
        small, tensors([SamplingParams(temperature=0.0, repetition_penalty=2.0)], seen, vocab=4)
    ).tolist() == [1]
    # negative logits are multiplied: [-1, -1.5] with token 0 seen, penalty 2 -> [-2, -1.5]: token 1
    neg = torch.tensor([[-1.0, -1.5]], device=DEVICE)
    seen = torch.tensor([[True, False]], device=DEVICE)
    assert sample(neg, tensors([SamplingParams(temperature=0.0, repetition_penalty=2.0)], seen, vocab=2)).tolist() == [
        1
    ]
    # ties take the first index, also across blocks (V = 3001: blocks of 1024)
    ties = torch.zeros(2, 3001, device=DEVICE)
    ties[0, [1, 3]] = 5.0
    ties[1, [2500, 40, 1500]] = 7.0
    tokens, allowed = sample_with_mask(ties, tensors([SamplingParams(temperature=0.0)] * 2, vocab=3001))
    assert tokens.tolist() == [1, 40]
    assert allowed.sum(-1).tolist() == [1, 1] and bool(allowed[0, 1]) and bool(allowed[1, 40])


@pytest.mark.parametrize(("vocab", "ties"), [(512, False), (1000, True), (3001, True)])
def test_greedy_rows_match_naive(vocab, ties):
    b = 12
    logits = random_logits(b, vocab, seed=vocab, ties=ties)
    seen = random_seen(b, vocab, seed=vocab + 1, fraction=0.3)
    # penalty 1.3 on half the rows; greedy whatever the filters say; temperature just below 1e-5
    params = [
        SamplingParams(temperature=(0.0, 9e-6)[r % 2], repetition_penalty=(1.0, 1.3)[r // 6], top_k=r % 3, min_p=0.1)
        for r in range(b)
    ]
    t = tensors(params, seen, offsets=list(range(b)), vocab=vocab)
    assert torch.equal(sample(logits, t), naive(logits, t))


# ---- the allowed set: no sort, same thresholds ----

GRID = list(
    itertools.product(
        [0.5, 1.0, 2.0],  # temperature
        [0, 1, 5, 50],  # top_k
        [0.3, 0.9, 1.0],  # top_p
        [0.0, 0.05, 0.2],  # min_p
        [1.0, 1.3],  # repetition penalty
    )
)  # 216 settings, one row each


@pytest.mark.parametrize("ties", [False, True])
def test_allowed_set_matches_naive_over_a_grid(ties):
    vocab = 1000
    params = [
        SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=mp, repetition_penalty=rp, seed=i)
        for i, (temp, k, p, mp, rp) in enumerate(GRID)
    ]
    logits = random_logits(len(params), vocab, seed=11 + ties, ties=ties)
    seen = random_seen(len(params), vocab, seed=13)
    assert_same_allowed_set(logits, tensors(params, seen, vocab=vocab), params)


def test_allowed_set_across_blocks_in_bf16_and_fp16():
    """V = 3001: the searches span four blocks of 1024; the kernel computes in fp32 whatever it loads."""
    vocab = 3001
    params = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=2000, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=vocab, min_p=0.001),  # top_k = V keeps everything
        SamplingParams(temperature=2.0, top_p=0.5, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]
    seen = random_seen(len(params), vocab, seed=17)
    t = tensors(params, seen, offsets=list(range(len(params))), vocab=vocab)
    for dtype in (torch.bfloat16, torch.float16):
        logits = random_logits(len(params), vocab, seed=19).to(dtype)  # bf16: many exact ties
        assert_same_allowed_set(logits, t, params)  # two chunks of 2048 per row
        assert_same_allowed_set(logits, t, params, chunk=1024)  # three


@pytest.mark.parametrize(("ties", "dtype"), [(False, torch.float32), (True, torch.bfloat16)])
def test_rows_split_into_chunks_give_what_one_chunk_gives(ties, dtype):
    """V = 1000 in chunks of 256: 4 programs per row and a combine after each pass, same sets and tokens."""
    vocab = 1000
    params = [
        SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=mp, repetition_penalty=rp, seed=i)
        for i, (temp, k, p, mp, rp) in enumerate(GRID[5::27])
    ]  # 8 settings of the grid: each filter on in some rows, off in others
    params += [SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=1.0, top_k=900)]
    logits = random_logits(len(params), vocab, seed=29, ties=ties).to(dtype)
    t = tensors(params, random_seen(len(params), vocab, seed=31), offsets=list(range(len(params))), vocab=vocab)
    whole_tokens, whole_mask = sample_with_mask(logits, t)  # V <= CHUNK: one program per row
    split_tokens, split_mask = sample_with_mask(logits, t, chunk=256)
    assert torch.equal(whole_mask, processed_probs(logits, t) > 0)
    assert (split_mask != whole_mask).sum().item() == 0
    assert split_tokens.tolist() == whole_tokens.tolist()


def test_ties_at_the_thresholds_are_all_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]], device=DEVICE)
    # top_k = 2: the 2nd largest prob is shared by tokens 1, 2, 3 -> all three kept with token 0
    _, keep = sample_with_mask(logits, tensors([SamplingParams(top_k=2)], vocab=5))
    assert keep[0].tolist() == [True, True, True, True, False]
    # top_p just above p0: the running mass reaches it at token 1, tied with tokens 2 and 3
    p0 = float(torch.softmax(logits[0], -1)[0])
    _, keep = sample_with_mask(logits, tensors([SamplingParams(top_p=p0 + 0.01)], vocab=5))
    assert keep[0].tolist() == [True, True, True, True, False]
    _, keep = sample_with_mask(logits, tensors([SamplingParams(top_p=p0 - 0.01)], vocab=5))
    assert keep[0].tolist() == [True, False, False, False, False]


# ---- the draw follows processed_probs ----

# chi-square critical values at p = 0.001, by degrees of freedom (standard tables; scipy is not a dependency)
CHI2_CRIT_0_001 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}


def test_draws_follow_processed_probs():
    """One row per draw, same logits, offsets 0..n-1: 1500 draws in the interpreter, 10^6 on a GPU.

    1500 draws keep every allowed token's expected count above 25 (its smallest probability is 0.019), where
    the chi-square test is sound; each interpreted row costs a program instance, so more buys CI time only.
    """
    n, vocab = (10**6 if DEVICE.type == "cuda" else 1500), 64
    logits = torch.full((vocab,), -4.0)
    logits[:9] = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, 2.5, 1.0, -1.0])
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[6] = True  # the best token is penalized: 2.5 / 1.5 = 1.667
    params = SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.5, seed=123)
    logits, seen = logits.to(DEVICE).expand(n, vocab), seen.to(DEVICE).expand(n, vocab)
    t = tensors([params] * n, seen, offsets=list(range(n)), vocab=vocab)  # seeds from the params: 123
    probs = processed_probs(logits[:1], tensors([params], seen[:1], vocab=vocab))[0].double().cpu()  # [V]
    allowed = probs > 0
    assert 4 <= int(allowed.sum()) <= 10
    counts = torch.bincount(sample(logits, t).cpu(), minlength=vocab).double()
    assert counts[~allowed].sum() == 0, f"drew tokens outside the allowed set: {counts.tolist()}"
    expected = n * probs[allowed]
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    dof = int(allowed.sum()) - 1
    assert chi2 < CHI2_CRIT_0_001[dof], f"chi2 {chi2:.2f} >= {CHI2_CRIT_0_001[dof]} (dof {dof}): {counts.tolist()}"


# ---- determinism ----


def test_same_seed_and_offset_give_the_same_token_in_any_batch():
    vocab = 1000
    logits = torch.zeros(6, vocab, device=DEVICE)  # uniform: any change of stream shows
    logits[:, :500] += random_logits(1, 500, seed=23)  # and a non-uniform half
    params = [SamplingParams(temperature=1.0, min_p=0.02, seed=s) for s in range(5)]
    params.append(SamplingParams(temperature=0.8, top_p=0.95, top_k=100, seed=5))
    offsets = [3, 0, 9, 1, 4, 2]
    batched = sample(logits, tensors(params, offsets=offsets, vocab=vocab))
    assert torch.equal(batched, sample(logits, tensors(params, offsets=offsets, vocab=vocab)))
    for row in (0, 5):
        alone = sample(logits[row : row + 1], tensors([params[row]], offsets=[offsets[row]], vocab=vocab))
        assert alone.item() == batched[row].item()
    reversed_batch = sample(logits.flip(0), tensors(params[::-1], offsets=offsets[::-1], vocab=vocab))
    assert torch.equal(reversed_batch.flip(0), batched)


def test_offsets_and_seeds_give_different_streams():
    n, vocab = 64, 1000
    logits = torch.zeros(n, vocab, device=DEVICE)  # uniform over 1000 tokens
    a = sample(logits, tensors([SamplingParams(seed=1)] * n, offsets=list(range(n)), vocab=vocab))
    b = sample(logits, tensors([SamplingParams(seed=2)] * n, offsets=list(range(n)), vocab=vocab))
    assert len(set(a.tolist())) > 50  # 64 uniform draws from 1000: a few collisions at most
    assert (a != b).sum() > 50


# ---- the registry stage ----


def test_stage_runs_the_kernel():
    stage = STAGES["sampling"]
    assert stage.triton_kind.startswith("triton")
    kwargs = stage.example_inputs(get_preset("tiny"), 7, DEVICE, torch.bfloat16)
    tokens = stage.run("triton", **kwargs)
    assert tokens.shape == (7,) and tokens.dtype == torch.int64
    greedy = kwargs["sampling"].greedy
    assert torch.equal(tokens[greedy], stage.run("naive", **kwargs)[greedy])
    probs = processed_probs(**kwargs)
    assert bool(probs[torch.arange(7, device=tokens.device), tokens].gt(0).all())


# ---- launcher errors ----


def test_launcher_rejects_bad_inputs():
    vocab = 16
    t = tensors([SamplingParams()] * 2, vocab=vocab)
    logits = torch.zeros(2, vocab, device=DEVICE)
    with pytest.raises(KernelInputError, match="logits must be 2-D"):
        sample(logits[0], t)
    with pytest.raises(KernelInputError, match="logits has dtype int64"):
        sample(logits.long(), t)
    with pytest.raises(KernelInputError, match="contiguous last dimension"):
        sample(torch.zeros(vocab, 2, device=DEVICE).t(), t)
    with pytest.raises(KernelInputError, match=r"sampling.seen has shape \[2, 16\], expected \[3, 16\]"):
        sample(torch.zeros(3, vocab, device=DEVICE), t)
    with pytest.raises(KernelInputError, match=r"sampling.seen has shape \[2, 16\], expected \[2, 17\]"):
        sample(torch.zeros(2, vocab + 1, device=DEVICE), t)
    short = tensors([SamplingParams()] * 2, vocab=vocab)
    short.temperature = short.temperature[:1]
    with pytest.raises(KernelInputError, match=r"sampling.temperature has shape \[1\], expected \[2\]"):
        sample(logits, short)
    wrong = tensors([SamplingParams()] * 2, vocab=vocab)
    wrong.top_k = wrong.top_k.int()
    with pytest.raises(KernelInputError, match="sampling.top_k has dtype int32, expected int64"):
        sample(logits, wrong)
