"""The FFN's second half in decode, fused and not: one launch against two, at real model shapes.

    fused     silu_down(gate_up, w_down)                    silu(gate) * up in the GEMM's load
    unfused   matmul(silu_and_mul(gate_up), w_down)         h [M, inter] written, then read

Both are timed the device check's way (`time_kernels`: a CUDA graph replayed, so the host's
launch cost is out of both numbers, and what is left is the GPU's: the second kernel's own time
and the h round trip). `ratio_vs_stock` is unfused / fused: above 1 the fusion is faster. The
fused output is checked against a float64 reference of the same formula, like every kernel row.
"""

import torch

from stagewise.config import PRESETS
from stagewise.devtools.gpu.device_timer import GB, copies_for, rel_error, time_kernels
from stagewise.devtools.gpu.kernel_bench import Sizes, _row

DECODE_ROWS = 16  # silu_down takes at most this many rows (matmul_decode.BLOCK_M)


def silu_down_cases(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (model, decode batch size) of `sizes`: fused vs unfused down projection."""
    from stagewise.kernels.activation import silu_and_mul
    from stagewise.kernels.matmul import matmul
    from stagewise.kernels.silu_down import silu_down

    rows = []
    for name in sizes.models:
        cfg = PRESETS[name]
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        for m in (m for m in sizes.gemm_m if m <= DECODE_ROWS):
            per_copy = (m * 2 * inter + inter * hidden + m * hidden) * dtype.itemsize
            copies = copies_for(per_copy, sizes.working_set)
            gate_ups = [torch.randn(m, 2 * inter, device=device, dtype=dtype) for _ in range(copies)]
            ws = [torch.randn(inter, hidden, device=device, dtype=dtype) * inter**-0.5 for _ in range(copies)]
            pairs = list(zip(gate_ups, ws))
            f_ms, how = time_kernels([lambda g=g, w=w: silu_down(g, w) for g, w in pairs], device, sizes.rounds)
            u_ms, _ = time_kernels(
                [lambda g=g, w=w: matmul(silu_and_mul(g), w) for g, w in pairs], device, sizes.rounds
            )
            g, w = pairs[0]
            gate, up = g.double().chunk(2, dim=-1)  # [M, 2*inter] -> 2 x [M, inter]
            ref = (torch.nn.functional.silu(gate) * up) @ w.double()  # [M, inter] @ [inter, hidden]
            rows.append(
                _row(
                    "silu_down", f"{cfg.name} down M={m} K={inter} N={hidden}", dtype, f_ms,
                    stock="silu_and_mul + matmul", stock_ms=u_ms, metric="GB/s",
                    triton_value=per_copy / (f_ms * 1e-3) / GB, ratio_vs_stock=u_ms / f_ms,
                    target="ratio_vs_stock >= 1", passed=u_ms / f_ms >= 1.0,
                    rel_err=rel_error(silu_down(g, w), ref), timing=how,
                )
            )  # fmt: skip
    return rows
