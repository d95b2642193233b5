"""The seeds' worked numbers (chapters 5-8, Llama 3 405B on an H100), recomputed.

(The seeds are the two source articles of the project; the README's section "The seeds" names them and
what they cover. The chapters cited here are those of its article 003.)

Each `Row` holds a number as the seeds print it, our value under the seeds'
own assumptions (d = hidden = 16384, L = 126, P = 405e9, fp16, a 1 PFLOP/s /
3.3 TB/s "H100"), the relative difference, and the *exact* value for the
real architecture (GQA with 8 KV heads, SwiGLU with inter = 53248, exact
parameter count, causal attention where a real kernel skips the masked half),
with a note on where and why the two differ.

How the seeds' "~2.5 hours for one naive step at N = 1M" comes out: the
chapter-5 linear term 2*L*11*N*d^2 = 7.44e17 FLOPs alone is 0.21 h at
1 PFLOP/s; adding the chapter-8 attention term 4*L*N^2*d = 8.26e18 FLOPs
gives 9.00e18 FLOPs = 9002 s = 2.50 h. That is the number, reproduced to 0.03%.
The attention term is the *full* N x N score matrix (what a naive
masked-softmax implementation executes); a causal kernel does half of it, and
the exact count is then 1.37 h.
"""

from dataclasses import dataclass

from stagewise.calc.counts import (
    attention_flops,
    kv_bytes,
    kv_bytes_per_token,
    linear_coefficient,
    linear_flops,
    seeds_attention_flops,
    seeds_kv_bytes_per_token,
    seeds_linear_flops,
    seeds_params_flops,
    weight_bytes,
)
from stagewise.calc.hardware import HARDWARE
from stagewise.calc.steps import decode_step, naive_step, prefill_step
from stagewise.config import PRESETS


@dataclass(frozen=True)
class SeedsAssumptions:
    layers: int = 126  # L, Llama 3 405B
    hidden: int = 16384  # d in the seeds (the residual width; also H * head_dim = 128 * 128)
    params: float = 405e9  # P, the round number in the model's name
    dtype_bytes: int = 2  # fp16
    coefficient: float = 11  # the seeds' "11 d^2 of matmul weights per block"
    peak_flops: float = 1e15  # "about 1000 TFLOP/s" fp16
    bandwidth: float = 3.3e12  # "about 3.3 TB/s"


@dataclass(frozen=True)
class Row:
    chapter: str  # where the seeds state the number
    quantity: str  # what it is
    unit: str  # the unit the seeds use (KiB = 1024 B; GB, TB = 1e9, 1e12 B)
    seed: float  # the number as the seeds print it
    ours: float  # our value under the seeds' assumptions, in `unit`
    tolerance: float  # relative difference the seeds' rounding allows
    formula: str  # how `ours` is computed
    exact: float | None  # the value for the real architecture, in `unit` (None: same as ours)
    note: str  # where the seeds' simplification differs from the exact count

    @property
    def rel_diff(self) -> float:
        return (self.ours - self.seed) / self.seed


def seeds_worked_examples(seeds: SeedsAssumptions | None = None) -> list[Row]:
    """Every worked number of chapters 5-8 next to ours; see the module docstring for the 2.5 h."""
    s = seeds or SeedsAssumptions()
    cfg = PRESETS["llama-3-405b"]  # the real architecture, for the `exact` column
    hw = HARDWARE["h100-seeds"]
    dt, b = "fp16", s.dtype_bytes
    L, d = s.layers, s.hidden
    rows: list[Row] = []

    def add(chapter, quantity, unit, seed, ours, tolerance, formula, exact, note):
        rows.append(Row(chapter, quantity, unit, seed, ours, tolerance, formula, exact, note))

    # --- chapter 6: the KV cache with MHA
    mha = seeds_kv_bytes_per_token(L, d, b)
    gqa = kv_bytes_per_token(cfg, b)
    add("ch.6", "KV cache per token, MHA, fp16", "KiB", 8064, mha.value / 1024, 1e-9, mha.formula,
        gqa.value / 1024,
        "the seeds' 'KB' is KiB (16384*2*2 = 65,536 B = 64 KiB per layer). Llama 3 405B has 8 KV heads (GQA): "
        "2*126*8*128*2 = 516,096 B = 504 KiB, 16x less")  # fmt: skip
    add("ch.6", "KV cache for 1,000,000 tokens, MHA", "TB", 8.26, mha.value * 1e6 / 1e12, 1e-3,
        "8,257,536 B * 1e6", gqa.value * 1e6 / 1e12,
        "KiB per token but decimal TB in total; with the real GQA it is 0.52 TB")  # fmt: skip

    # --- chapter 5: one naive (recompute everything) step
    lin_1k = seeds_linear_flops(L, d, 1000, s.coefficient)
    naive_1k = naive_step(cfg, hw, dt, b, 1000, 1)
    coeff = linear_coefficient(cfg)
    add("ch.5", "naive step at N=1000: linear-layer FLOPs", "TFLOP", 744, lin_1k.value / 1e12, 1e-3, lin_1k.formula,
        linear_flops(cfg, 1000).value / 1e12,
        f"the real per-block coefficient is {coeff.value:g}, not 11: GQA K and V are 1/16 of Q (QKV+O = 2.125 d^2), "
        "SwiGLU inter = 3.25 d (3*3.25 = 9.75 d^2); plus the LM head 2*V*d")  # fmt: skip
    add("ch.5", "naive step at N=1000: time at 1 PFLOP/s", "s", 0.74, lin_1k.value / s.peak_flops, 0.01,
        "linear FLOPs / 1e15 (attention left out)", naive_1k.compute_time.value,
        "exact: all matmuls + the full masked 1000x1000 attention (8.3 TFLOP), 100% of 1 PFLOP/s")  # fmt: skip
    n = 10**6
    naive_1m = seeds_linear_flops(L, d, n, s.coefficient).value + seeds_attention_flops(L, d, n, n).value
    causal_1m = linear_flops(cfg, n).value + attention_flops(cfg, n, n).value
    add("ch.5", "naive step at N=1,000,000: time at 1 PFLOP/s", "h", 2.5, naive_1m / s.peak_flops / 3600, 0.01,
        "(2*L*11*N*d^2 + 4*L*N^2*d) / 1e15 / 3600 = (7.44e17 + 8.26e18) / 1e15 / 3600",
        naive_step(cfg, hw, dt, b, n, 1).compute_time.value / 3600,
        f"the linear term alone is {lin_1k.value * 1000 / s.peak_flops / 3600:.2f} h; the 2.5 h needs ch.8's "
        f"full N x N attention term. A causal kernel skipping the masked half: "
        f"{causal_1m / s.peak_flops / 3600:.2f} h")  # fmt: skip
    add("ch.5", "matmul weights per block, in d^2", "x d^2", 11, s.coefficient, 1e-9, "the seeds' choice",
        coeff.value, coeff.formula)  # fmt: skip

    # --- chapter 8: prefill of N = 100k tokens
    N = 100_000
    pre, dec = prefill_step(cfg, hw, dt, b, N, 1), decode_step(cfg, hw, dt, b, N, 1)
    pre_lin, pre_att = seeds_params_flops(s.params, N), seeds_attention_flops(L, d, N, N)
    weights = 2 * s.params
    kv_100k = kv_bytes(cfg, b, N)
    pre_flops, pre_bytes = pre_lin.value + pre_att.value, weights + kv_100k.value
    add("ch.8", "prefill N=100k: linear FLOPs", "FLOP", 8.1e16, pre_lin.value, 1e-9, pre_lin.formula,
        linear_flops(cfg, N).value, "exact: 2*N*(matmul weights) + LM head for the last token only")  # fmt: skip
    add("ch.8", "prefill N=100k: attention FLOPs", "FLOP", 8.26e16, pre_att.value, 1e-3, pre_att.formula,
        attention_flops(cfg, N, N).value,
        "causal: token n sees n keys, so 2*L*H*d*N*(N+1), half the seeds' full N x N. "
        "H*d = 16384 = d, so the seeds' d is right for the FLOPs even with GQA")  # fmt: skip
    add("ch.8", "prefill N=100k: total FLOPs", "FLOP", 1.64e17, pre_flops, 5e-3, "linear + attention",
        pre.flops.value, "exact total with causal attention")  # fmt: skip
    add("ch.8", "weights, fp16", "GB", 810, weights / 1e9, 1e-9, "2 bytes * 405e9",
        weight_bytes(cfg, b).value / 1e9, f"exact P = {cfg.num_parameters():,}")  # fmt: skip
    add("ch.8", "KV cache of 100k tokens", "GB", 51.6, kv_100k.value / 1e9, 1e-3, kv_100k.formula, None,
        "this is GQA (8 KV heads, 516,096 B/token), not ch.6's MHA, which would give "
        f"{kv_bytes(cfg, b, N, mha=True).value / 1e9:.1f} GB (and intensities ~1.9x lower)")  # fmt: skip
    add("ch.8", "prefill N=100k: bytes (weights + KV written)", "GB", 861.6, pre_bytes / 1e9, 1e-3, "810 GB + 51.6 GB",
        pre.bytes.value / 1e9, "exact: matmul and norm weights + 100k gathered embedding rows + KV")  # fmt: skip
    add("ch.8", "prefill N=100k: arithmetic intensity", "FLOP/B", 190_000, pre_flops / pre_bytes, 5e-3,
        "total FLOPs / total bytes", pre.intensity.value, "exact: causal attention halves its FLOPs")  # fmt: skip

    # --- chapter 8: one decode step at N = 100k
    dec_lin, dec_att = seeds_params_flops(s.params, 1), seeds_attention_flops(L, d, 1, N)
    dec_flops, dec_bytes = dec_lin.value + dec_att.value, weights + kv_100k.value
    add("ch.8", "decode at N=100k: linear FLOPs", "FLOP", 8.1e11, dec_lin.value, 1e-9, dec_lin.formula,
        linear_flops(cfg, 1).value, "exact: matmul weights (no embedding table) + LM head")  # fmt: skip
    add("ch.8", "decode at N=100k: attention FLOPs", "FLOP", 8.25e11, dec_att.value, 2e-3, dec_att.formula,
        attention_flops(cfg, N, 1).value, "the seeds print 8.25e11 for 8.2575e11 (rounded down)")  # fmt: skip
    add("ch.8", "decode at N=100k: total FLOPs", "FLOP", 1.635e12, dec_flops, 1e-3, "linear + attention",
        dec.flops.value, "exact total")  # fmt: skip
    add("ch.8", "decode at N=100k: bytes (weights + KV read)", "GB", 861.6, dec_bytes / 1e9, 1e-3, "810 GB + 51.6 GB",
        dec.bytes.value / 1e9, "exact: matmul + norm weights, one embedding row, KV: N read, 1 written")  # fmt: skip
    add("ch.8", "decode at N=100k: arithmetic intensity", "FLOP/B", 1.9, dec_flops / dec_bytes, 0.01,
        "total FLOPs / total bytes", dec.intensity.value, "memory-bound: far below the ridge")  # fmt: skip
    add("ch.8", "H100 ridge point (fp16)", "FLOP/B", 300, s.peak_flops / s.bandwidth, 0.02, "1e15 / 3.3e12",
        HARDWARE["h100"].ridge_point("fp16"), "exact: the H100 SXM datasheet, 989 TFLOP/s / 3.35 TB/s")  # fmt: skip
    return rows
