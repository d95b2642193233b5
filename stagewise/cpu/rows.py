"""RMSNorm and RoPE on the CPU in one compiled call each (`rows.cpp`), where PyTorch takes several.

    rmsnorm: x [T, n] (+ residual [T, n]), weight [n] -> (out [T, n], x + residual [T, n])
    rope:    positions [T], q [T, H, d], k [T, Hkv, d], table [max_pos, 2 d] -> (q', k')

A decode step of SmolLM2-135M runs 61 norms and 30 RoPEs on rows of 576 numbers. PyTorch's
`torch.rms_norm` is about seven calls inside and the torch tier's RoPE six, each paying its
dispatch (tens of microseconds a norm on a small CPU) for arithmetic that takes one or two: the
step's time goes to bookkeeping. The compiled loops do the same arithmetic per row:

- RMSNorm: the residual added elementwise, then the sum of squares in 8 lanes of fused
  multiply-adds (lane l takes c = l, l + 8, ...), lanes added in one fixed tree, then
  r = 1 / sqrt(ss / n + eps) and out = (x r) w. Another order than `torch.rms_norm`'s (so other
  bits, within float32 rounding), the same for every row of every call: batch-invariant.
- RoPE: out = x cos + swapped(x) sin with each product rounded before the add, the torch tier's
  own operations in its order (`stages/rope_torch.py`), so the same bits as the torch tier.

Part of the compiled CPU kernels (`build.py`: STAGEWISE_CPU_KERNELS=1 and a C++ compiler), float32
on the CPU; otherwise PyTorch's calls run.
"""

import torch

from stagewise.cpu import build
from stagewise.errors import StagewiseError


def serves(x: torch.Tensor) -> bool:
    """Whether the compiled loops take x: the kernels on and built, a float32 CPU tensor."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and build.library() is not None


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, n], weight [n] (+ residual [T, n]) -> (normed [T, n], x + residual [T, n]), float32."""
    lib = build.library()
    if lib is None:
        raise StagewiseError(f"the CPU row kernels are not built here ({build.describe()})")
    n = x.shape[-1]
    _check_float32("cpu rmsnorm", x, weight, *([] if residual is None else [residual]))
    if weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise StagewiseError(
            f"cpu rmsnorm: x {list(x.shape)}, weight {list(weight.shape)}, residual "
            f"{None if residual is None else list(residual.shape)}: want [T, n], [n], [T, n]"
        )
    x, weight = _plain(x), _plain(weight)
    out = torch.empty_like(x)  # [T, n]
    total = torch.empty_like(x) if residual is not None else x  # x + residual [T, n]
    res = _plain(residual) if residual is not None else None
    lib.sw_rmsnorm(
        x.data_ptr(),
        None if res is None else res.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        None if res is None else total.data_ptr(),
        x.numel() // n,
        n,
        float(eps),
        torch.get_num_threads(),
    )
    return out, total


def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d], table [max_pos, 2 d] (`rope_torch.wide_cache`)
    -> new rotated (q [T, H, d], k [T, Hkv, d]) float32, views of one [T, H + Hkv, d] tensor."""
    lib = build.library()
    if lib is None:
        raise StagewiseError(f"the CPU row kernels are not built here ({build.describe()})")
    _check_float32("cpu rope", q, k, table)
    if q.dim() != 3 or k.dim() != 3 or positions.shape != (q.shape[0],):
        raise StagewiseError(
            f"cpu rope: positions {list(positions.shape)}, q {list(q.shape)}, k {list(k.shape)}: "
            "want [T], [T, H, d], [T, Hkv, d]"
        )
    tokens, heads, d = q.shape
    if k.shape[0] != tokens or k.shape[2] != d or table.shape[1] != 2 * d or d % 2:
        raise StagewiseError(
            f"cpu rope: q {list(q.shape)}, k {list(k.shape)}, table {list(table.shape)}: want "
            "[T, H, d], [T, Hkv, d], [max_pos, 2 d], d even"
        )
    qk = torch.cat([q, k], dim=1)  # [T, H + Hkv, d]: one input buffer
    out = torch.empty_like(qk)
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    status = lib.sw_rope(
        qk.data_ptr(),
        _plain(pos).data_ptr(),
        _plain(table).data_ptr(),
        table.shape[0],
        out.data_ptr(),
        tokens,
        qk.shape[1],
        d,
        torch.get_num_threads(),
    )
    if status:
        raise StagewiseError(f"cpu rope: a position past the table's {table.shape[0]} rows")
    return out[:, :heads], out[:, heads:]  # [T, H, d], [T, Hkv, d]


def _check_float32(what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise StagewiseError(f"{what}: takes float32 CPU tensors, got {t.dtype} on {t.device}")


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()
