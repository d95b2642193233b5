"""Solutions to the exercises of notebook 00 (the pipeline)."""

import itertools

import torch


def my_cu_seqlens(lengths: list[int]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))  # [B+1]: 0, L0, L0+L1, ...


def my_positions(lengths: list[int], start_positions: list[int]) -> list[int]:
    return [start + i for start, n in zip(start_positions, lengths) for i in range(n)]  # [T]


def my_greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)  # [B, V] -> [B]


SOLUTIONS = {"00.cu_seqlens": my_cu_seqlens, "00.positions": my_positions, "00.greedy": my_greedy}
