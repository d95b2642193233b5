"""Stage 3: RMSNorm — rescale each token's features to unit root-mean-square.

    x [T, hidden] (+ residual [T, hidden]) -> out [T, hidden], residual_out [T, hidden]

    out = weight * x / sqrt(mean(x^2) + eps)

Unlike LayerNorm there is no mean subtraction and no bias: one reduction per
row. The sum of squares is accumulated in float32 whatever the input dtype
(bf16 would lose the small terms), then the result is cast back, exactly as
Hugging Face's `LlamaRMSNorm` does.

The residual add that precedes every norm in a Llama block is folded into the
stage (as vLLM does): given `residual`, the stage first forms
`x = x + residual`, returns it as the new residual stream, and normalises it.
The Triton kernel does both in one pass over memory instead of two.

The Triton kernel (`kernels/rmsnorm.py`) runs one program per row and keeps
the row in registers from the add to the store: it reads x and residual once
and writes residual_out and out once (4 row passes, against 5 for a separate
add kernel and norm kernel, and about a dozen for the naive reference, where
every PyTorch op — float(), pow, mean, rsqrt, two multiplies, the casts — is
its own pass over memory). A memory-bound stage runs as fast as it moves bytes.

The torch tier (`stages/rmsnorm_torch.py`) makes the norm one `torch.rms_norm`
call: fewer PyTorch calls per decode step, measured there.
"""

import torch

from stagewise.config import ModelConfig
from stagewise.stages import rmsnorm_torch
from stagewise.stages.base import Stage


def naive(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], weight [hidden] -> (normed [T, hidden], residual_out [T, hidden])."""
    if residual is not None:
        x = x + residual  # [T, hidden]: the residual stream after the previous sub-block
    residual_out = x
    xf = x.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)  # [T, hidden] -> [T, 1]
    normed = xf * torch.rsqrt(variance + eps)  # [T, hidden]
    return weight * normed.to(x.dtype), residual_out


def triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton row kernel: the residual add, the fp32 sum of squares and the scaling in one pass."""
    # lazily: importing kernels picks GPU or interpreter
    from stagewise.kernels.rmsnorm import rmsnorm

    return rmsnorm(x, weight, eps, residual)  # -> (out [T, hidden], residual_out [T, hidden])


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, config.hidden_size, generator=gen)
    residual = torch.randn(num_tokens, config.hidden_size, generator=gen)
    weight = 1.0 + 0.1 * torch.randn(config.hidden_size, generator=gen)
    return {
        "x": x.to(device, dtype),
        "weight": weight.to(device, dtype),
        "eps": config.rms_norm_eps,
        "residual": residual.to(device, dtype),
    }


STAGE = Stage(
    name="rmsnorm",
    summary="add the residual, then scale each row to unit RMS times a learned weight",
    shapes="[T, hidden] -> [T, hidden]",
    naive=naive,
    triton=triton,
    triton_kind="triton: one program per row, residual add fused",
    torch=rmsnorm_torch.rmsnorm,
    torch_kind="torch: the residual add, then one torch.rms_norm call (float32 bit for bit)",
    example_inputs=example_inputs,
    outputs=("out", "residual_out"),
    axes={
        "x": "num_tokens hidden",
        "weight": "hidden",
        "residual": "num_tokens hidden",
        "out": "num_tokens hidden",
        "residual_out": "num_tokens hidden",
    },
)
