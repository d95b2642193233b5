"""Checks for the exercises of notebook 15 (speculative decoding), against the rejection sampler stage.

Both exercises are one sequence's part of `stages/rejection_sampling.py`; the
checks build seeded cases on a small vocabulary, run the stage's naive path
on them, and compare tokens exactly (the randomness is an input, so a right
answer gives the same tokens, not just the same distribution).
"""

import torch

from stagewise.exercises.core import Mismatch, call, equal
from stagewise.stages import STAGES

VOCAB = 6  # small, so guesses are often right and often wrong


def _stage(drafts, q, p, greedy: bool, uniform, exponential):
    """The stage on one sequence -> the tokens it outputs (accepted guesses + the target's one)."""
    out, counts = STAGES["rejection_sampling"].naive(
        draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor([0, len(drafts)], dtype=torch.int32),
        draft_probs=q,
        target_probs=p,
        is_greedy=torch.tensor([greedy]),
        uniform=uniform,
        exponential=exponential[None, :],
    )
    return out[0, : int(counts[0])].tolist()


def check_greedy_accept(fn) -> str:
    """my_greedy_accept(drafts: list[int], target_probs [k + 1, V]) -> list[int]: the tokens kept."""
    g = torch.Generator().manual_seed(15)
    kept_all = 0
    for case in range(40):
        k = case % 5  # 0 .. 4 guesses
        p = torch.softmax(2 * torch.randn(k + 1, VOCAB, generator=g), dim=-1)  # [k + 1, V]
        best = p.argmax(dim=-1).tolist()
        wrong_at = int(torch.randint(0, k + 1, (1,), generator=g))  # k: every guess right
        drafts = [best[i] if i < wrong_at else (best[i] + 1) % VOCAB for i in range(k)]
        want = _stage(drafts, None, p, True, torch.zeros(k), torch.ones(VOCAB))
        kept_all += len(want) == k + 1
        got = call(fn, list(drafts), p.clone())
        equal(list(got), want, f"case {case}: drafts {drafts}, target argmaxes {best}")
    return f"40 sequences of 0-4 guesses ({kept_all} with every guess kept) agree with the stage"


def check_rejection_step(fn) -> str:
    """my_rejection_step(p [V], q [V], x, u, exponential [V]) -> (accepted: bool, token: int)."""
    g = torch.Generator().manual_seed(16)
    accepted = 0
    for case in range(60):
        p = torch.softmax(1.5 * torch.randn(VOCAB, generator=g), dim=-1)  # [V]
        q = torch.softmax(1.5 * torch.randn(VOCAB, generator=g), dim=-1)  # [V]: a different guesser
        x = int(torch.multinomial(q, 1, generator=g))
        u = torch.rand(1, generator=g)
        e = torch.empty(VOCAB).exponential_(generator=g)
        bonus = torch.full((1, VOCAB), 1.0 / VOCAB)  # the row after the guess (unused when rejected)
        tokens = _stage([x], q[None, :], torch.cat([p[None, :], bonus]), False, u, e)
        want = (len(tokens) == 2, tokens[0])
        accepted += want[0]
        got = call(fn, p.clone(), q.clone(), x, float(u), e.clone())
        if not isinstance(got, tuple) or len(got) != 2:
            raise Mismatch(f"return (accepted, token), got {got!r}")
        equal(got[0], want[0], f"case {case}: accepted? (x={x}, u={float(u):.3f}, p(x)={float(p[x]):.3f}, "
              f"q(x)={float(q[x]):.3f})")  # fmt: skip
        equal(int(got[1]), want[1], f"case {case}: the token out (accepted {want[0]})")
    return f"60 guesses ({accepted} accepted, {60 - accepted} rejected and redrawn) agree with the stage"


CHECKS = {"15.greedy_accept": check_greedy_accept, "15.rejection_step": check_rejection_step}
