"""Solutions to the exercises of notebook 17 (batch invariance)."""

import torch

CHUNK_KEYS = 64  # keys per split: a fixed size, never a count


def my_key_splits(num_keys: int, num_programs: int) -> list[tuple[int, int]]:
    # the programs a batch would like do not matter: splits start at 0, 64, 128, ... of the row's keys
    return [(start, min(start + CHUNK_KEYS, num_keys)) for start in range(0, num_keys, CHUNK_KEYS)]


def my_combine_splits(parts: list[tuple]) -> torch.Tensor:
    top = torch.stack([m for m, _, _ in parts]).max()  # the row's max over every split
    num, den = 0.0, 0.0
    for m, total, acc in parts:  # in split order
        weight = torch.exp(m - top)  # an empty split (m = -inf) weighs exactly 0
        num = num + acc * weight
        den = den + total * weight
    return num / den


SOLUTIONS = {"17.key_splits": my_key_splits, "17.combine_splits": my_combine_splits}
