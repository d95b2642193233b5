"""Stage 8: LM head — only the last token of each sequence becomes logits.

    hidden [T, hidden] --gather last_token_index [num_seqs]--> [num_seqs, hidden]
    [num_seqs, hidden] @ w_lm [hidden, vocab] -> logits [num_seqs, vocab]

Only the last position of each sequence predicts the next token, so the rows
of a long prefill are dropped *before* the GEMM: a 1000-token prompt costs one
row of the [hidden, vocab] product, not 1000.

`w_lm` has the shape [in, out] = [hidden, vocab] like every other projection.
With tied embeddings (SmolLM2) it holds the same numbers as the embedding table
[vocab, hidden]: on a CPU it *is* the table, seen through a transposed view
(the layout the torch tier streams fastest); on a GPU it is a contiguous
[hidden, vocab] copy made at load time. Decode reads the whole matrix every
step: 113 MB in fp32 for SmolLM2, a fifth of all weights.

A packed head (a GGUF's Q8_0 table) goes through `stages/dequant_gemm.py`.

Torch tier (`stages/gemm_torch.py`): the same gather, then the GEMM in the CPU
BLAS form measured fastest at load.

Triton: one Triton GEMM (`kernels/matmul.py`) that reads the rows of
`hidden` through `last_token_index` (no gathered copy): only the vocab matrix
and the selected rows leave memory.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.packed_weight import is_packed
from stagewise.stages import dequant_gemm, gemm_torch
from stagewise.stages.base import Stage


def naive(hidden: torch.Tensor, last_token_index: torch.Tensor, w_lm: torch.Tensor) -> torch.Tensor:
    """hidden [T, hidden], last_token_index [B], w_lm [hidden, vocab] -> logits [B, vocab]."""
    last = hidden[last_token_index]  # [T, hidden] -> [num_seqs, hidden]
    if is_packed(w_lm):  # kept quantized (SmolLM2's Q8_0 table): the dequantize-GEMM stage
        return dequant_gemm.naive(last, w_lm)
    return last @ w_lm  # [num_seqs, hidden] @ [hidden, vocab] -> [num_seqs, vocab]


def triton(
    hidden: torch.Tensor,
    last_token_index: torch.Tensor,
    w_lm: torch.Tensor,
    batch_invariant: bool = True,
) -> torch.Tensor:
    """hidden [T, hidden], last_token_index [B], w_lm [hidden, vocab] -> logits [B, vocab].

    batch_invariant: one kernel configuration for every B (kernels/matmul_decode.py)."""
    # lazy: importing kernels chooses GPU or interpreter first
    from stagewise.kernels.matmul import matmul

    if is_packed(w_lm):  # gather the few rows, then the fused dequantize-GEMM
        return dequant_gemm.triton(hidden[last_token_index], w_lm, batch_invariant)
    # hidden[last_token_index] @ w_lm: [B of T, hidden] @ [hidden, vocab] -> [B, vocab]
    return matmul(hidden, w_lm, row_index=last_token_index, batch_invariant=batch_invariant)


def triton_variant(
    hidden: torch.Tensor, last_token_index: torch.Tensor, w_lm: torch.Tensor
) -> torch.Tensor:
    """`batch_invariant=False`: B <= 16 and more rows each take their fastest GEMM."""
    return triton(hidden, last_token_index, w_lm, batch_invariant=False)


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, config.hidden_size, generator=gen)
    # Split the tokens into up to three sequences of irregular length; keep the last index of each.
    cuts = sorted({num_tokens, max(1, num_tokens // 3), max(1, (2 * num_tokens) // 3)})
    last_token_index = torch.tensor([c - 1 for c in cuts], dtype=torch.long)
    w_lm = (
        torch.randn(config.hidden_size, config.vocab_size, generator=gen) / config.hidden_size**0.5
    )
    return {
        "hidden": hidden.to(device, dtype),
        "last_token_index": last_token_index.to(device),
        "w_lm": w_lm.to(device, dtype),
    }


STAGE = Stage(
    name="lm_head",
    summary="gather each sequence's last token, then one GEMM against the vocab matrix",
    shapes="[T, hidden] -> [num_seqs, hidden] -> [num_seqs, vocab]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: row-gather + tiled GEMM on weight^T",
    torch=gemm_torch.lm_head,
    torch_variant=gemm_torch.lm_head_variant,
    torch_kind="torch: gather, then x @ w in the CPU BLAS form measured fastest at load",
    example_inputs=example_inputs,
    outputs=("logits",),
    axes={
        "hidden": "num_tokens hidden",
        "last_token_index": "num_seqs",
        "w_lm": "hidden vocab",
        "logits": "num_seqs vocab",
    },
)
