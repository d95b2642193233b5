"""Batch invariance on a GPU: the triton tier's invariant paths against its variant ones, one run.

    matmul           qkv and down projections: a decode batch, and a prefill that crosses 16 rows
    dequant_matmul   the same as 4-bit q4_1 codes (W4A16)
    paged_attention  a decode step of many sequences, one long sequence alone (where a variant
                     splits its keys by occupancy), and a batch of prefills

Each row answers two questions about `batch_invariant=True` (the stages' default) beside
`batch_invariant=False` (today's fastest paths):

- the bits: a probe row computed alone and the same row inside the batch, at a middle slot.
  `same_bits` (invariant) must be True, and is the row's `passed`; `variant_same_bits` records
  what the variant paths give (on a GPU usually False: another kernel, a split by count).
- the cost: GPU milliseconds per call, invariant (`triton_ms`) and variant (`stock_ms`), timed
  alternately in the same process (CUDA graph replay, `time_kernels`); `ratio_vs_stock` is
  variant / invariant, so 1.0 means invariance is free and 0.8 that it takes 25% longer.

A dry run (the CPU interpreter, tiny shapes) proves the code; there the bits depend on numpy's
dot, which is not row-invariant (tests/devtools/test_invariance_rows.py installs a fixed-order
one, as the kernel tests do).
"""

import torch

from stagewise.config import PRESETS
from stagewise.devtools.gpu.device_timer import copies_for, rel_error, time_kernels
from stagewise.devtools.gpu.kernel_bench import Sizes, _row, projection_shapes
from stagewise.devtools.gpu.quant_decode import random_packed

DECODE_M = 8  # rows of the decode GEMM cases
BLOCK = 16  # KV cache tokens per block


def _timed(make_call, inputs: list, device, rounds: int) -> tuple[float, float, str]:
    """(invariant ms, variant ms, how): make_call(inputs, batch_invariant) over every copy of the
    inputs, invariant and variant alternated twice on a GPU (once on the CPU), means of medians."""
    times = {True: [], False: []}
    how = ""
    for _ in range(2 if device.type == "cuda" else 1):
        for invariant in (True, False):
            calls = [lambda x=x, bi=invariant: make_call(x, bi) for x in inputs]
            ms, how = time_kernels(calls, device, rounds)
            times[invariant].append(ms)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return mean(times[True]), mean(times[False]), how + ", invariant and variant alternated"


def _result(kind: str, shape: str, dtype, inv_ms, var_ms, how, same, var_same, err) -> dict:
    return _row(
        kind, shape, dtype, inv_ms, stock="batch_invariant=False", stock_ms=var_ms,
        ratio_vs_stock=var_ms / inv_ms, same_bits=same, variant_same_bits=var_same,
        target="same_bits (a row alone = in the batch)", passed=same, rel_err=err, timing=how,
    )  # fmt: skip


def _same_row(run, rows: torch.Tensor, slot: int, invariant: bool) -> bool:
    """run(rows, batch_invariant) -> output rows: is rows[slot]'s output the same bits alone?"""
    return torch.equal(run(rows[slot : slot + 1], invariant)[0], run(rows, invariant)[slot])


def gemm_cases(sizes: Sizes, device, dtype) -> list[dict]:
    """The plain GEMM and the W4A16 dequantize-GEMM at qkv and down shapes, decode and prefill."""
    from stagewise.kernels.dequant_matmul import dequant_matmul
    from stagewise.kernels.matmul import matmul

    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name in sizes.models:
        cfg = PRESETS[name]
        shapes = projection_shapes(cfg)
        for proj in ("qkv", "down"):
            k, n = shapes[proj]
            for kind in (str(dtype).removeprefix("torch."), "q4_1"):  # the float weight, then 4-bit codes
                if kind == "q4_1":
                    weights = random_packed("q4_1", k, n, device, gen)
                    w_bytes = weights.nbytes

                    def run(a, bi, w=weights):
                        return dequant_matmul(a, w.codes, w.scales, w.mins, bits=4, offset=0, batch_invariant=bi)
                else:
                    weights = torch.randn(k, n, device=device, dtype=dtype, generator=gen) * k**-0.5
                    w_bytes = weights.numel() * weights.element_size()

                    def run(a, bi, w=weights):
                        return matmul(a, w, batch_invariant=bi)

                label = "dequant_matmul" if kind == "q4_1" else "matmul"
                for m in (DECODE_M, max(sizes.gemm_m)):
                    a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
                    slot = m // 2
                    same, var_same = (_same_row(run, a, slot, bi) for bi in (True, False))
                    copies = copies_for(w_bytes + m * (k + n) * dtype.itemsize, sizes.working_set)
                    inputs = [a] + [torch.randn_like(a) for _ in range(copies - 1 if device.type == "cuda" else 0)]
                    inv_ms, var_ms, how = _timed(run, inputs, device, sizes.rounds)
                    err = rel_error(run(a, True), run(a, False))  # the two paths differ by rounding only
                    shape = f"{cfg.name} {proj} {kind} M={m} K={k} N={n}"
                    rows.append(_result(label, shape, dtype, inv_ms, var_ms, how, same, var_same, err))
                del weights
    return rows


def _paged_batch(cfg, seq_lens: list[int], q_lens: list[int], device, dtype, gen) -> dict:
    """Caches holding every sequence's keys in blocks of 16 (one after another), the query rows."""
    blocks = [-(-n // BLOCK) for n in seq_lens]
    shape = (sum(blocks), BLOCK, cfg.num_kv_heads, cfg.head_dim)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, nb in enumerate(blocks):
        table[b, :nb] = torch.arange(start, start + nb, dtype=torch.int32)
        start += nb
    q = torch.randn(sum(q_lens), cfg.num_heads, cfg.head_dim, device=device, dtype=dtype, generator=gen)
    return {
        "q": q,
        "k_cache": torch.randn(shape, device=device, dtype=dtype, generator=gen),
        "v_cache": torch.randn(shape, device=device, dtype=dtype, generator=gen),
        "block_table": table.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "cu_seqlens_q": torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32),
        "lens": (max(q_lens), max(seq_lens)),
    }


def _attend(batch: dict, bi: bool, scale: float) -> torch.Tensor:
    from stagewise.kernels.paged_attention import paged_attention

    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "cu_seqlens_q")]
    max_q, max_seq = batch["lens"]
    return paged_attention(*args, scale, max_q_len=max_q, max_seq_len=max_seq, batch_invariant=bi)


def attention_cases(sizes: Sizes, device, dtype) -> list[dict]:
    """Paged attention: a decode step of many sequences; sequence 0 alone (the variant splits its
    keys over programs by occupancy); a batch of prefills, sequence 0's rows alone and in it."""
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for name in sizes.models:
        cfg = PRESETS[name]
        scale = cfg.head_dim**-0.5
        cases = {
            f"decode {sizes.decode_seqs} seqs x {sizes.decode_ctx}": ([sizes.decode_ctx] * sizes.decode_seqs, 1),
            f"prefill {sizes.attn_batch} x {sizes.attn_len}": ([sizes.attn_len] * sizes.attn_batch, sizes.attn_len),
        }
        for what, (seq_lens, q_len) in cases.items():
            batch = _paged_batch(cfg, seq_lens, [q_len] * len(seq_lens), device, dtype, gen)
            alone = dict(batch, block_table=batch["block_table"][:1], seq_lens=batch["seq_lens"][:1])
            alone.update(q=batch["q"][:q_len], cu_seqlens_q=batch["cu_seqlens_q"][:2], lens=(q_len, seq_lens[0]))
            same, var_same = (
                torch.equal(_attend(alone, bi, scale), _attend(batch, bi, scale)[:q_len]) for bi in (True, False)
            )
            err = rel_error(_attend(batch, True, scale), _attend(batch, False, scale))
            heads = f"H={cfg.num_heads} Hkv={cfg.num_kv_heads} d={cfg.head_dim}"
            timed = [(f"{cfg.name} {what} {heads}", batch)]
            if q_len == 1:  # sequence 0 alone: where the variant splits its keys by occupancy
                timed.append((f"{cfg.name} decode 1 seq x {seq_lens[0]} (alone) {heads}", alone))
            for shape, b in timed:
                inv_ms, var_ms, how = _timed(lambda x, bi, s=scale: _attend(x, bi, s), [b], device, sizes.rounds)
                rows.append(_result("paged_attention", shape, dtype, inv_ms, var_ms, how, same, var_same, err))
            del batch, alone
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def invariance_cases(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every row of this family: GEMMs, then attention."""
    return gemm_cases(sizes, device, dtype) + attention_cases(sizes, device, dtype)
