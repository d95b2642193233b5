"""The torch tier of RMSNorm: PyTorch's own `torch.rms_norm`, after the residual add.

    x [T, hidden] (+ residual [T, hidden]) -> out [T, hidden], residual_out [T, hidden]

`rmsnorm.naive` spells the formula out: a cast to float32, a square, a mean,
an add of eps, a reciprocal square root, two multiplies and a cast back,
eight PyTorch calls per norm, 61 norms per decode step of SmolLM2-135M (two
per layer and the final one). For a decode row of 576 numbers each call costs
its dispatch, not its arithmetic. `torch.rms_norm` does the same steps in
the same order inside one call, so for float32 the numbers are the
reference's, bit for bit. Other dtypes keep the reference's roundings: the
norm is taken of x in float32 (one call), cast to x's dtype, then multiplied
by the weight with the reference's type promotion (for bfloat16, one fused
call that rounds once would differ from the reference by an ulp here and
there). What it saves per norm: benchmarks/README.md, "CPU tier notes".
"""

import torch

from stagewise.cpu import rows as cpu_rows


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden], weight [hidden] -> (normed [T, hidden], residual_out [T, hidden])."""
    if cpu_rows.serves(x) and weight.dtype == torch.float32:  # one compiled call (cpu/rows.py)
        return cpu_rows.rmsnorm(x, weight, eps, residual)
    if residual is not None:
        x = x + residual  # [T, hidden]: the residual stream after the previous sub-block (new)
    if x.dtype != torch.float32 or weight.dtype != torch.float32:  # the reference's roundings
        normed = torch.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
        return weight * normed, x
    return torch.rms_norm(x, (x.shape[-1],), weight, eps), x  # [T, hidden], [T, hidden]
