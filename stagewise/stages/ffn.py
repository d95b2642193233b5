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
a step that is purely memory bound. In decode (at most 16 rows, plain
weights) the activation moves into the down GEMM's input load instead
(`kernels/silu_down.py`): the split-K kernel reads gate and up, forms
silu(gate) * up in fp32, rounds it to the activation dtype as the activation
kernel's store does, and multiplies; h is never written and one launch goes.
Prefill and packed weights keep the three launches.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.stages import dequant_gemm, gemm_torch
from stagewise.stages.base import Stage
from stagewise.stages.packed_weight import is_packed


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


def optimized(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], w_gate_up [hidden, 2*inter], w_down [inter, hidden] -> [T, hidden], Triton."""
    gate_up = _gemm(x, w_gate_up)  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
    return down_from_gate_up(gate_up, w_down)  # [T, 2*inter] -> [T, hidden]


def down_from_gate_up(gate_up: torch.Tensor, w_down) -> torch.Tensor:
    """The Triton tier after the gate/up GEMM: gate_up [T, 2*inter] -> silu(gate) * up @ w_down
    [T, hidden]. A caller that made gate_up itself (fused with the norm before it) enters here.

    Decode shapes with plain weights: one fused kernel (`kernels/silu_down.py`); otherwise
    `silu_and_mul` then the GEMM.
    """
    # lazy: importing kernels chooses GPU or interpreter
    from stagewise.kernels.activation import silu_and_mul
    from stagewise.kernels.silu_down import fuses, silu_down

    if fuses(gate_up, w_down):  # M <= 16 rows, plain weights: silu(gate) * up in the GEMM's load
        return silu_down(gate_up, w_down)  # [T, 2*inter] @ [inter, hidden] -> [T, hidden]
    h = silu_and_mul(gate_up)  # [T, 2*inter] -> [T, inter], one read, one write
    return _gemm(h, w_down)  # [T, inter] @ [inter, hidden] -> [T, hidden]


def _gemm(a: torch.Tensor, w) -> torch.Tensor:
    """a @ w in Triton: the tiled GEMM, or the fused dequantize-GEMM for a packed weight."""
    # lazy: importing kernels chooses GPU or interpreter
    from stagewise.kernels.matmul import matmul

    return dequant_gemm.optimized(a, w) if is_packed(w) else matmul(a, w)


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
    triton=optimized,
    triton_kind="triton: GEMMs; decode fuses silu(gate) * up into the down GEMM's load",
    torch=gemm_torch.ffn,
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
