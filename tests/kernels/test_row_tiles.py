"""The row kernels' tile helpers (`kernels/row_tiles.py`) and the GPU autotuner's wiring.

The tile rules are pure functions of shapes: checked here at Llama-3-8B and
SmolLM2 shapes, the numbers the kernels' docstrings quote. The autotuned
launch path cannot run under the interpreter with several candidates, so the
wiring test sends each autotuned kernel through `triton.autotune` with one
candidate: that proves the key names are kernel arguments and the grid reads
the tuned meta-parameters, which is what a GPU run relies on.
"""

import pytest
import torch

import stagewise.kernels.activation as activation_kernel
import stagewise.kernels.embedding as embedding_kernel
import stagewise.kernels.kv_store as kv_store_kernel
import stagewise.kernels.row_tiles as row_tiles
from stagewise.kernels.row_tiles import TileConfig, gpu_candidates, token_bucket, tokens_per_program, warps_for
from stagewise.stages.attention_metadata import AttentionMetadata
from stagewise.stages.embedding import naive as embedding_naive
from stagewise.stages.ffn import silu_and_mul_naive
from stagewise.stages.kv_store import naive as kv_store_naive
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "num_tokens, per_token, budget, expected",
    [
        (65536, 1024, 4096, 4),  # Llama-3-8B K: 4 tokens of 1024 elements
        (65536, 2560, 4096, 1),  # a token wider than half the budget: one per program
        (65536, 8192, 4096, 1),  # wider than the budget: still one
        (3, 16, 4096, 4),  # never more than T rounded up to a power of 2
        (1, 16, 4096, 1),
        (10**6, 1, 10**6, row_tiles.MAX_TOKENS_PER_PROGRAM),  # capped
    ],
)
def test_tokens_per_program(num_tokens, per_token, budget, expected):
    assert tokens_per_program(num_tokens, per_token, budget) == expected


def test_warps_bucket_and_candidates():
    assert (warps_for(4096), warps_for(4097)) == (4, 8)
    assert [token_bucket(t) for t in (1, 5, 64, 65, 10**9)] == [1, 8, 64, 128, row_tiles.MAX_BUCKET]
    best = TileConfig(block_t=4, num_warps=4, block_c=2048)
    candidates = gpu_candidates(best)
    assert best in candidates and len(set(candidates)) == len(candidates) == 6
    assert {c.block_t for c in candidates} == {2, 4, 8} and {c.block_c for c in candidates} == {2048}
    assert gpu_candidates(TileConfig(1, 4))[0].block_t == 1  # no zero-token tile
    assert TileConfig(2, 8, 1024).meta() == {"BLOCK_T": 2, "BLOCK_C": 1024}
    assert TileConfig(2, 8).meta() == {"BLOCK_T": 2}


def _through_autotuner(monkeypatch, module):
    """Route `module`'s launches through triton.autotune with their one candidate; -> the tuners used."""
    used = []

    def launch(kernel, candidates, key, grid, **args):
        assert len(candidates) == 1  # the interpreter plans one tile; a GPU plans several
        tuner = row_tiles.autotuner(kernel, candidates, key)
        used.append(tuner)
        tuner[grid](**args)

    monkeypatch.setattr(module, "launch", launch)
    return used


def _keys_are_arguments(tuner) -> bool:
    """Triton ignores a key name that is no argument (every T would then share one tuning): check them."""
    return "tokens_bucket" in tuner.keys and set(tuner.keys) <= set(tuner.arg_names)


def test_kv_store_through_the_autotuner(monkeypatch):
    used = _through_autotuner(monkeypatch, kv_store_kernel)
    monkeypatch.setattr(kv_store_kernel, "TOKEN_TILE", 4 * 2 * 16)  # BLOCK_T = 4 for 7 tokens: a ragged last tile
    k, v = torch.randn(2, 7, 2, 16, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 9, 2, -1, 7], device=DEVICE)
    ours = [torch.zeros(10, 2, 16, device=DEVICE) for _ in range(2)]
    ref = [c.clone() for c in ours]
    kv_store_kernel.kv_store(k, v, *ours, slots)
    kv_store_naive(k, v, *ref, AttentionMetadata.build([7], [7], DEVICE, slot_mapping=slots.tolist()))
    assert len(used) == 1 and _keys_are_arguments(used[0])
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


def test_embedding_through_the_autotuner(monkeypatch):
    used = _through_autotuner(monkeypatch, embedding_kernel)
    weight = torch.randn(11, 40, device=DEVICE)
    ids = torch.tensor([3, 10, 0, 3, 7], device=DEVICE)
    assert torch.equal(embedding_kernel.embedding(ids, weight), embedding_naive(ids, weight))
    assert len(used) == 1 and _keys_are_arguments(used[0])


def test_silu_and_mul_through_the_autotuner(monkeypatch):
    used = _through_autotuner(monkeypatch, activation_kernel)
    gate_up = torch.randn(5, 2 * 48, device=DEVICE)
    out = activation_kernel.silu_and_mul(gate_up)
    assert_close(out, silu_and_mul_naive(gate_up), *TOLERANCES[torch.float32], what="silu_and_mul")
    assert len(used) == 1 and _keys_are_arguments(used[0])
