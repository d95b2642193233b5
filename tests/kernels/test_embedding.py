"""Triton embedding gather vs the naive `weight[ids]`: exact, since a gather does no arithmetic.

Chain: a hand-checkable worked example -> irregular shapes and dtypes -> the
registry stage -> the launcher's errors. Runs in the CPU interpreter (compiled on a GPU).
"""

import pytest
import torch

from stagewise.config import PRESETS
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.embedding import embedding
from stagewise.stages import STAGES
from stagewise.stages.embedding import naive

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_table(vocab: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(vocab, hidden, generator=gen).to(DEVICE, dtype)


def test_worked_example():
    # Row r of the table is [10r, 10r + 1, 10r + 2]; ids [2, 0, 2] pick rows 2, 0, 2.
    weight = (10 * torch.arange(4).unsqueeze(1) + torch.arange(3)).float().to(DEVICE)  # [4, 3]
    out = embedding(torch.tensor([2, 0, 2], device=DEVICE), weight)
    assert out.tolist() == [[20.0, 21.0, 22.0], [0.0, 1.0, 2.0], [20.0, 21.0, 22.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 100])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_matches_naive(num_tokens, hidden, dtype):
    vocab = 50
    weight = random_table(vocab, hidden, dtype)
    ids = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)).to(DEVICE)
    ids[0] = vocab - 1  # the last row of the table
    out = embedding(ids, weight)
    assert out.dtype == dtype
    assert torch.equal(out, naive(ids, weight))  # a copy: bit-exact in every dtype


def test_int32_ids_and_repeated_ids():
    weight = random_table(20, 96, torch.float32)
    ids = torch.tensor([3, 3, 0, 19, 3], dtype=torch.int32, device=DEVICE)
    assert torch.equal(embedding(ids, weight), naive(ids.long(), weight))


def test_row_wider_than_one_block():
    # hidden 1100 > 1024 columns per program: each row is copied by two programs, the second masked.
    weight = random_table(5, 1100, torch.float32)
    ids = torch.tensor([4, 1], device=DEVICE)
    assert torch.equal(embedding(ids, weight), naive(ids, weight))


def test_no_tokens():
    weight = random_table(5, 96, torch.float32)
    out = embedding(torch.zeros(0, dtype=torch.long, device=DEVICE), weight)
    assert out.shape == (0, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_registry_stage(num_tokens, dtype):
    stage = STAGES["embedding"]
    inputs = stage.example_inputs(PRESETS["tiny"], num_tokens, DEVICE, dtype)
    assert torch.equal(stage.optimized(**inputs), stage.naive(**inputs))
    assert stage.optimized_kind.startswith("triton")


@pytest.mark.parametrize(
    "ids, weight, message",
    [
        (torch.tensor([0, 5]), torch.zeros(5, 8), r"ids must lie in \[0, 5\).*max 5"),
        (torch.tensor([-1, 2]), torch.zeros(5, 8), r"ids must lie in \[0, 5\).*min -1"),
        (torch.tensor([0.0, 1.0]), torch.zeros(5, 8), "ids has dtype float32"),
        (torch.tensor([0, 1]), torch.zeros(5, 8, dtype=torch.int64), "weight has dtype int64"),
        (torch.tensor([0, 1]), torch.zeros(8, 5).t(), "weight must be contiguous"),
        (torch.tensor([[0, 1]]), torch.zeros(5, 8), "ids must be 1-D"),
        (torch.tensor([0, 1]), torch.zeros(5), "weight must be 2-D"),
    ],
)
def test_launcher_errors(ids, weight, message):
    with pytest.raises(KernelInputError, match=message):
        embedding(ids.to(DEVICE), weight.to(DEVICE))
