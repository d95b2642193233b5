"""The torch tier of the four projection stages: `x @ w`, asked the way this CPU's BLAS streams
fastest.

    x [M, K] @ w [K, N] -> [M, N]        (M = tokens in the step, K = in features, N = out features)

The `naive` tier of qkv_proj, o_proj, ffn and lm_head is that one line,
`x @ w`. On a CPU, decode makes M tiny (1 token per running request): every
weight is read once to do 2 FLOPs, so a step takes the time to *stream* the
weights, and how the BLAS library is asked decides how close it gets to the
memory's read bandwidth. The same product can be asked three ways, all
reading the weights stored "out-major" ([N, K] row-major, seen as a [K, N]
view; `models/weights.py` stores them so on the CPU):

    plain        x @ w              the textbook GEMM (a GEMV when M = 1)
    transposed   (w_t @ x^T)^T      a tall, skinny GEMM that walks each weight row once
    blocked      x @ w[:, j:j+64]   one batched product over blocks of 64 output columns

Which one wins is a property of the BLAS build and the CPU, not a law, so
it is measured on the model's own weights when the model loads
(`tuning/gemm_forms.py`, remembered per machine) and this tier asks that
record, `CPU_FORMS`, for the M of each call. Until then, off the CPU, for
other layouts and above SMALL_M rows it is plain `x @ w`.

Batch invariance (the project's design notes): a row's bits must not depend on M, and the
CPU BLAS adds a dot product's terms in another order for 1, 2-3 and 4+ rows.
So by default every call is padded to the BLAS's many-row kernel
(`gemm_forms.gemm_invariant`: a multiple of 4 rows; the transposed form, whose
rows are columns, 16), where all three forms give the same bits for every M;
the calibration times the forms padded so. `batch_invariant=False` (the
`*_variant` functions) asks the BLAS with the rows as they are: the
M-dependent bits of before, the per-M forms measured for the padded calls.

A packed weight (`quant/packed_weight.py`) goes to the dequantize-GEMM's
torch tier instead: PyTorch's stock int4 kernels (`dequant_gemm_torch.py`),
whose rows are the same bits for every M as they are.
"""

import torch

from stagewise.quant.packed_parts import packed_leaves
from stagewise.quant.packed_weight import is_packed
from stagewise.stages import dequant_gemm, dequant_gemm_torch
from stagewise.tuning import gemm_forms


def gemm(x: torch.Tensor, w: torch.Tensor, batch_invariant: bool = True) -> torch.Tensor:
    """x [M, K] @ w [K, N] -> [M, N], contiguous (a packed w: the stock quantized kernels)."""
    if is_packed(w):  # the dequantize-GEMM's torch tier (part by part for mixed kinds)
        return dequant_gemm.torch_tier(x, w, batch_invariant)
    m = x.shape[0]
    if x.device.type != "cpu" or m == 0:
        return x @ w  # [M, K] @ [K, N] -> [M, N]
    forms = gemm_forms.CPU_FORMS
    measured = m <= gemm_forms.SMALL_M and gemm_forms.is_out_major(w)  # the forms' layout
    if batch_invariant:  # padded to the many-row kernel: the same bits for every M
        form = forms.chosen[gemm_forms.bucket(m)] if measured else "plain"
        form = form if form in forms.agreeing else "plain"
        return gemm_forms.gemm_invariant(form, x, w)  # [M, K] @ [K, N] -> [M, N]
    form = forms.chosen_variant[gemm_forms.bucket(m)] if measured else "plain"
    return gemm_forms.FORM_FNS[form](x, w)  # the rows as they are: M-dependent bits


def qkv_proj(x: torch.Tensor, w_qkv: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], w_qkv [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d], in this CPU's fastest form."""
    return gemm(x, w_qkv)  # [T, hidden] @ [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d]


def o_proj(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """x [T, H*d], w_o [H*d, hidden] -> [T, hidden], in this CPU's fastest form."""
    return gemm(x, w_o)  # [T, H*d] @ [H*d, hidden] -> [T, hidden]


def ffn(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, batch_invariant: bool = True
) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]: both GEMMs of the SwiGLU FFN in this CPU's fastest form.

    Packed weights on the CPU read by PyTorch's int4 kernels: those take and give bfloat16
    (`dequant_gemm_torch.py`), so the activation stays bfloat16 from the first GEMM to the second,
    two casts fewer per layer than a float32 round trip in between; silu and the product each
    round once more to bfloat16. (The integer-dot kernel takes float32: no casts then.)
    """
    bi = batch_invariant
    if x.device.type == "cpu" and _bfloat16_between(w_gate_up, w_down):
        gate_up = gemm(x.to(torch.bfloat16), w_gate_up, bi)  # [T, hidden] -> [T, 2*inter] bf16
        gate, up = gate_up.chunk(2, dim=-1)  # -> 2 x [T, inter]
        h = torch.nn.functional.silu(gate).mul_(up)  # [T, inter] bf16
        return gemm(h, w_down, bi).to(x.dtype)  # [T, inter] @ [inter, hidden] -> [T, hidden]
    gate_up = gemm(x, w_gate_up, bi)  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
    gate, up = gate_up.chunk(2, dim=-1)  # -> 2 x [T, inter]
    h = torch.nn.functional.silu(gate) * up  # [T, inter]
    return gemm(h, w_down, bi)  # [T, inter] @ [inter, hidden] -> [T, hidden]


def _bfloat16_between(w_gate_up, w_down) -> bool:
    """Both FFN weights packed, and every part read by a kernel that computes in bfloat16."""
    if not (is_packed(w_gate_up) and is_packed(w_down)):
        return False
    parts = packed_leaves(w_gate_up) + packed_leaves(w_down)
    return all(dequant_gemm_torch.takes_bfloat16(p) for p in parts)


def lm_head(
    hidden: torch.Tensor, last_token_index: torch.Tensor, w_lm: torch.Tensor
) -> torch.Tensor:
    """hidden [T, hidden], last_token_index [B], w_lm [hidden, vocab] -> logits [B, vocab]."""
    last = hidden[last_token_index]  # [T, hidden] -> [num_seqs, hidden]
    return gemm(last, w_lm)  # [num_seqs, hidden] @ [hidden, vocab] -> [num_seqs, vocab]


# ---- batch_invariant=False (`Stage.torch_variant`): the rows as they are, M-dependent bits ----


def qkv_proj_variant(x: torch.Tensor, w_qkv: torch.Tensor) -> torch.Tensor:
    return gemm(x, w_qkv, batch_invariant=False)  # [T, hidden] -> [T, (H+2Hkv)*d]


def o_proj_variant(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    return gemm(x, w_o, batch_invariant=False)  # [T, H*d] -> [T, hidden]


def ffn_variant(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return ffn(x, w_gate_up, w_down, batch_invariant=False)  # [T, hidden] -> [T, hidden]


def lm_head_variant(
    hidden: torch.Tensor, last_token_index: torch.Tensor, w_lm: torch.Tensor
) -> torch.Tensor:
    last = hidden[last_token_index]  # [T, hidden] -> [num_seqs, hidden]
    return gemm(last, w_lm, batch_invariant=False)  # -> [num_seqs, vocab]
