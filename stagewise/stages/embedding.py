"""Stage 2: embedding lookup — token ids become rows of the embedding table.

    ids [T] -> hidden_states [T, hidden]

The naive reference is one indexing expression, `weight[ids]`: a gather of
`T` rows out of a `[vocab, hidden]` table. There is no arithmetic at all; the
stage is pure memory traffic (T * hidden * bytes read and written), which is
why the Triton tier is a plain gather kernel that copies rows with wide,
coalesced loads.

The Triton kernel (`kernels/embedding.py`) runs one program per (tile of
tokens, block of up to 4096 columns): one load of the tile's ids, one masked
load of their table rows, one store, nothing else, so it runs near copy
bandwidth. With debug checks on (`STAGEWISE_DEBUG_CHECKS=1`) its launcher
first checks that every id is inside the vocabulary (a kernel would silently
read other memory); that costs a device sync (a min/max of the T ids read
back), so an engine step runs without it.

A table kept quantized (`PackedWeight`, SmolLM2's Q8_0) is read by rows: the
T rows asked for are expanded by the block formula (`dequantize.gather_rows`).
When the table is also the tied LM head, the torch tier holds its codes in its
own layout only, and those T rows' codes are rebuilt from it (T x hidden bytes
read, not the table: `PackedWeight.code_rows`).
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.dequantize import gather_rows
from stagewise.quant.packed_weight import is_packed
from stagewise.stages.base import Stage


def naive(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [T] int64, weight [vocab, hidden] -> [T, hidden] (a packed table: float32 rows)."""
    if is_packed(weight):  # kept quantized: only the T rows asked for are expanded
        return gather_rows(weight, ids, torch.float32)
    return weight[ids]  # [vocab, hidden][T] -> [T, hidden]


def triton(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton gather: one program per (tile of tokens, column block) copies its slice of rows."""
    # lazily: importing kernels picks GPU or interpreter
    from stagewise.kernels.embedding import embedding

    if is_packed(weight):  # a packed table: the rows expanded by the naive formula (T rows)
        return gather_rows(weight, ids, torch.float32)
    return embedding(ids, weight)  # [T] -> [T, hidden]


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=gen)
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=gen).to(dtype)
    return {"ids": ids.to(device), "weight": weight.to(device)}


STAGE = Stage(
    name="embedding",
    summary="look up one row of the embedding table per token id",
    shapes="[T] -> [T, hidden]",
    naive=naive,
    triton=triton,
    triton_kind="triton: row gather, one program per (tile of tokens, column block)",
    example_inputs=example_inputs,
    outputs=("hidden_states",),
    axes={"ids": "num_tokens", "weight": "vocab hidden", "hidden_states": "num_tokens hidden"},
)
