"""A row's bits do not depend on the batch: the per-op sweep (the project's design notes, "Batch invariance").

For every op the default engine runs on the torch tier, one probe row is placed at slot 0, the
middle and the end of calls of M rows, M in SWEEP_M, at 1 and at 2 threads, and its output row
must come out as the same bits every time. The ops the rule had to route around are swept too,
as cases that must FAIL — MKL's float32 `x @ w` between M <= 3 and M >= 4, oneDNN's bfloat16
`F.linear` at M = 1 from K = 2048, a textbook attention over all keys in one product — so the sweep
is seen to find a difference where there is one. Shapes stay narrow (N = 64 output columns, the K
that matters) so the whole sweep costs seconds.
"""

import pytest
import torch
import torch.nn.functional as F

from stagewise.quant.dequantize import dequantize
from stagewise.quant.quantize import quantize
from stagewise.stages import (
    attention,
    chunked_attention,
    dequant_gemm_torch,
    gemm_torch,
    rmsnorm,
    rope,
)
from stagewise.tuning import gemm_forms

SWEEP_M = (1, 2, 3, 4, 5, 8, 16, 64, 512, 2048)
THREADS = (1, 2)


def slots(m: int) -> list[int]:
    """Where the probe row goes in a call of m rows: first, middle, last."""
    return sorted({0, m // 2, m - 1})


def distinct_results(run, ms=SWEEP_M, threads=THREADS) -> list[list[tuple]]:
    """run(m, slot) -> the probe's output row in a call of m rows with the probe at `slot`.

    -> the distinct results, each as the list of (threads, m, slot) that gave it: one list means
    the op is batch-invariant over the sweep."""
    found: list[tuple[torch.Tensor, list[tuple]]] = []
    before = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            for m in ms:
                for slot in slots(m):
                    row = run(m, slot)
                    for seen, where in found:
                        if torch.equal(seen, row):
                            where.append((t, m, slot))
                            break
                    else:
                        found.append((row.clone(), [(t, m, slot)]))
    finally:
        torch.set_num_threads(before)
    return [where for _, where in found]


def assert_invariant(groups: list[list[tuple]], what: str) -> None:
    summary = "; ".join(f"{len(g)} calls from (threads, M, slot) {g[0]}" for g in groups)
    assert len(groups) == 1, f"{what}: the probe row came out {len(groups)} ways ({summary})"


_BASE: dict[tuple, torch.Tensor] = {}  # (shape, seed) -> max(SWEEP_M) random rows, made once


def rows_with_probe(m: int, slot: int, probe: torch.Tensor, seed: int) -> torch.Tensor:
    """[m, *probe.shape] random rows (the first m of one fixed draw), the probe at `slot`."""
    key = (tuple(probe.shape), seed)
    if key not in _BASE:
        gen = torch.Generator().manual_seed(seed)
        _BASE[key] = torch.randn(max(SWEEP_M), *probe.shape, generator=gen)
    x = _BASE[key][:m].to(probe.dtype)  # a copy when the dtype changes, else cloned below
    x = x.clone() if x.dtype == torch.float32 else x
    x[slot] = probe
    return x


def probe_of(*shape: int, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- the row ops: norms, softmax, sums, activations, RoPE ----


@pytest.mark.parametrize("hidden", [576, 2048])
@pytest.mark.parametrize("tier", ["naive", "torch"])
def test_rmsnorm_with_residual_is_row_invariant(hidden, tier):
    fn = rmsnorm.STAGE.tier(tier)
    weight = 1 + 0.1 * probe_of(hidden, seed=2)
    probe, probe_res = probe_of(hidden), probe_of(hidden, seed=3)

    def run(m, slot):
        x, res = rows_with_probe(m, slot, probe, 10), rows_with_probe(m, slot, probe_res, 20)
        out, res_out = fn(x=x, weight=weight, eps=1e-5, residual=res)
        return torch.cat([out[slot], res_out[slot]])

    assert_invariant(distinct_results(run), f"rmsnorm {tier} tier, hidden {hidden}")


@pytest.mark.parametrize(
    ("name", "op", "width"),
    [
        ("softmax", lambda x: torch.softmax(x, dim=-1), 1000),
        ("log_softmax (the logprobs)", lambda x: torch.log_softmax(x, dim=-1), 4099),
        ("sum over the last dim", lambda x: x.sum(dim=-1, keepdim=True), 1536),
        ("sum of 64 (an attention chunk)", lambda x: x.sum(dim=-1, keepdim=True), 64),
        ("exp", torch.exp, 576),
        ("silu(gate) * up", lambda x: F.silu(x[:, :768]) * x[:, 768:], 1536),
    ],
)
def test_row_ops_are_row_invariant(name, op, width):
    probe = 3 * probe_of(width)
    assert_invariant(distinct_results(lambda m, s: op(rows_with_probe(m, s, probe, 30))[s]), name)


@pytest.mark.parametrize("tier", ["naive", "torch"])
def test_rope_is_row_invariant(tier):
    fn = rope.STAGE.tier(tier)
    cache = rope.build_cos_sin_cache(4096, 64, 100000.0, "cpu")
    probe_q, probe_k = probe_of(9, 64), probe_of(3, 64, seed=2)

    def run(m, slot):
        gen = torch.Generator().manual_seed(m)
        positions = torch.randint(0, 4096, (m,), generator=gen)
        positions[slot] = 1234
        q, k = rows_with_probe(m, slot, probe_q, 40), rows_with_probe(m, slot, probe_k, 50)
        q_out, k_out = fn(positions=positions, q=q, k=k, cos_sin_cache=cache)
        return torch.cat([q_out[slot], k_out[slot]])

    assert_invariant(distinct_results(run), f"rope {tier} tier")


# ---- the packed GEMM without the compiled kernel: PyTorch's int4 CPU kernel, the bf16 copies ----
# (`stock_kernels`; the integer-dot kernel that serves these kinds by default: tests/cpu/)


@pytest.mark.parametrize(
    ("kind", "k", "n", "ms"),
    [
        ("q4_1", 576, 64, SWEEP_M),
        ("q4_0", 2048, 64, SWEEP_M),
        ("q8_0", 576, 64, SWEEP_M),  # split into two nibble halves for the same kernel
        ("q4_1", 576, 49152, (1, 2, 3, 4, 5)),  # the LM head's width
    ],
)
def test_the_int4_cpu_kernel_is_row_invariant(kind, k, n, ms, stock_kernels):
    """Each output is one float32 chain over K inside the kernel, whatever M (torch pinned)."""
    w = quantize(probe_of(k, n, seed=5) / 8, kind)
    assert dequant_gemm_torch.form_name(w) in ("int4pack", "q8_nibbles")
    probe = probe_of(k)
    run = lambda m, s: dequant_gemm_torch.gemm(rows_with_probe(m, s, probe, 60), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run, ms), f"int4 kernel {kind} [{k}, {n}]")


def test_a_four_bit_weight_the_int4_kernel_cannot_take_is_row_invariant(stock_kernels):
    """N not a multiple of 16: dequantized, then a float32 product with its rows padded."""
    w = quantize(probe_of(576, 40, seed=12) / 8, "q4_1")
    assert not dequant_gemm_torch.supported(w)
    probe = probe_of(576)
    run = lambda m, s: dequant_gemm_torch.gemm(rows_with_probe(m, s, probe, 75), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run), "q4_1 [576, 40], dequantized")


def test_a_bfloat16_weight_copy_is_row_invariant(stock_kernels):
    """8-bit with N not a multiple of 16 (and q6_k) keep a bfloat16 copy for `F.linear`."""
    w = quantize(probe_of(2048, 40, seed=6) / 8, "q8_0")
    assert dequant_gemm_torch.form_name(w) == "bf16"
    probe = probe_of(2048)
    run = lambda m, s: dequant_gemm_torch.gemm(rows_with_probe(m, s, probe, 70), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run), "bf16 copy [2048, 40]")


def wide_bf16_copy():
    w = quantize(probe_of(2048, 3000, seed=7) / 8, "q8_0")  # 3000 % 16 != 0: a bf16 copy
    assert dequant_gemm_torch.form_name(w) == "bf16"
    return w, probe_of(2048)


def test_a_wide_bfloat16_copy_is_row_invariant(stock_kernels):
    """K = 2048, where oneDNN's bf16 `F.linear` may take another kernel for one row: padded rows."""
    w, probe = wide_bf16_copy()
    run = lambda m, s: dequant_gemm_torch.gemm(rows_with_probe(m, s, probe, 80), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run, (1, 2, 3, 4, 5, 8, 16), threads=(2,)), "bf16 copy [2048, 3000]")


def test_the_sweep_sees_a_bfloat16_product_whose_k_order_depends_on_m(stock_kernels):
    """The negative control at this shape. oneDNN picks its bf16 `F.linear` kernel by the CPU's
    instruction set: on AVX-512 machines one row and two rows part from K = 2048, on AVX2-only ones
    they may not, so the control cannot be borrowed from it. A product that sums K in two halves
    for a single row (what a kernel chosen by M does) must be seen; the padded path above holds
    on both kinds of CPU."""
    w, probe = wide_bf16_copy()
    wb = dequantize(w).to(torch.bfloat16).float()  # [K, N], the bf16 copy's values

    def by_m(m, s):
        x = rows_with_probe(m, s, probe, 80).to(torch.bfloat16).float()  # [m, K]
        if m == 1:
            return (x[:, :1024] @ wb[:1024] + x[:, 1024:] @ wb[1024:])[s]  # two halves of K, then added
        return (x @ wb)[s]

    assert len(distinct_results(by_m, (1, 2), threads=(2,))) > 1, "the sweep sees no difference"


# ---- the float32 GEMM: the torch tier's forms, padded ----


def test_the_padded_product_with_an_in_major_weight_is_row_invariant():
    """A [K, N] row-major weight (the GPU layout, or a model built in memory): plain, padded."""
    w = probe_of(576, 64, seed=13)  # [K, N] contiguous
    probe = probe_of(576)
    run = lambda m, s: gemm_torch.gemm(rows_with_probe(m, s, probe, 105), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run), "in-major [576, 64]")


@pytest.mark.parametrize("form", gemm_forms.FORMS)
@pytest.mark.parametrize(("k", "n"), [(576, 64), (2048, 64)])
def test_every_padded_gemm_form_gives_a_row_the_same_bits_as_plain(form, k, n):
    """`gemm_invariant`: plain and blocked padded to 4 rows, transposed to 16 columns; every form,
    every M, every slot, 1 and 2 threads: the one result of the plain padded product."""
    w = probe_of(n, k, seed=9).t()  # [K, N], out-major like the model's weights
    probe = probe_of(k)
    run = lambda m, s: gemm_forms.gemm_invariant(form, rows_with_probe(m, s, probe, 100), w)[s]  # noqa: E731
    groups = distinct_results(run)
    assert_invariant(groups, f"{form} padded [{k}, {n}]")
    x = rows_with_probe(5, 0, probe, 100)
    assert torch.equal(run(5, 0), gemm_forms.gemm_invariant("plain", x, w)[0]), f"{form} != plain"


def test_the_torch_tier_gemm_is_row_invariant_whatever_form_was_chosen(monkeypatch):
    """`gemm_torch.gemm` with the calibrated forms (one per M bucket) all agreeing on this CPU."""
    forms = gemm_forms.CpuForms(
        chosen={"decode": "transposed", "small batch": "blocked", "batch": "plain"},
        agreeing=gemm_forms.FORMS,
    )
    monkeypatch.setattr(gemm_forms, "CPU_FORMS", forms)
    w = probe_of(192, 576, seed=10).t()
    assert gemm_forms.agreeing_forms([w]) == gemm_forms.FORMS  # this BLAS: all three agree
    probe = probe_of(576)
    run = lambda m, s: gemm_torch.gemm(rows_with_probe(m, s, probe, 110), w)[s]  # noqa: E731
    assert_invariant(distinct_results(run), "gemm_torch.gemm, three forms by M")
    variant = lambda m, s: gemm_torch.gemm(rows_with_probe(m, s, probe, 110), w, batch_invariant=False)[s]  # noqa: E731
    assert len(distinct_results(variant, (1, 2, 3, 4, 8))) > 1, "the sweep sees no difference"


# ---- the float32 GEMM ----


def test_the_textbook_float32_gemm_is_not_row_invariant():
    """The naive tier's `x @ w` (MKL): M = 1, M = 2..3 and M >= 4 take three kernels. The naive tier
    is the textbook and stays so: out of the rule, measured (attention.py's docstring)."""
    w = probe_of(64, 576, seed=8).t()  # [576, 64], out-major like the model's weights
    probe = probe_of(576)
    groups = distinct_results(lambda m, s: (rows_with_probe(m, s, probe, 90) @ w)[s], (1, 2, 3, 4, 8))
    assert len(groups) >= 2, "the sweep sees no difference"


# ---- attention: every query row over fixed 64-key chunks ----


def _sequence(length: int, heads: int, kv_heads: int, seed: int = 11):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, 64, generator=gen)
    k = torch.randn(length, kv_heads, 64, generator=gen)
    v = torch.randn(length, kv_heads, 64, generator=gen)
    return q, k, v


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 2)])  # G = 3 (SmolLM2) and G = 4
def test_an_attention_row_is_the_same_bits_in_every_call(heads, kv_heads):
    """Query position P over its P + 1 keys, as row `slot` of a chunk of M query rows (M = 1: a
    decode row), among D decoding neighbours, at 1 and 2 threads: one result."""
    length = 1100
    q, k, v = _sequence(length, heads, kv_heads)
    position = 600  # its keys: 601, not a multiple of 64
    scale = 0.125

    def run(m, slot):
        start = position - slot  # the chunk's rows are positions start .. start + m - 1
        end = start + m
        if end > length:
            start, end = length - m, length
        rows = chunked_attention.sequence_rows(q[start:end], k[:end], v[:end], scale)
        return rows[position - start]

    ms = (1, 2, 3, 4, 5, 8, 16, 64, 512)
    assert_invariant(distinct_results(run, ms), f"attention rows, G = {heads // kv_heads}")


@pytest.mark.parametrize("neighbours", [0, 1, 4, 31])
def test_a_decode_row_equals_the_same_row_of_a_prefill(neighbours):
    """`decode_rows` (D sequences padded to the longest) against `sequence_rows` (a prefill)."""
    q, k, v = _sequence(700, 9, 3)
    position, scale = 300, 0.125
    prefill_row = chunked_attention.sequence_rows(q[:701], k, v, scale)[position]
    gen = torch.Generator().manual_seed(neighbours)
    lens = [position + 1] + torch.randint(1, 700, (neighbours,), generator=gen).tolist()
    padded = chunked_attention.padded_length(max(lens))
    ks = torch.randn(len(lens), padded, 3, 64, generator=gen)
    vs = torch.randn(len(lens), padded, 3, 64, generator=gen)
    ks[0, : position + 1], vs[0, : position + 1] = k[: position + 1], v[: position + 1]
    qs = torch.randn(len(lens), 9, 64, generator=gen)
    qs[0] = q[position]
    for threads in THREADS:
        torch.set_num_threads(threads)
        out = chunked_attention.decode_rows(qs, ks, vs, torch.tensor(lens), scale)
        assert torch.equal(out[0], prefill_row), f"{neighbours} neighbours, {threads} threads"


def test_attention_in_one_product_over_all_keys_is_not_row_invariant():
    """The textbook (and batch_invariant=False's prefill): one product over every key per call."""
    q, k, v = _sequence(300, 9, 3)
    position = 200

    def run(m, slot):
        start = position - slot
        rows = attention.causal_attention_one_sequence(q[start : start + m], k[: start + m], v[: start + m], 0.125)
        return rows[slot]

    assert len(distinct_results(run, (1, 2, 3, 4, 8, 16), threads=(1,))) > 1, "the sweep sees no difference"
