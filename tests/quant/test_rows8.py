"""The rows8 layout (quant/rows8.py): where each code and scale goes, and the exact way back."""

import pytest
import torch

from stagewise.quant import rows8
from stagewise.quant.packed_weight import PackedWeight


def test_a_worked_octet():
    """One block of 8 rows: row j's bytes 4t..4t+3 sit at 32 t + 4 j; its scale after the codes."""
    codes = torch.arange(8 * 16, dtype=torch.uint8).view(8, 16)  # row j, byte i -> 16 j + i
    scales = torch.arange(8, dtype=torch.float16).view(8, 1)
    form = rows8.pack(PackedWeight("q4_0", codes, scales))
    assert form.shape == (1, 1, 128 + 16)
    for t in range(4):
        for j in range(8):
            assert form[0, 0, 32 * t + 4 * j : 32 * t + 4 * j + 4].tolist() == codes[j, 4 * t : 4 * t + 4].tolist()
    assert torch.equal(form[0, 0, 128:].view(torch.float16), scales.flatten())


@pytest.mark.parametrize(("kind", "n"), [("q4_1", 13), ("q8_0", 24), ("q5_k", 9)])
def test_unpack_gives_back_every_code(kind, n):
    gen = torch.Generator().manual_seed(0)
    k = 96
    if kind == "q8_0":
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    elif kind == "q5_k":
        codes = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    dtype = torch.float32 if kind == "q5_k" else torch.float16
    scales = torch.rand(n, k // 32, generator=gen).to(dtype)
    mins = None if kind == "q8_0" else torch.rand(n, k // 32, generator=gen).to(dtype)
    w = PackedWeight(kind, codes, scales, mins)
    form = rows8.pack(w)
    assert form.shape == (-(-n // 8), k // 32, rows8.chunk_bytes(w))
    assert torch.equal(rows8.unpack_rows(form, w.bits, None)[:n], codes)
    rows = torch.tensor([n - 1, 0, 5, 5])
    assert torch.equal(rows8.unpack_rows(form, w.bits, rows), codes[rows])


def test_kinds_without_the_form_are_refused():
    w = PackedWeight("q6_k", torch.zeros(8, 32, dtype=torch.int8), torch.ones(8, 2))
    assert not rows8.has_form(w)
    with pytest.raises(ValueError, match="q6_k"):
        rows8.pack(w)
