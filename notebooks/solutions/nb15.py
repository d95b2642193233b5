"""Solutions to the exercises of notebook 15 (speculative decoding)."""

import torch


def my_greedy_accept(drafts: list[int], target_probs: torch.Tensor) -> list[int]:
    kept = []
    for i, x in enumerate(drafts):
        best = int(target_probs[i].argmax())
        if x != best:
            return kept + [best]  # the target's token replaces the first wrong guess
        kept.append(x)
    return kept + [int(target_probs[len(drafts)].argmax())]  # every guess right: the bonus token


def my_rejection_step(p: torch.Tensor, q: torch.Tensor, x: int, u: float, exponential: torch.Tensor):
    if u * q[x] < p[x]:  # u < p(x) / q(x), without the division
        return True, x
    residual = (p - q).clamp(min=0.0)  # what q under-proposed
    if not bool((residual > 0).any()):
        residual = p
    scores = torch.where(residual > 0, residual / exponential, -1.0)  # the exponential race
    return False, int(scores.argmax())


SOLUTIONS = {"15.greedy_accept": my_greedy_accept, "15.rejection_step": my_rejection_step}
