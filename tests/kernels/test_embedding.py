"""Triton embedding gather vs the naive `weight[ids]`: exact, since a gather does no arithmetic.

Chain: a hand-checkable worked example -> irregular shapes and dtypes -> the
registry stage -> the launcher's errors. Runs in the CPU interpreter (compiled on a GPU).
"""

import pytest
import torch

import stagewise.kernels.embedding as embedding_kernel
from stagewise.config import PRESETS
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.embedding import embedding
from stagewise.kernels.row_tiles import TileConfig
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
    # hidden 1100, 2 tokens: a short batch splits each row into 256-column blocks (5 per row, the last masked).
    (tile,) = embedding_kernel.embedding_tiles(2, 1100, interpreter=True)
    assert (tile.block_t, tile.block_c) == (1, 256)
    weight = random_table(5, 1100, torch.float32)
    ids = torch.tensor([4, 1], device=DEVICE)
    assert torch.equal(embedding(ids, weight), naive(ids, weight))


def test_tiles():
    # Llama-3-8B prefill: whole 4096-column rows, 2 tokens per program (16 KB of bf16), 8 warps.
    assert embedding_kernel.embedding_tiles(65536, 4096, interpreter=True) == (TileConfig(2, 8, 4096),)
    # Decode: one token's row split into 16 programs of 256 columns, so it spreads over SMs.
    assert embedding_kernel.embedding_tiles(1, 4096, interpreter=True) == (TileConfig(1, 4, 256),)
    candidates = embedding_kernel.embedding_tiles(65536, 4096, interpreter=False)
    assert TileConfig(2, 8, 4096) in candidates and len(candidates) > 1  # a GPU autotunes around it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_token_and_column_tiles(monkeypatch, dtype):
    # 4 tokens x 64 columns per program: 7 tokens -> tiles of 4 + 3; hidden 100 -> 64 + 36 columns.
    monkeypatch.setattr(embedding_kernel, "MAX_BLOCK", 64)
    monkeypatch.setattr(embedding_kernel, "TOKEN_TILE", 4 * 64)
    monkeypatch.setattr(embedding_kernel, "MIN_PROGRAMS", 1)
    assert embedding_kernel.embedding_tiles(7, 100, interpreter=True) == (TileConfig(4, 4, 64),)
    weight = random_table(30, 100, dtype)
    ids = torch.tensor([29, 0, 5, 5, 17, 2, 29], device=DEVICE)
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
    assert torch.equal(stage.triton(**inputs), stage.naive(**inputs))
    assert stage.triton_kind.startswith("triton")


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
