"""Stage 7: the SwiGLU feed-forward network with a fused gate/up GEMM.

    x [T, hidden] @ w_gate_up [hidden, 2*inter] -> gate_up [T, 2*inter]
    silu_and_mul(gate_up)                       -> h [T, inter]       silu(gate) * up
    h @ w_down [inter, hidden]                  -> out [T, hidden]

W_gate and W_up read the same input, so their columns are concatenated into
one wide weight and one GEMM replaces two. `silu_and_mul` reads both halves of
that output and writes their product: fused, it touches the [T, 2*inter]
tensor once instead of materialising silu(gate) in between.

Packed weights go through `stages/dequant_gemm.py`, in the same tier.

Torch tier (`stages/gemm_torch.py`): both GEMMs in the CPU BLAS form measured
fastest at load (the activation is the same PyTorch line).

Triton: Triton GEMM -> Triton `silu_and_mul` -> Triton GEMM
(`kernels/matmul.py`, `kernels/activation.py`). The activation kernel reads
gate and up once, computes in fp32 and writes h once: the minimum traffic for
a step that is purely memory bound. Without batch invariance
(`triton_variant`), in decode (at most 16 rows, plain weights) the activation
moves into the down GEMM's input load (`kernels/silu_down.py`): the split-K
kernel reads gate and up, forms silu(gate) * up in fp32, rounds it to the
activation dtype as the activation kernel's store does, and multiplies; h is
never written and one launch goes. That kernel is tuned apart from the GEMM on
a GPU, so a decode row and the same row in a prefill would part: batch-invariant
(the default) every T keeps the three launches, one GEMM config for every T.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.quant.packed_weight import is_packed
from stagewise.stages import dequant_gemm, gemm_torch
from stagewise.stages.base import Stage


def silu_and_mul_naive(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2*inter] -> silu(gate) * up [T, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)  # [T, 2*inter] -> 2 x [T, inter]
    return torch.nn.functional.silu(gate) * up  # [T, inter]


def naive(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], w_gate_up [hidden, 2*inter], w_down [inter, hidden] -> [T, hidden]."""
    gate_up = product(x, w_gate_up)  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
    h = silu_and_mul_naive(gate_up)  # [T, 2*inter] -> [T, inter]: silu(gate) * up
    return product(h, w_down)  # [T, inter] @ [inter, hidden] -> [T, hidden]


def product(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w, or the dequantize-GEMM's naive tier when w is kept quantized."""
    return dequant_gemm.naive(x, w) if is_packed(w) else x @ w


def triton(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, batch_invariant: bool = True
) -> torch.Tensor:
    """x [T, hidden], w_gate_up [hidden, 2*inter], w_down [inter, hidden] -> [T, hidden], Triton.

    batch_invariant: both GEMMs in one configuration for every T, and no decode-only fusion."""
    bi = batch_invariant
    gate_up = _gemm(x, w_gate_up, bi)  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
    return down_from_gate_up(gate_up, w_down, bi)  # [T, 2*inter] -> [T, hidden]


def triton_variant(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """`batch_invariant=False`: decode (T <= 16) fuses silu into the down GEMM, prefill takes the
    tiled GEMMs: faster, and a row's bits change where T crosses 16."""
    return triton(x, w_gate_up, w_down, batch_invariant=False)


def down_from_gate_up(gate_up: torch.Tensor, w_down, batch_invariant: bool = True) -> torch.Tensor:
    """The Triton tier after the gate/up GEMM: gate_up [T, 2*inter] -> silu(gate) * up @ w_down
    [T, hidden]. A caller that made gate_up itself (fused with the norm before it) enters here.

    Decode shapes with plain weights, not batch-invariant: one fused kernel
    (`kernels/silu_down.py`, tuned on a GPU apart from the GEMM, so its sums may differ from the
    prefill's); otherwise `silu_and_mul` then the GEMM.
    """
    # lazy: importing kernels chooses GPU or interpreter
    from stagewise.kernels.activation import silu_and_mul
    from stagewise.kernels.silu_down import fuses, silu_down

    if not batch_invariant and fuses(gate_up, w_down):  # M <= 16 rows, plain weights
        return silu_down(gate_up, w_down)  # [T, 2*inter] @ [inter, hidden] -> [T, hidden]
    h = silu_and_mul(gate_up)  # [T, 2*inter] -> [T, inter], one read, one write
    return _gemm(h, w_down, batch_invariant)  # [T, inter] @ [inter, hidden] -> [T, hidden]


def _gemm(a: torch.Tensor, w, batch_invariant: bool = True) -> torch.Tensor:
    """a @ w in Triton: the tiled GEMM, or the fused dequantize-GEMM for a packed weight."""
    # lazy: importing kernels chooses GPU or interpreter
    from stagewise.kernels.matmul import matmul

    if is_packed(w):
        return dequant_gemm.triton(a, w, batch_invariant)
    return matmul(a, w, batch_invariant=batch_invariant)


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden, inter = config.hidden_size, config.intermediate_size
    x = torch.randn(num_tokens, hidden, generator=gen)
    w_gate_up = torch.randn(hidden, 2 * inter, generator=gen) / hidden**0.5
    w_down = torch.randn(inter, hidden, generator=gen) / inter**0.5
    return {
        "x": x.to(device, dtype),
        "w_gate_up": w_gate_up.to(device, dtype),
        "w_down": w_down.to(device, dtype),
    }


STAGE = Stage(
    name="ffn",
    summary="fused gate/up GEMM, silu(gate) * up, down GEMM",
    shapes="[T, hidden] -> [T, 2*inter] -> [T, inter] -> [T, hidden]",
    naive=naive,
    triton=triton,
    triton_variant=triton_variant,
    triton_kind="triton: GEMMs (not batch-invariant: decode fuses silu into the down GEMM)",
    torch=gemm_torch.ffn,
    torch_variant=gemm_torch.ffn_variant,
    torch_kind="torch: both GEMMs in the CPU BLAS form measured fastest at load",
    example_inputs=example_inputs,
    outputs=("out",),
    axes={
        "x": "num_tokens hidden",
        "w_gate_up": "hidden 2*inter",
        "w_down": "inter hidden",
        "out": "num_tokens hidden",
    },
)
