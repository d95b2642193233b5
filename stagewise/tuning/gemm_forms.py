"""Which way of asking this CPU's BLAS for `x @ w` streams the weights fastest: the GEMM forms,
measured once per machine and model shape.

    x [M, K] @ w [K, N] -> [M, N]        (M = tokens in the step, K = in features, N = out features)

The `naive` tier of qkv_proj, o_proj, ffn and lm_head is that one line,
`x @ w`, and on a GPU (or for large M) it is also the fastest PyTorch; their
torch tier (`stages/gemm_torch.py`) asks this module which form to use. On a
CPU, decode makes M tiny (1 token per running request): every weight is read
once to do 2 FLOPs per element, so a step's time is the time to *stream* the
weights, and how the BLAS library is asked decides how close it gets to the
memory's read bandwidth. Three ways to ask for the same product, all reading
the weights stored "out-major" (`w_t` [N, K] row-major, the layout of
PyTorch's nn.Linear, GGUF and safetensors files, seen here as a [K, N] view;
`models/weights.py` stores them so on the CPU):

    plain        x @ w              the GEMM (or GEMV when M = 1) of the textbook
    transposed   (w_t @ x^T)^T      C^T = w_t @ x^T: a tall, skinny GEMM that walks
                                    each weight row once; one decode row is duplicated
                                    into two columns (extra arithmetic, no extra bytes)
    blocked      x @ w[:, j:j+64]   for every block of 64 output columns, as one batched
                 for all j at once  product: w_t viewed [N/64, 64, K] (no copy), x shared
                                    by every block; the [N/64, M, 64] result is laid
                                    back out as [M, N] (M*N numbers, a small copy)

Which one wins is a property of the BLAS build *and* the CPU it runs on, not
a law: on a 2-core AMD EPYC the transposed form streamed one decode row about
twice as fast as `x @ w`, on a 2-core Intel Xeon it was the slowest, and there
the blocked form won for 4-12 rows (the BLAS likely packs each weight panel
into a buffer before multiplying, a second pass over the bytes, while a batch
of small products is multiplied in place). The tables, and how they were
taken (`python -m stagewise.bench.scripts.cpu_forms --only gemm`), are in
benchmarks/README.md, "CPU tier notes".

Batch invariance (the project's design notes): a row's bits must not depend
on M. MKL's float32 GEMM has three kernels — M = 1, M = 2-3, M >= 4 — that add a dot
product's K terms in different orders, and with 2 threads an M of 5-7 or
9-11 hands its last rows to a small-M kernel. From 4 rows (in multiples of 4)
every output is one and the same chain of K terms: the plain and the blocked
forms give the same bits for any M, and so does the transposed form from 16
columns (its rows are the product's columns). So the batch-invariant tier
pads each call: plain and blocked to a multiple of ROW_MULTIPLE rows,
transposed to a multiple of COLUMN_MULTIPLE (`gemm_invariant`); a decode row
then costs the arithmetic of 4 (or 16) rows, which hides under streaming the
weights (measured by the calibration below, which times the padded forms).
Whether the padded forms really agree is a property of the BLAS on this CPU,
so it is checked once per process on the model's own shapes (`agreeing_forms`,
a few small products): a form that disagrees is not used by the invariant tier.
tests/stages/test_batch_invariance_ops.py sweeps every form over
M = 1..2048 at 1 and 2 threads. `batch_invariant=False` runs the forms
unpadded (the M-dependent bits of before), chosen by their own unpadded
timings: padding changes which form is fastest for a lone row.

So the choice is measured on the model's own weights: `calibrate_cached`
(called through `models/prepare.py` when `LLM` loads a CPU model whose
projections run the torch tier) streams them with each form (alternating,
best of a few passes) at one M per bucket (a lone decode row, a small batch,
a batch), and the torch tier then asks the BLAS the fastest way for each.
Until then (and off the CPU, for other layouts, or for M > SMALL_M) it is
plain `x @ w`. `CPU_FORMS` says what was chosen: like an autotuner's cache it
is the one per-process record here, a property of the machine, not of a
request. Like an autotuner's cache it is also kept on disk
(`gemm_forms_cache.py`), keyed by the CPU, torch version, thread count and
shapes, so the next process on the same machine reads the answer instead of
measuring again.
"""

import time
from dataclasses import dataclass, field

import torch

from stagewise.runtime import load_phase
from stagewise.tuning import cpu_load, gemm_forms_cache

SMALL_M = 64  # above this many rows every form is compute-bound and `x @ w` is at least as fast
FORMS = ("plain", "transposed", "blocked")
BUCKET_M = {"decode": 1, "small batch": 8, "batch": 32}  # the M each bucket is measured at
BLOCK_N = 64  # output columns per block of the blocked form ([K, 64] floats: 147 KB at K = 576)
ROW_MULTIPLE = 4  # plain / blocked, batch-invariant: rows padded to this (MKL's M >= 4 kernels)
COLUMN_MULTIPLE = 16  # transposed, batch-invariant: M is the product's columns, padded to this


def bucket(m: int) -> str:
    """Which measured choice covers M rows: decode rows (M <= 3), a small batch (M <= 12), a batch.

    The edges are where the Intel machine's table (benchmarks/README.md, "CPU tier notes")
    changes its winner.
    """
    return "decode" if m <= 3 else "small batch" if m <= 12 else "batch"


@dataclass
class CpuForms:
    """The form for small M on the CPU, per bucket, and the timings that chose it."""

    # bucket -> form
    chosen: dict[str, str] = field(default_factory=lambda: dict.fromkeys(BUCKET_M, "plain"))
    # bucket -> form -> ms per pass
    measured_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # the same for the rows as they are (batch_invariant=False): unpadded forms rank differently
    chosen_variant: dict[str, str] = field(default_factory=lambda: dict.fromkeys(BUCKET_M, "plain"))
    measured_variant_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    cached_in: str = ""  # the cache file the timings were read from ("": measured in this process)
    # the forms whose padded products gave the plain form's bits on this model's shapes
    # (`agreeing_forms`); the batch-invariant tier uses a chosen form only if it is here
    agreeing: tuple[str, ...] = ("plain",)
    # share of the machine other processes used while measuring (cpu_load.py; None: unknown)
    others_share: float | None = None

    def describe(self) -> str:
        if not self.measured_ms:
            return "CPU GEMM: plain x @ w (not calibrated)"
        parts = []
        for b, times in self.measured_ms.items():
            speeds = ", ".join(f"{f} {ms:.1f} ms" for f, ms in times.items())
            parts.append(f"M={BUCKET_M[b]}: {self.chosen[b]} ({speeds})")
        source = f" (read from {self.cached_in})" if self.cached_in else ""
        return f"CPU GEMM forms, measured on this model's weights{source}: " + "; ".join(parts)


# A property of this machine's BLAS, measured once per process (like an autotune cache).
CPU_FORMS = CpuForms()


def is_out_major(w: torch.Tensor) -> bool:
    """w [K, N] is a view of a row-major [N, K] matrix (w = w_t.t())."""
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0]


def gemm_plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w  # [M, K] @ [K, N] -> [M, N]


def gemm_transposed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product as C^T = w_t @ x^T (w out-major): the BLAS walks each weight row once."""
    m = x.shape[0]
    cols = torch.cat([x, x]) if m == 1 else x  # [max(M, 2), K]: one decode row becomes two columns
    out_t = w.t() @ cols.t()  # [N, K] @ [K, M'] -> [N, M']: C^T, the tall-skinny product
    return out_t[:, :m].t().contiguous()  # [N, M] -> [M, N]


def gemm_blocked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same product, one batched call over blocks of BLOCK_N output columns (w out-major)."""
    (m, k), n = x.shape, w.shape[1]
    if n % BLOCK_N:
        return x @ w  # no whole number of blocks: the plain product
    blocks = w.t().view(n // BLOCK_N, BLOCK_N, k)  # [N, K] -> [N/64, 64, K]: a view, no copy
    shared = x.expand(n // BLOCK_N, m, k)  # [M, K] -> [N/64, M, K]: the same rows, no copy
    # [N/64, M, K] @ [N/64, K, 64] -> [N/64, M, 64]
    out = torch.bmm(shared, blocks.transpose(1, 2))
    return out.transpose(0, 1).reshape(m, n)  # [N/64, M, 64] -> [M, N/64, 64] -> [M, N] (copies)


FORM_FNS = {"plain": gemm_plain, "transposed": gemm_transposed, "blocked": gemm_blocked}


def padded_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x [M, K] -> [M', K] with zero rows added up to a multiple of `multiple` (M' >= multiple)."""
    m = x.shape[0]
    target = max(1, -(-m // multiple)) * multiple
    return x if target == m else torch.cat([x, x.new_zeros(target - m, x.shape[1])])


def gemm_invariant(form: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] -> [M, N] in `form`, padded so every row has the same bits for any M."""
    m = x.shape[0]
    multiple = COLUMN_MULTIPLE if form == "transposed" else ROW_MULTIPLE
    return FORM_FNS[form](padded_rows(x, multiple), w)[:m]  # [M', N] -> its first M rows


def agreeing_forms(weights: list[torch.Tensor]) -> tuple[str, ...]:
    """The forms whose padded products give the plain form's bits, on each [K, N] of `weights`.

    A few rows per shape (1, 5 and 16: a decode row, a small and a larger batch), one product
    per form: milliseconds. On the CPUs measured here every form agrees; elsewhere a BLAS may
    not, and then that form is not used by the batch-invariant tier."""
    shapes = {}
    for w in weights:
        if is_out_major(w):
            shapes.setdefault(tuple(w.shape), w)
    agree = set(FORMS)
    gen = torch.Generator().manual_seed(0)
    for w in shapes.values():
        x = torch.randn(16, w.shape[0], generator=gen).to(w.dtype)  # [16, K]
        for m in (1, 5, 16):
            ref = gemm_invariant("plain", x[:m], w)
            agree = {f for f in agree if torch.equal(gemm_invariant(f, x[:m], w), ref)}
    return tuple(f for f in FORMS if f in agree)


def time_forms(
    weights: list[torch.Tensor], m: int, passes: int = 3, padded: bool = True
) -> dict[str, float]:
    """ms for one pass of every form over `weights` (out-major [K, N] views) with M = m rows,
    each form as the batch-invariant tier runs it (`gemm_invariant`: rows padded), or with
    `padded=False` as the variant tier runs it (the rows as they are).

    The forms alternate (plain, transposed, blocked, plain, ...) so a drift of the machine hits
    all alike; a form's time is its fastest full pass over every matrix.
    """
    xs = {w.shape[0]: torch.randn(m, w.shape[0], dtype=w.dtype) for w in weights}  # one x per K
    best = dict.fromkeys(FORMS, float("inf"))
    for _ in range(passes):
        for form in FORMS:
            start = time.perf_counter()
            for w in weights:
                if padded:
                    gemm_invariant(form, xs[w.shape[0]], w)
                else:
                    FORM_FNS[form](xs[w.shape[0]], w)
            best[form] = min(best[form], (time.perf_counter() - start) * 1e3)
    return best


def calibrate(weights: list[torch.Tensor], passes: int = 3) -> CpuForms:
    """Time each form streaming `weights` (out-major [K, N] views, together far beyond the cache).

    One `time_forms` per bucket, at the bucket's M; each bucket keeps its fastest form. Sets and
    returns `CPU_FORMS`.
    """
    weights = [w for w in weights if w.device.type == "cpu" and is_out_major(w)]
    if not weights:
        return CPU_FORMS
    with cpu_load.LoadProbe() as probe:
        measured = {name: time_forms(weights, m, passes) for name, m in BUCKET_M.items()}
        variant = {
            name: time_forms(weights, m, passes, padded=False) for name, m in BUCKET_M.items()
        }
    CPU_FORMS.others_share = probe.others
    CPU_FORMS.measured_ms = measured
    CPU_FORMS.chosen = {name: min(times, key=times.get) for name, times in measured.items()}
    CPU_FORMS.measured_variant_ms = variant
    CPU_FORMS.chosen_variant = {name: min(times, key=times.get) for name, times in variant.items()}
    CPU_FORMS.cached_in = ""
    CPU_FORMS.agreeing = agreeing_forms(weights)
    return CPU_FORMS


def calibrate_cached(
    weights: list[torch.Tensor], recalibrate: bool = False, passes: int = 3
) -> CpuForms:
    """`calibrate`, unless this machine has measured these shapes before: then the answer is read
    from the cache file (`gemm_forms_cache.py`). `recalibrate=True` measures again and rewrites
    the entry. An answer measured while other processes kept the cores busy (`cpu_load.py`) serves
    this process only and is not written. Sets and returns `CPU_FORMS`.
    """
    weights = [w for w in weights if w.device.type == "cpu" and is_out_major(w)]
    if not weights:
        return CPU_FORMS
    key = gemm_forms_cache.calibration_key(weights, BUCKET_M, FORMS)
    variant_key = gemm_forms_cache.calibration_key(weights, BUCKET_M, FORMS, padded=False)
    cached = None if recalibrate else gemm_forms_cache.load(key)
    cached_variant = None if cached is None else gemm_forms_cache.load(variant_key)
    if cached is not None and cached_variant is not None:
        CPU_FORMS.chosen, CPU_FORMS.measured_ms = cached
        CPU_FORMS.chosen_variant, CPU_FORMS.measured_variant_ms = cached_variant
        CPU_FORMS.cached_in = str(gemm_forms_cache.cache_path())
        CPU_FORMS.agreeing = agreeing_forms(weights)  # a property of this process's BLAS: checked
        return CPU_FORMS
    with load_phase("calibrating the CPU GEMM forms (once per machine and model shape)"):
        calibrate(weights, passes)
    others = CPU_FORMS.others_share
    if others is not None and others > cpu_load.busy_share():
        gemm_forms_cache.notice(
            f"other processes used {others:.0%} of the CPU while the GEMM forms were timed; "
            "their choice is used for this run only and measured again next time"
        )
        return CPU_FORMS
    gemm_forms_cache.store(key, CPU_FORMS.chosen, CPU_FORMS.measured_ms)
    gemm_forms_cache.store(variant_key, CPU_FORMS.chosen_variant, CPU_FORMS.measured_variant_ms)
    return CPU_FORMS
