"""The rejection sampler's textbook version: a worked example, bad inputs, and its law is p."""

import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.stages import STAGES
from stagewise.stages.rejection_sampling import naive

T = torch.tensor


def worked_example(draft_probs: bool = False) -> dict:
    """Three sequences over a 4-token vocabulary, checkable by hand (see the test)."""
    target = T(
        [
            [0.1, 0.2, 0.6, 0.1],  # seq 0, draft 0 (token 2)
            [0.4, 0.3, 0.2, 0.1],  # seq 0, draft 1 (token 1)
            [0.9, 0.0, 0.0, 0.1],  # seq 0, bonus (never reached)
            [0.1, 0.1, 0.1, 0.7],  # seq 1, draft 0 (token 3)
            [0.2, 0.5, 0.2, 0.1],  # seq 1, bonus
            [0.25, 0.25, 0.25, 0.25],  # seq 2, bonus (no drafts)
        ]
    )
    q = T(
        [
            [0.1, 0.1, 0.7, 0.1],
            [0.1, 0.6, 0.2, 0.1],
            [0.0, 0.0, 0.0, 1.0],  # seq 1 is greedy: its q is never read
        ]
    )
    return {
        "draft_token_ids": T([2, 1, 3]),
        "cu_num_draft_tokens": T([0, 2, 3, 3], dtype=torch.int32),
        "draft_probs": q if draft_probs else None,
        "target_probs": target,
        "is_greedy": T([False, True, False]),
        "uniform": T([0.5, 0.5, 0.9]),
        "exponential": T([[1.0, 1.0, 0.1, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.5, 1.0, 4.0]]),
    }


def test_worked_example_point_mass():
    """By hand, n-gram drafts (q a point mass, so the test is u < p(x)):

    seq 0 (sampling): draft 2, u = 0.5 < p(2) = 0.6, accepted; draft 1, u = 0.5 >= p(1) = 0.3,
      rejected; residual = p with token 1 zeroed = [0.4, 0, 0.2, 0.1]; race r / E with
      E = [1, 1, 0.1, 1]: scores [0.4, -, 2.0, 0.1] -> token 2. Output [2, 2], 2 tokens.
    seq 1 (greedy): draft 3 = argmax [0.1, 0.1, 0.1, 0.7], accepted; bonus argmax -> 1. [3, 1].
    seq 2 (sampling, no drafts): bonus p uniform, E = [2, 0.5, 1, 4]: scores 1/8, 1/2, 1/4, 1/16
      -> token 1. [1, 0 (padding)], 1 token.
    """
    out, counts = naive(**worked_example())
    assert out.tolist() == [[2, 2, 0], [3, 1, 0], [1, 0, 0]]
    assert counts.tolist() == [2, 2, 1]
    assert out.dtype == torch.int64 and counts.dtype == torch.int32


def test_worked_example_draft_probs():
    """With q rows: seq 0's draft 2 is accepted (0.5 * q(2) = 0.35 < 0.6); draft 1 is rejected
    (0.5 * q(1) = 0.3, not < p(1) = 0.3); residual max(0, p - q) = [0.3, 0, 0, 0] -> token 0."""
    out, counts = naive(**worked_example(draft_probs=True))
    assert out.tolist() == [[2, 0, 0], [3, 1, 0], [1, 0, 0]]
    assert counts.tolist() == [2, 2, 1]


def test_residual_zero_draws_from_p():
    """The guess has p = q = 0 (rejected: 0 * 0 < 0 fails) and q equals p elsewhere, so the
    residual max(0, p - q) is zero everywhere: the replacement is drawn from p itself."""
    p = T([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    inputs = {
        "draft_token_ids": T([2]),
        "cu_num_draft_tokens": T([0, 1], dtype=torch.int32),
        "draft_probs": T([[0.5, 0.5, 0.0]]),
        "target_probs": p,
        "is_greedy": T([False]),
        "uniform": T([0.0]),
        "exponential": T([[4.0, 1.0, 1.0]]),
    }
    out, counts = naive(**inputs)
    assert out.tolist() == [[1, 0]] and counts.tolist() == [1]  # race over p: 0.125 vs 0.5


def test_greedy_ties_take_the_first_index():
    inputs = {
        "draft_token_ids": T([1]),
        "cu_num_draft_tokens": T([0, 1], dtype=torch.int32),
        "draft_probs": None,
        "target_probs": T([[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]),
        "is_greedy": T([True]),
        "uniform": T([0.0]),
        "exponential": torch.ones(1, 3),
    }
    out, counts = naive(**inputs)
    assert out.tolist() == [[0, 0]] and counts.tolist() == [1]  # argmax ties -> 0 != 1: rejected
    inputs["draft_token_ids"] = T([0])
    out, counts = naive(**inputs)
    assert out.tolist() == [[0, 1]] and counts.tolist() == [2]  # bonus tie -> 1


def test_max_num_draft_tokens_fixes_the_width():
    out, _ = naive(**worked_example(), max_num_draft_tokens=4)
    assert out.shape == (3, 5)
    with pytest.raises(StagewiseError, match="max_num_draft_tokens = 1, but a sequence has 2"):
        naive(**worked_example(), max_num_draft_tokens=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"draft_token_ids": T([2, 1, 3], dtype=torch.int32)}, "draft_token_ids has dtype"),
        ({"cu_num_draft_tokens": T([0, 2, 3], dtype=torch.int32)}, "expected num_seqs + 1 = 4"),
        ({"cu_num_draft_tokens": T([0, 2, 1, 3], dtype=torch.int32)}, "must rise from 0"),
        ({"target_probs": torch.rand(5, 4)}, "target_probs has 5 rows"),
        ({"target_probs": torch.rand(6, 4).double()}, "target_probs has dtype"),
        ({"uniform": torch.rand(2)}, "uniform has 2 entries"),
        ({"exponential": torch.rand(3, 5)}, "exponential has shape [3, 5]"),
        ({"draft_probs": torch.rand(3, 5)}, "draft_probs has shape [3, 5]"),
        ({"is_greedy": T([0, 1, 0])}, "is_greedy has dtype"),
    ],
)
def test_bad_inputs_refused_in_one_line(change, message):
    inputs = worked_example() | change
    with pytest.raises(StagewiseError, match=r"^rejection_sampling: .*") as info:
        naive(**inputs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_registered():
    stage = STAGES["rejection_sampling"]
    assert stage.outputs == ("output_token_ids", "num_output_tokens")
    assert stage.triton_kind.startswith("triton")


# ---- statistics: the output's law is the target's p, whatever q ----

# chi-square critical values at p = 0.001 by degrees of freedom (standard tables): a correct
# sampler fails one such check with probability 1/1000 on a fresh seed; the seeds here are fixed,
# so the test is deterministic
CHI2_CRIT_0_001 = {3: 16.266, 4: 18.467}
P = [T([0.5, 0.2, 0.15, 0.1, 0.05]), T([0.1, 0.1, 0.3, 0.2, 0.3])]  # target rows of positions 0, 1
Q = T([[0.1, 0.4, 0.1, 0.3, 0.1], [0.3, 0.3, 0.1, 0.2, 0.1]])  # the draft's: far from p
N = 4000  # sequences, each one seeded trial


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = tokens.shape[0] * probs.double()
    return float(((counts - expected) ** 2 / expected).sum())


def trials(point_mass: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences of two guesses x_i ~ q_i (or fixed guesses for the point mass) through naive."""
    g = torch.Generator().manual_seed(seed)
    vocab = P[0].shape[0]
    if point_mass:  # an n-gram proposer guesses the same token whatever p says
        drafts = T([1, 4]).repeat(N)
    else:
        drafts = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=g) for i in (0, 1)], 1)
        drafts = drafts.reshape(-1)  # [N * 2]
    bonus = T([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([P[0], P[1], bonus]).repeat(N, 1)  # [N * 3, V]
    out, counts = naive(
        draft_token_ids=drafts,
        cu_num_draft_tokens=torch.arange(0, 2 * N + 1, 2, dtype=torch.int32),
        draft_probs=None if point_mass else Q.repeat(N, 1),
        target_probs=target,
        is_greedy=torch.zeros(N, dtype=torch.bool),
        uniform=torch.rand(2 * N, generator=g),
        exponential=torch.empty(N, vocab).exponential_(generator=g),
    )
    return out, counts


@pytest.mark.parametrize("point_mass", [True, False])
def test_output_follows_the_target(point_mass):
    """Position 0 is always p_0's; position 1, when the step reached it (first guess accepted),
    is p_1's: an accepted guess and a residual draw add up to exactly p (the docstring's proof)."""
    out, counts = trials(point_mass, seed=11 if point_mass else 12)
    first = out[:, 0]
    second = out[counts >= 2, 1]
    assert 0.05 < (counts >= 2).double().mean() < 0.95  # guesses were both accepted and rejected
    assert chi2(first, P[0]) < CHI2_CRIT_0_001[4]
    assert chi2(second, P[1]) < CHI2_CRIT_0_001[4]
    # the check can fail: the same draws against the draft's q are far off
    assert chi2(first, Q[0]) > 10 * CHI2_CRIT_0_001[4]
