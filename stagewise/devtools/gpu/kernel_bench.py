"""Every Triton kernel against its naive stage and the best stock alternative, at real model shapes.

One row per (kernel, shape): milliseconds of the Triton kernel, of the naive
PyTorch stage and of the stock alternative a performance engineer would reach
for, then the figure of merit:

    GEMM                 TFLOP/s, and the ratio to torch.matmul (cuBLAS)
    FlashAttention       TFLOP/s, and the ratio to scaled_dot_product_attention
                         (its flash or cuDNN backend, named), equal-length batch
    paged decode         GB/s of K/V read, as a share of the measured copy bandwidth
    flash decode         the same over the static runner's contiguous cache (seqused_k)
    row kernels          GB/s moved (RMSNorm, RoPE, silu_and_mul, embedding, KV store),
                         as a share of the measured copy bandwidth
    sampling             ms, against the naive sort-based PyTorch path

Every case also checks the Triton output against a float64 (or the naive
stage's) reference: ||out - ref|| / ||ref||, so a fast wrong kernel shows.
`Sizes` holds the shapes: Llama-3-8B and SmolLM2-135M on a GPU, tiny ones for
a CPU dry run (the interpreter), where the timings mean nothing.
"""

import math
from dataclasses import dataclass

import torch

from stagewise.bench.harness.progress import row
from stagewise.config import PRESETS, ModelConfig
from stagewise.devtools.gpu.device_timer import GB, copies_for, rel_error, time_calls, time_kernels


@dataclass(frozen=True)
class Sizes:
    models: tuple[str, ...]  # presets whose shapes every case uses
    attention_models: tuple[str, ...]  # further presets for the attention cases only
    gemm_m: tuple[int, ...]  # rows of the GEMM cases (decode batch sizes, a prefill length)
    attn_batch: int  # sequences of the prefill attention case
    attn_len: int  # tokens per sequence of the prefill attention case
    decode_seqs: int  # sequences of the paged decode case
    decode_ctx: int  # context length of each, in tokens
    row_tokens: int  # tokens of the row-kernel cases
    sample_rows: int  # logits rows of the sampling case
    working_set: int  # bytes each case's rotating inputs fill at least
    rounds: int  # timed rounds (median)


GPU_SIZES = Sizes(("llama-3-8b",), ("smollm2-135m",), (1, 4096), 4, 4096, 64, 4096, 65536, 64, 1_000_000_000, 5)
DRY_SIZES = Sizes(("tiny",), ("tiny",), (1, 37), 2, 24, 3, 40, 10, 3, 1 << 16, 1)


def _row(kernel: str, shape: str, dtype: torch.dtype, triton_ms: float, **extra) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    return {"kernel": kernel, "shape": shape, "dtype": dtype_name, "triton_ms": triton_ms, **extra}


def bandwidth_row(kernel, shape, dtype, triton_ms, naive_ms, moved, copy_gbs, err, timing="") -> dict:
    gbs = moved / (triton_ms * 1e-3) / GB
    return _row(
        kernel, shape, dtype, triton_ms, naive_ms=naive_ms, metric="GB/s", triton_value=gbs,
        naive_value=moved / (naive_ms * 1e-3) / GB, share_of_copy=gbs / copy_gbs, target="share_of_copy >= 0.75",
        passed=gbs / copy_gbs >= 0.75, rel_err=err, timing=timing,
    )  # fmt: skip


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(K, N) of every weight matrix a token meets: the GEMMs of one forward pass."""
    return {
        "qkv": (cfg.hidden_size, cfg.qkv_size),
        "o": (cfg.q_size, cfg.hidden_size),
        "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
        "down": (cfg.intermediate_size, cfg.hidden_size),
        "lm_head": (cfg.hidden_size, cfg.vocab_size),
    }


def gemm_cases(cfg: ModelConfig, sizes: Sizes, dtype, device) -> list[dict]:
    """x [M, K] @ w [K, N] for each projection of the model: Triton matmul vs torch.matmul."""
    from stagewise.kernels.matmul import matmul

    shapes = projection_shapes(cfg)
    rows = []
    for m in sizes.gemm_m:
        for name, (k, n) in shapes.items():
            if name == "lm_head" and m > 64:
                continue  # the LM head only ever sees the last token of each sequence
            per_copy = (m * k + k * n + m * n) * torch.finfo(dtype).bits // 8
            copies = copies_for(per_copy, sizes.working_set)
            xs = [torch.randn(m, k, device=device, dtype=dtype) for _ in range(copies)]
            ws = [torch.randn(k, n, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
            t_ms, how = time_kernels([lambda x=x, w=w: matmul(x, w) for x, w in zip(xs, ws)], device, sizes.rounds)
            s_ms, _ = time_kernels([lambda x=x, w=w: torch.matmul(x, w) for x, w in zip(xs, ws)], device, sizes.rounds)
            err = rel_error(matmul(xs[0], ws[0]), xs[0].double() @ ws[0].double())
            flops, moved = 2 * m * k * n, per_copy
            rows.append(
                _row(
                    "matmul", f"{cfg.name} {name} M={m} K={k} N={n}", dtype, t_ms, stock="torch.matmul",
                    stock_ms=s_ms, metric="TFLOP/s", triton_value=flops / (t_ms * 1e-3) / 1e12,
                    stock_value=flops / (s_ms * 1e-3) / 1e12, weight_gb_per_s=moved / (t_ms * 1e-3) / GB,
                    ratio_vs_stock=s_ms / t_ms, target="ratio_vs_stock >= 0.8", passed=s_ms / t_ms >= 0.8,
                    rel_err=err, timing=how,
                )
            )  # fmt: skip
    return rows


def _sdpa_backends(device) -> list[tuple[str, object]]:
    """SDPA backends to try, by name (on the CPU: the default dispatch only)."""
    if device.type != "cuda":
        return [("default", None)]
    from torch.nn.attention import SDPBackend

    names = [("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION")]
    return [(label, getattr(SDPBackend, attr)) for label, attr in names if hasattr(SDPBackend, attr)]


def _sdpa_timed(q4, k4, v4, device, rounds, causal: bool) -> dict[str, float]:
    """ms of F.scaled_dot_product_attention per backend that accepts these inputs (GQA by enable_gqa)."""
    import torch.nn.functional as F

    out = {}
    for label, backend in _sdpa_backends(device):
        call = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=True)  # noqa: E731
        try:
            if backend is None:
                out[label] = time_kernels([call], device, rounds)[0]
            else:
                from torch.nn.attention import sdpa_kernel

                with sdpa_kernel([backend]):
                    out[label] = time_kernels([call], device, rounds)[0]
        except RuntimeError as err:  # this backend refuses the shape/dtype/GQA: say so, try the next
            out[label] = f"unavailable: {str(err).splitlines()[0][:120]}"
    return out


def flash_cases(cfg: ModelConfig, sizes: Sizes, dtype, device) -> list[dict]:
    """Causal prefill of an equal-length batch: Triton FlashAttention vs SDPA (flash / cuDNN)."""
    from stagewise.kernels.flash_attention import flash_attention
    from stagewise.stages.attention import naive
    from stagewise.stages.attention_metadata import AttentionMetadata

    b, n, h, hkv, d = sizes.attn_batch, sizes.attn_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.randn(b * n, h, d, device=device, dtype=dtype)  # [T, H, d], T = B * N packed
    k = torch.randn(b * n, hkv, d, device=device, dtype=dtype)
    v = torch.randn(b * n, hkv, d, device=device, dtype=dtype)
    cu = torch.arange(0, (b + 1) * n, n, device=device, dtype=torch.int32)  # [B+1]
    scale = d**-0.5
    call = lambda: flash_attention(q, k, v, cu, cu, scale, max_q_len=n)  # noqa: E731  (host int: no sync)
    t_ms, how = time_kernels([call], device, sizes.rounds)
    meta = AttentionMetadata.over_batch(cu, cu.tolist())  # the textbook's lengths, read once here
    n_ms = time_calls([lambda: naive(q, k, v, meta, scale)], device, 1, warmup=0)
    q4, k4, v4 = (t.view(b, n, -1, d).transpose(1, 2) for t in (q, k, v))  # [B, heads, N, d] views
    q4, k4, v4 = q4.contiguous(), k4.contiguous(), v4.contiguous()
    sdpa = _sdpa_timed(q4, k4, v4, device, sizes.rounds, causal=True)
    timed = {name: ms for name, ms in sdpa.items() if isinstance(ms, float)}
    best = min(timed, key=timed.get) if timed else None
    ref = naive(q.double(), k.double(), v.double(), meta, scale) if device.type == "cpu" else None
    if ref is None:  # on a GPU the float64 reference of the full batch is slow: check the first sequence
        one = AttentionMetadata.over_batch(cu[:2], [0, n])
        ref = naive(q[:n].double(), k[:n].double(), v[:n].double(), one, scale)
    err = rel_error(call()[: ref.shape[0]], ref)
    flops = 4 * b * h * n * n * d / 2  # QK^T and PV, causal: half the square
    row = _row(
        "flash_attention", f"{cfg.name} prefill B={b} N={n} H={h} Hkv={hkv} d={d}", dtype, t_ms, naive_ms=n_ms,
        metric="TFLOP/s", triton_value=flops / (t_ms * 1e-3) / 1e12, sdpa_ms_by_backend=sdpa, rel_err=err, timing=how,
    )  # fmt: skip
    if best is not None:
        row.update(stock=f"sdpa[{best}]", stock_ms=timed[best], ratio_vs_stock=timed[best] / t_ms)
        row.update(stock_value=flops / (timed[best] * 1e-3) / 1e12, target="ratio_vs_stock >= 0.8")
        row["passed"] = timed[best] / t_ms >= 0.8
    return [row]


def paged_decode_cases(cfg: ModelConfig, sizes: Sizes, dtype, device, copy_gbs: float) -> list[dict]:
    """One decode token per sequence over a long paged context: GB/s of K/V read."""
    import torch.nn.functional as F

    from stagewise.kernels.paged_attention import paged_attention
    from stagewise.stages.attention_metadata import AttentionMetadata
    from stagewise.stages.paged_attention import naive

    hkv, d, bs = cfg.num_kv_heads, cfg.head_dim, 16
    seqs, ctx = sizes.decode_seqs, sizes.decode_ctx
    kv_bytes_per_seq = 2 * ctx * hkv * d * torch.finfo(dtype).bits // 8
    seqs = max(seqs, copies_for(kv_bytes_per_seq, sizes.working_set, max_copies=4096))  # >= the working set
    per_seq = -(-ctx // bs)
    num_blocks = seqs * per_seq
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)  # blocks scattered anywhere
    block_table = perm.view(seqs, per_seq).contiguous()  # [B, max_blocks]
    seq_lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
    cu_q = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    q = torch.randn(seqs, cfg.num_heads, d, device=device, dtype=dtype)
    scale = d**-0.5
    lengths = dict(max_q_len=1, max_seq_len=ctx)  # host ints, as the engine passes them: no sync per call
    call = lambda: paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_q, scale, **lengths)  # noqa: E731
    t_ms, how = time_kernels([call], device, sizes.rounds)
    meta = AttentionMetadata.build([1] * seqs, [ctx] * seqs, device, block_table=block_table, cu_seqlens_q=cu_q)
    n_ms = time_calls([lambda: naive(q, k_cache, v_cache, meta, scale)], device, 1, 0)
    err = rel_error(call(), naive(q.float(), k_cache.float(), v_cache.float(), meta, scale))
    moved = seqs * kv_bytes_per_seq
    gbs = moved / (t_ms * 1e-3) / GB
    # Stock: SDPA over the same K/V laid out contiguously (no paging), one query per sequence.
    k4 = k_cache[block_table.long()].view(seqs, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    v4 = v_cache[block_table.long()].view(seqs, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.view(seqs, -1, 1, d)
    sdpa = {}
    try:
        sdpa["default"] = time_kernels(
            [lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)], device, sizes.rounds
        )[0]
    except RuntimeError as e:
        sdpa["default"] = f"unavailable: {str(e).splitlines()[0][:120]}"
    return [
        _row(
            "paged_attention", f"{cfg.name} decode B={seqs} ctx={ctx} Hkv={hkv} d={d} block={bs}", dtype, t_ms,
            naive_ms=n_ms, metric="GB/s (K/V)", triton_value=gbs, share_of_copy=gbs / copy_gbs,
            contiguous_sdpa_ms=sdpa, target="share_of_copy >= 0.70", passed=gbs / copy_gbs >= 0.70, rel_err=err,
            timing=how,
        )
    ]  # fmt: skip


def flash_decode_cases(cfg: ModelConfig, sizes: Sizes, dtype, device, copy_gbs: float) -> list[dict]:
    """One decode token per sequence over the static runner's contiguous cache (seqused_k): GB/s of K/V read.

    The tile packs each KV head's GQA group, so K/V are read once per KV head: `moved` counts them once.
    """
    from stagewise.kernels.flash_attention import flash_attention
    from stagewise.stages.attention import naive
    from stagewise.stages.attention_metadata import AttentionMetadata

    hkv, d, ctx = cfg.num_kv_heads, cfg.head_dim, sizes.decode_ctx
    kv_bytes_per_seq = 2 * ctx * hkv * d * torch.finfo(dtype).bits // 8
    seqs = max(sizes.decode_seqs, copies_for(kv_bytes_per_seq, sizes.working_set, max_copies=4096))
    k = torch.randn(seqs * ctx, hkv, d, device=device, dtype=dtype)  # row b owns slots [b * ctx, (b + 1) * ctx)
    v = torch.randn(seqs * ctx, hkv, d, device=device, dtype=dtype)
    q = torch.randn(seqs, cfg.num_heads, d, device=device, dtype=dtype)
    cu_q = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    cu_k = torch.arange(0, (seqs + 1) * ctx, ctx, device=device, dtype=torch.int32)
    used = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
    scale = d**-0.5
    call = lambda: flash_attention(q, k, v, cu_q, cu_k, scale, used, max_q_len=1)  # noqa: E731  (host int: no sync)
    t_ms, how = time_kernels([call], device, sizes.rounds)
    meta = AttentionMetadata.build([1] * seqs, [ctx] * seqs, device, k_starts=cu_k.tolist(), cu_seqlens_q=cu_q)
    n_ms = time_calls([lambda: naive(q, k, v, meta, scale)], device, 1, 0)
    err = rel_error(call(), naive(q.float(), k.float(), v.float(), meta, scale))
    gbs = seqs * kv_bytes_per_seq / (t_ms * 1e-3) / GB
    return [
        _row(
            "flash_attention", f"{cfg.name} decode B={seqs} ctx={ctx} Hkv={hkv} d={d} contiguous", dtype, t_ms,
            naive_ms=n_ms, metric="GB/s (K/V)", triton_value=gbs, share_of_copy=gbs / copy_gbs,
            target="share_of_copy >= 0.70", passed=gbs / copy_gbs >= 0.70, rel_err=err, timing=how,
        )
    ]  # fmt: skip


def row_kernel_cases(cfg: ModelConfig, sizes: Sizes, dtype, device, copy_gbs: float) -> list[dict]:
    """RMSNorm (+ residual), RoPE, silu_and_mul, embedding, KV store: GB/s against the copy."""
    from stagewise.stages import STAGES
    from stagewise.stages.attention_metadata import AttentionMetadata
    from stagewise.stages.ffn import silu_and_mul_naive
    from stagewise.stages.rope import build_cos_sin_cache

    elt = torch.finfo(dtype).bits // 8
    t, hidden, d = sizes.row_tokens, cfg.hidden_size, cfg.head_dim
    rows, r = [], sizes.rounds
    # RMSNorm with the fused residual add: read x, residual; write out, residual_out.
    x = torch.randn(t, hidden, device=device, dtype=dtype)
    res = torch.randn(t, hidden, device=device, dtype=dtype)
    w = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    st = STAGES["rmsnorm"]
    tm, how = time_kernels([lambda: st.triton(x, w, 1e-5, res)], device, r)
    nm = time_calls([lambda: st.naive(x, w, 1e-5, res)], device, r)
    err = rel_error(st.triton(x, w, 1e-5, res)[0], st.naive(x.float(), w.float(), 1e-5, res.float())[0])
    rows.append(
        bandwidth_row(
            "rmsnorm+residual",
            f"{cfg.name} T={t} hidden={hidden}",
            dtype,
            tm,
            nm,
            4 * x.numel() * elt,
            copy_gbs,
            err,
            timing=how,
        )
    )
    # RoPE in place on q and k (rotation keeps norms, so repeated calls stay finite).
    q = torch.randn(t, cfg.num_heads, d, device=device, dtype=dtype)
    k = torch.randn(t, cfg.num_kv_heads, d, device=device, dtype=dtype)
    cache = build_cos_sin_cache(cfg.max_position_embeddings, d, cfg.rope_theta, device=device)
    pos = torch.randint(0, cfg.max_position_embeddings, (t,), device=device)
    st = STAGES["rope"]
    q0, k0 = q.clone(), k.clone()
    ref = st.naive(pos, q0.float(), k0.float(), cache)[0]
    err = rel_error(st.triton(pos, q0, k0, cache)[0], ref)
    tm, how = time_kernels([lambda: st.triton(pos, q, k, cache)], device, r)
    nm = time_calls([lambda: st.naive(pos, q, k, cache)], device, r)
    rows.append(
        bandwidth_row(
            "rope",
            f"{cfg.name} T={t} H={cfg.num_heads} Hkv={cfg.num_kv_heads} d={d}",
            dtype,
            tm,
            nm,
            2 * (q.numel() + k.numel()) * elt,
            copy_gbs,
            err,
            timing=how,
        )
    )
    # silu_and_mul: read [T', 2*inter], write [T', inter]; T' keeps the set near the row kernels' size.
    from stagewise.kernels.activation import silu_and_mul

    tg = max(1, t * hidden // (2 * cfg.intermediate_size))
    gate_up = torch.randn(tg, 2 * cfg.intermediate_size, device=device, dtype=dtype)
    tm, how = time_kernels([lambda: silu_and_mul(gate_up)], device, r)
    nm = time_calls([lambda: silu_and_mul_naive(gate_up)], device, r)
    err = rel_error(silu_and_mul(gate_up), silu_and_mul_naive(gate_up.double()))
    rows.append(
        bandwidth_row(
            "silu_and_mul",
            f"{cfg.name} T={tg} inter={cfg.intermediate_size}",
            dtype,
            tm,
            nm,
            gate_up.numel() * elt * 3 // 2,
            copy_gbs,
            err,
            timing=how,
        )
    )
    # Embedding gather: read T rows of the table, write T rows.
    table = torch.randn(cfg.vocab_size, hidden, device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (t,), device=device)
    st = STAGES["embedding"]
    tm, how = time_kernels([lambda: st.triton(ids, table)], device, r)
    nm = time_calls([lambda: st.naive(ids, table)], device, r)
    err = rel_error(st.triton(ids, table), st.naive(ids, table))
    rows.append(
        bandwidth_row(
            "embedding",
            f"{cfg.name} T={t} vocab={cfg.vocab_size} hidden={hidden}",
            dtype,
            tm,
            nm,
            2 * t * hidden * elt,
            copy_gbs,
            err,
            timing=how,
        )
    )
    # KV store: scatter T tokens' K and V into a cache through a permuted slot mapping.
    hkv = cfg.num_kv_heads
    kk = torch.randn(t, hkv, d, device=device, dtype=dtype)
    vv = torch.randn(t, hkv, d, device=device, dtype=dtype)
    kc, vc = torch.zeros_like(kk), torch.zeros_like(vv)
    slots = torch.randperm(t, device=device)
    meta = AttentionMetadata.build([t], [t], device, slot_mapping=slots.tolist())  # the stage's input
    st = STAGES["kv_store"]
    tm, how = time_kernels([lambda: st.triton(kk, vv, kc, vc, meta)], device, r)
    nm = time_calls([lambda: st.naive(kk, vv, kc, vc, meta)], device, r)
    kc.zero_()
    st.triton(kk, vv, kc, vc, meta)
    err = rel_error(kc[slots], kk)
    rows.append(
        bandwidth_row(
            "kv_store",
            f"{cfg.name} T={t} Hkv={hkv} d={d}",
            dtype,
            tm,
            nm,
            4 * kk.numel() * elt,
            copy_gbs,
            err,
            timing=how,
        )
    )
    return rows


def sampling_cases(cfg: ModelConfig, sizes: Sizes, device) -> list[dict]:
    """Fused Triton sampling vs the naive sort-based PyTorch path, on a mix of settings."""
    from stagewise.stages import STAGES

    st = STAGES["sampling"]
    inputs = st.example_inputs(cfg, sizes.sample_rows, device, torch.float32)
    tm, how = time_kernels([lambda: st.triton(**inputs)], device, sizes.rounds)
    nm = time_calls([lambda: st.naive(**inputs)], device, sizes.rounds)
    greedy = inputs["sampling"].greedy
    same = st.triton(**inputs)[greedy].equal(st.naive(**inputs)[greedy])
    return [
        _row(
            "sampling", f"{cfg.name} B={sizes.sample_rows} vocab={cfg.vocab_size}", torch.float32, tm, naive_ms=nm,
            stock="naive (sort-based torch)", stock_ms=nm, ratio_vs_stock=nm / tm, metric="ms",
            target="ratio_vs_stock > 1", passed=nm / tm > 1, greedy_rows_identical=bool(same), timing=how,
        )
    ]  # fmt: skip


def run_kernel_cases(
    sizes: Sizes, device: torch.device, dtype: torch.dtype, copy_gbs: float, log=print, progress=None
) -> list:
    """Every case for every model of `sizes`; a case that fails is recorded with its error, not fatal.

    `progress`: a rich Progress to show a row per model on (`bench/harness/progress.py`), or None."""
    rows = []
    plan = [(name, True) for name in sizes.models] + [(name, False) for name in sizes.attention_models]
    with row(progress, "kernel cases", total=len(plan)) as bar:
        for name, every_case in plan:
            bar.update(f"kernel cases: {name}")
            rows += _model_cases(name, every_case, sizes, device, dtype, copy_gbs, log)
            bar.advance()
    return rows


def _model_cases(name: str, every_case: bool, sizes, device, dtype, copy_gbs: float, log) -> list:
    """The cases of one model's shapes (all of them, or only attention's)."""
    rows = []
    cfg = PRESETS[name]
    cases = [
        ("flash", lambda cfg=cfg: flash_cases(cfg, sizes, dtype, device)),
        ("paged", lambda cfg=cfg: paged_decode_cases(cfg, sizes, dtype, device, copy_gbs)),
        ("flash decode", lambda cfg=cfg: flash_decode_cases(cfg, sizes, dtype, device, copy_gbs)),
    ]
    if every_case:
        cases += [
            ("gemm", lambda cfg=cfg: gemm_cases(cfg, sizes, dtype, device)),
            ("rows", lambda cfg=cfg: row_kernel_cases(cfg, sizes, dtype, device, copy_gbs)),
            ("sampling", lambda cfg=cfg: sampling_cases(cfg, sizes, device)),
        ]
    for label, case in cases:
        try:
            got = case()
        except Exception as err:  # record and go on: one broken kernel must not hide the others
            got = [{"kernel": label, "shape": name, "error": f"{type(err).__name__}: {err}"[:400]}]
        for line in got:
            log(summary_line(line))
        rows += got
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['kernel']:<18} {row['shape']:<60} ERROR {row['error']}"
    value = row.get("triton_value")
    extra = ""
    if "ratio_vs_stock" in row:
        extra = f" x{row['ratio_vs_stock']:.2f} vs {row.get('stock')}"
    if "share_of_copy" in row:
        extra += f" {100 * row['share_of_copy']:.0f}% of copy"
    err = row.get("rel_err")
    err_txt = f" err {err:.1e}" if isinstance(err, float) and math.isfinite(err) else f" err {err}"
    val = f"{value:,.1f} {row.get('metric', '')}" if value is not None else ""
    return f"{row['kernel']:<18} {row['shape']:<60} {row['triton_ms']:9.4f} ms {val}{extra}{err_txt}"
