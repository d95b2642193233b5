"""The W4A16 decode GEMV: 4-bit packed weights, 16-bit activations, at real projection shapes.

    triton   dequant_matmul(a, codes, scales, mins)   codes expanded in registers, only packed bytes read
    stock    F.linear(a, w)                            cuBLAS on the dequantized bf16 weight [N, K]

Decode reads every weight once per token, so the number that matters is bandwidth on the bytes
the kernel must move: codes + scales (+ mins) + activations + output,

    q4_0  0.5625 bytes per weight      q4_1  0.625      (bf16: 2)

as a share of the measured copy bandwidth (target: >= 70%, issue #25). `ratio_vs_stock` is
F.linear's time over the kernel's: how much of the 3.2-3.6x fewer bytes turns into time. The
output is checked against a float64 product with the dequantized weight (`quant/dequantize.py`).

The weights are random codes and scales drawn in memory (`random_packed`): no file, no `gguf`.
Shapes: every projection of Llama-3-8B and SmolLM2-135M (`projection_shapes`), the decode rows
(M <= 16) of `Sizes`.
"""

import torch

from stagewise.config import PRESETS
from stagewise.devtools.gpu.device_timer import GB, copies_for, rel_error, time_kernels
from stagewise.devtools.gpu.kernel_bench import Sizes, _row, projection_shapes
from stagewise.quant.packed_weight import GROUP_SIZE, PackedWeight

DECODE_ROWS = 16  # dequant_matmul's split-K decode launch takes at most this many rows
KINDS = ("q4_1", "q4_0")  # the 4-bit formats of GGUF files this kernel reads
CODE_STD = (255 / 12) ** 0.5  # standard deviation of a uniform code 0..15 (about 4.61)
TARGET_SHARE = 0.7  # of the copy bandwidth, on the packed bytes


def random_packed(kind: str, k: int, n: int, device, generator: torch.Generator | None = None) -> PackedWeight:
    """A [K, N] 4-bit PackedWeight of uniform random codes, scaled like a trained model (fan-in).

    |d| ~ K^-0.5 / 4.61 per group (times 0.5..1.5, random sign), so w = d (q - 8) (q4_0) or
    d q + m with m = -7.5 d (q4_1) has mean ~0 and standard deviation ~K^-0.5: the bf16 random
    model's statistics.
    """
    if kind not in KINDS:
        raise ValueError(f"random_packed draws {' or '.join(KINDS)} weights, not {kind!r}")
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 256, (n, k // 2), device=device, dtype=torch.uint8, generator=generator)  # 2 a byte
    d = torch.rand(n, groups, device=device, generator=generator).add_(0.5).mul_(k**-0.5 / CODE_STD)
    sign = torch.randint(0, 2, (n, groups), device=device, generator=generator).mul_(2).sub_(1)
    d.mul_(sign)  # signed scales (q4_0's quantizer writes them too): q4_0's mean d (7.5 - 8) cancels
    mins = (-7.5 * d).to(torch.float16) if kind == "q4_1" else None
    return PackedWeight(kind, codes, d.to(torch.float16), mins)


def quant_decode_cases(sizes: Sizes, device: torch.device, dtype: torch.dtype, copy_gbs: float) -> list[dict]:
    """One row per (model, projection, 4-bit kind, decode batch size): Triton vs F.linear."""
    import torch.nn.functional as F

    from stagewise.kernels.dequant_matmul import dequant_matmul
    from stagewise.quant.dequantize import dequantize

    def copies(per_copy: int) -> int:  # the interpreter has no L2 to defeat: one copy proves the code
        return copies_for(per_copy, sizes.working_set) if device.type == "cuda" else 1

    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name in dict.fromkeys(sizes.models + sizes.attention_models):  # Llama-3-8B, then SmolLM2
        cfg = PRESETS[name]
        for m in (m for m in sizes.gemm_m if m <= DECODE_ROWS):
            for proj, (k, n) in projection_shapes(cfg).items():
                for kind in KINDS:
                    packed = [random_packed(kind, k, n, device, gen)]
                    moved = packed[0].nbytes + (m * k + m * n) * dtype.itemsize
                    packed += [random_packed(kind, k, n, device, gen) for _ in range(copies(moved) - 1)]
                    acts = [torch.randn(m, k, device=device, dtype=dtype) for _ in packed]

                    def gemv(a, w):
                        return dequant_matmul(
                            a, w.codes, w.scales, w.mins, bits=w.bits, offset=w.offset, group_size=w.group_size
                        )

                    t_ms, how = time_kernels(
                        [lambda a=a, w=w: gemv(a, w) for a, w in zip(acts, packed)], device, sizes.rounds
                    )
                    w_ref = dequantize(packed[0])  # [K, N] float32
                    ref = acts[0].double() @ w_ref.double()  # [M, K] @ [K, N] -> [M, N]
                    err = rel_error(gemv(acts[0], packed[0]), ref)
                    # the stock side: the same numbers as a 16-bit [N, K] weight, as many copies as fit
                    dense = w_ref.t().to(dtype).contiguous()  # [N, K]
                    dense_bytes = dense.numel() * dense.element_size() + (m * k + m * n) * dtype.itemsize
                    denses = [dense] + [dense.clone() for _ in range(copies(dense_bytes) - 1)]
                    s_ms, _ = time_kernels(
                        [lambda a=acts[0], w=w: F.linear(a, w) for w in denses], device, sizes.rounds
                    )
                    del denses, dense, w_ref
                    gbs = moved / (t_ms * 1e-3) / GB
                    rows.append(
                        _row(
                            "dequant_matmul", f"{cfg.name} {proj} {kind} M={m} K={k} N={n}", dtype, t_ms,
                            stock=f"F.linear ({str(dtype).removeprefix('torch.')} weight)", stock_ms=s_ms,
                            metric="GB/s", triton_value=gbs, stock_value=dense_bytes / (s_ms * 1e-3) / GB,
                            packed_bytes=moved, share_of_copy=gbs / copy_gbs, ratio_vs_stock=s_ms / t_ms,
                            target=f"share_of_copy >= {TARGET_SHARE}", passed=gbs / copy_gbs >= TARGET_SHARE,
                            rel_err=err, timing=how,
                        )
                    )  # fmt: skip
                    del packed, acts
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows
