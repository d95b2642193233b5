"""The per-kernel sweep of the batch-invariance rule: a probe row's bits for every M and slot.

`distinct_results(run, ms)` calls run(m, slot) for each m and the slots `slots(m)` (first,
middle, last) and groups the probe's output rows by their bits: one group means the kernel is
row-invariant over the sweep; a test that must find a difference (the negative control) asks
for more than one.
"""

import torch

SWEEP_M = (1, 2, 3, 4, 5, 8, 16, 17, 64)  # across the 16-row decode tile, and 4 tiles of it


def slots(m: int) -> list[int]:
    """Where the probe row goes in a call of m rows: first, middle, last."""
    return sorted({0, m // 2, m - 1})


def distinct_results(run, ms=SWEEP_M) -> list[list[tuple[int, int]]]:
    """run(m, slot) -> the probe's output row. -> the distinct results, each as the list of the
    (m, slot) that gave it."""
    found: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []
    for m in ms:
        for slot in slots(m):
            row = run(m, slot)
            for seen, where in found:
                if torch.equal(seen, row):
                    where.append((m, slot))
                    break
            else:
                found.append((row.clone(), [(m, slot)]))
    return [where for _, where in found]


def assert_invariant(groups: list[list[tuple[int, int]]], what: str) -> None:
    summary = "; ".join(f"{len(g)} calls from (M, slot) {g[0]}" for g in groups)
    assert len(groups) == 1, f"{what}: the probe row came out {len(groups)} ways ({summary})"


def rows_with_probe(m: int, slot: int, probe: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """[m, *probe.shape] random rows of probe's dtype, the probe at `slot`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, *probe.shape, generator=gen).to(probe.dtype)
    x[slot] = probe
    return x
