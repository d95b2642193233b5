"""Checks for the exercises of notebook 17 (batch invariance): split-KV attention that no batch can change.

A decode kernel may split a row's keys across several programs and merge their
partial results. Two tasks, one rule each:

    17.key_splits      which keys each split reduces: a fixed *size* (64 keys,
                       at absolute positions 0, 64, 128, ...), never a count chosen
                       from the batch, so a row's splits are the same whoever
                       shares the step and whatever the row is padded to
    17.combine_splits  merging the splits' partial states (max, sum, weighted
                       values) in order, so that empty splits (the padding past a
                       row's end, when a longer neighbour sets the length) change
                       no bit of the result

The reference is `stages/chunked_attention.py`'s rule (CHUNK_KEYS) and the
textbook softmax; each check also runs the student's function over calls that
differ only in what the batch would change, and requires the same bits.
"""

import torch

from stagewise.exercises.core import Mismatch, call, close, equal
from stagewise.stages.chunked_attention import CHUNK_KEYS

SPLIT_CASES = [(1, 1), (63, 4), (64, 2), (65, 8), (200, 3), (200, 16), (1000, 5), (4097, 132)]


def _reference_splits(num_keys: int) -> list[tuple[int, int]]:
    return [(c, min(c + CHUNK_KEYS, num_keys)) for c in range(0, num_keys, CHUNK_KEYS)]


def _as_pairs(got, what: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in got]
    except (TypeError, ValueError):
        raise Mismatch(f"{what}: expected a list of (start, end) pairs, got {got!r:.80}") from None


def check_key_splits(fn) -> str:
    """my_key_splits(num_keys, num_programs) -> [(start, end), ...]: the keys each split reduces."""
    for num_keys, programs in SPLIT_CASES:
        got = _as_pairs(call(fn, num_keys, programs), f"{num_keys} keys, {programs} programs")
        for other in (1, 7, 64):  # the batch decides how many programs would like a share
            again = _as_pairs(call(fn, num_keys, other), f"{num_keys} keys, {other} programs")
            if again != got:
                raise Mismatch(
                    f"{num_keys} keys: {programs} programs give {got[:3]}..., {other} give {again[:3]}...: "
                    "the splits depend on the batch"
                )
        equal(got, _reference_splits(num_keys), f"splits of {num_keys} keys")
    return f"{len(SPLIT_CASES)} key counts: fixed {CHUNK_KEYS}-key splits, whatever the programs"


def _partials(scores: torch.Tensor, values: torch.Tensor, pad_splits: int) -> list[tuple]:
    """Each 64-key split's (max, sum of exp, exp-weighted values), then `pad_splits` empty splits."""
    parts = []
    for start, end in _reference_splits(scores.shape[0]):
        s, v = scores[start:end], values[start:end]  # [C], [C, d]
        m = s.max()
        p = torch.exp(s - m)  # [C]
        parts.append((m, p.sum(), p @ v))  # acc [d]
    empty = (torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(values.shape[1]))
    return parts + [empty] * pad_splits


def check_combine_splits(fn) -> str:
    """my_combine_splits(parts) -> out [d]: merge [(m, l, acc)] per split into softmax(scores) @ values."""
    gen = torch.Generator().manual_seed(17)
    for num_keys in (5, 64, 150, 300):
        scores = 4 * torch.randn(num_keys, generator=gen)  # [L]
        values = torch.randn(num_keys, 8, generator=gen)  # [L, d]
        want = torch.softmax(scores, dim=0) @ values  # [d]: the textbook
        got = call(fn, _partials(scores, values, 0))
        close(got, want, f"{num_keys} keys in {len(_reference_splits(num_keys))} splits", atol=1e-5, rtol=1e-5)
        for pad in (1, 3):  # a longer neighbour: the row's splits, then empty ones
            padded = call(fn, _partials(scores, values, pad))
            if not isinstance(padded, torch.Tensor) or not torch.equal(padded, got):
                raise Mismatch(
                    f"{num_keys} keys and {pad} empty split(s) after them: not the same bits as without "
                    "(empty splits must add exact zeros)"
                )
    return "4 key counts: softmax @ values within 1e-5, the same bits with empty splits appended"


CHECKS = {"17.key_splits": check_key_splits, "17.combine_splits": check_combine_splits}
