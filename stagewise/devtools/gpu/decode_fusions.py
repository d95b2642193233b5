"""Two decode fusions of the triton tier, fused and not: one launch against two, at real model shapes.

    norm_matmul     norm_matmul(x, w_norm, eps, residual, w_qkv)    rmsnorm in the GEMM's input load
      unfused       matmul(rmsnorm(x, w_norm, eps, residual), w_qkv)  normed rows written, read back
    rope_kv_store   rope_kv_store(pos, q, k, v, cos_sin, k_cache, v_cache, slots)
      unfused       rope(pos, q, k, cos_sin), then kv_store(k, v, k_cache, v_cache, slots)

Both are timed the device check's way (`time_kernels`: a CUDA graph replayed, so the host's
launch cost is out of both numbers, and what is left is the GPU's: the second kernel's own time
and the round trip of the intermediate). `ratio_vs_stock` is unfused / fused: above 1 the fusion
is faster. The fused outputs are checked against a float64 reference (norm_matmul) or the naive
stages (rope_kv_store), like every kernel row. Shapes: the decode rows (M <= 16) of `Sizes`.
"""

import torch

from stagewise.config import PRESETS
from stagewise.devtools.gpu.device_timer import GB, copies_for, rel_error, time_kernels
from stagewise.devtools.gpu.kernel_bench import Sizes, _row

DECODE_ROWS = 16  # norm_matmul takes at most this many rows (matmul_decode.DECODE_MAX_M)
EPS = 1e-5  # the norm's epsilon (Llama's rms_norm_eps)


def _decode_rows(sizes: Sizes) -> list[int]:
    return [m for m in sizes.gemm_m if m <= DECODE_ROWS]


def norm_matmul_cases(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (model, decode batch size): attn_norm (+ residual) fused into qkv_proj's GEMM."""
    from stagewise.kernels.matmul import matmul
    from stagewise.kernels.norm_matmul import norm_matmul
    from stagewise.kernels.rmsnorm import rmsnorm

    rows = []
    for name in sizes.models:
        cfg = PRESETS[name]
        k, n = cfg.hidden_size, cfg.qkv_size
        for m in _decode_rows(sizes):
            # read x, residual, the norm weight and w; write residual_out and c
            per_copy = (3 * m * k + k + k * n + m * n) * dtype.itemsize
            copies = copies_for(per_copy, sizes.working_set)
            cases = [
                (torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, k, device=device, dtype=dtype),
                 torch.rand(k, device=device, dtype=dtype) + 0.5,
                 torch.randn(k, n, device=device, dtype=dtype) * k**-0.5)
                for _ in range(copies)
            ]  # fmt: skip
            f_ms, how = time_kernels(
                [lambda c=c: norm_matmul(c[0], c[2], EPS, c[1], c[3]) for c in cases], device, sizes.rounds
            )
            u_ms, _ = time_kernels(
                [lambda c=c: matmul(rmsnorm(c[0], c[2], EPS, c[1])[0], c[3]) for c in cases], device, sizes.rounds
            )
            x, res, nw, w = cases[0]
            s = x.double() + res.double()  # [M, K]: the residual stream
            normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + EPS) * nw.double()  # [M, K]
            ref = normed @ w.double()  # [M, K] @ [K, N] -> [M, N]
            out, res_out = norm_matmul(x, nw, EPS, res, w)
            err = max(rel_error(out, ref), rel_error(res_out, s))
            rows.append(
                _row(
                    "norm_matmul", f"{cfg.name} attn_norm+qkv M={m} K={k} N={n}", dtype, f_ms,
                    stock="rmsnorm + matmul", stock_ms=u_ms, metric="GB/s",
                    triton_value=per_copy / (f_ms * 1e-3) / GB, ratio_vs_stock=u_ms / f_ms,
                    target="ratio_vs_stock >= 1", passed=u_ms / f_ms >= 1.0, rel_err=err, timing=how,
                )
            )  # fmt: skip
    return rows


def _qkv_views(m: int, heads: int, kv_heads: int, d: int, device, dtype):
    """q [M, H, d], k, v [M, Hkv, d]: strided views of one fused QKV output, as split_qkv gives."""
    qkv = torch.randn(m, (heads + 2 * kv_heads) * d, device=device, dtype=dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(m, heads, d), k.view(m, kv_heads, d), v.view(m, kv_heads, d)


def rope_kv_store_cases(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One row per (model, decode batch size): RoPE with the paged KV store, against the pair."""
    from stagewise.kernels.kv_store import kv_store
    from stagewise.kernels.rope import rope
    from stagewise.kernels.rope_kv_store import rope_kv_store
    from stagewise.stages import rope as rope_stage
    from stagewise.stages.rope import build_cos_sin_cache

    rows = []
    for name in sizes.models:
        cfg = PRESETS[name]
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos_sin = build_cos_sin_cache(cfg.max_position_embeddings, d, cfg.rope_theta, device=device)
        for m in _decode_rows(sizes):
            slots_total = 64 * m  # a small cache: the slots are scattered in it
            # read q, k, v (and the token's angles, positions, slots); write q, k_cache, v_cache rows
            per_copy = 2 * (h + 2 * hkv) * d * m * dtype.itemsize + m * d * 4
            copies = copies_for(per_copy, sizes.working_set)
            cases = []
            for _ in range(copies):  # rotation keeps norms, so repeated in-place calls stay finite
                q, k, v = _qkv_views(m, h, hkv, d, device, dtype)
                caches = [torch.zeros(slots_total, hkv, d, device=device, dtype=dtype) for _ in range(2)]
                pos = torch.randint(0, cfg.max_position_embeddings, (m,), device=device)
                slots = torch.randperm(slots_total, device=device)[:m]
                cases.append((pos, q, k, v, caches[0], caches[1], slots))
            f_ms, how = time_kernels(
                [lambda c=c, cs=cos_sin: rope_kv_store(*c[:4], cs, *c[4:]) for c in cases],
                device,
                sizes.rounds,
            )

            def unfused(pos, q, k, v, kc, vc, slots, cs=cos_sin):
                rope(pos, q, k, cs)  # q and k rotated in place
                kv_store(k, v, kc, vc, slots)

            u_ms, _ = time_kernels([lambda c=c: unfused(*c) for c in cases], device, sizes.rounds)
            pos, q, k, v, kc, vc, slots = cases[0]
            q0, k0, v0 = q.clone(), k.clone(), v.clone()
            q_ref, k_ref = rope_stage.naive(pos, q0.double(), k0.double(), cos_sin)  # rotated in float32
            rope_kv_store(pos, q, k, v, cos_sin, kc, vc, slots)
            err = max(rel_error(q, q_ref), rel_error(kc[slots], k_ref), rel_error(vc[slots], v0))
            rows.append(
                _row(
                    "rope_kv_store", f"{cfg.name} T={m} H={h} Hkv={hkv} d={d}", dtype, f_ms,
                    stock="rope + kv_store", stock_ms=u_ms, metric="GB/s",
                    triton_value=per_copy / (f_ms * 1e-3) / GB, ratio_vs_stock=u_ms / f_ms,
                    target="ratio_vs_stock >= 1", passed=u_ms / f_ms >= 1.0, rel_err=err, timing=how,
                )
            )  # fmt: skip
    return rows
