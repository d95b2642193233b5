"""Solutions to the exercises of notebook 12b (the attention kernels)."""

import math

import torch


def my_merge_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:  # noqa: E741
    w = torch.exp(m - m.max())  # [S]: rescale every split to the common max
    return (w[:, None] * acc).sum(dim=0) / (w * l).sum()


def my_softmax_exp2(scores: torch.Tensor, scale: float) -> torch.Tensor:
    x = scores * (scale * math.log2(math.e))  # exp(s * scale) == exp2(s * scale * log2(e))
    p = torch.exp2(x - x.max(dim=-1, keepdim=True).values)
    return p / p.sum(dim=-1, keepdim=True)


SOLUTIONS = {"12b.merge_splits": my_merge_splits, "12b.softmax_exp2": my_softmax_exp2}
