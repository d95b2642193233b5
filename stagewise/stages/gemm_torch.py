"""The torch tier of the four projection stages: `x @ w`, asked the way this CPU's BLAS streams
fastest.

    x [M, K] @ w [K, N] -> [M, N]        (M = tokens in the step, K = in features, N = out features)

The `naive` tier of qkv_proj, o_proj, ffn and lm_head is that one line,
`x @ w`, and on a GPU (or for large M) it is also the fastest PyTorch. On a
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
a law. Streaming all 538 MB of SmolLM2-135M's projection weights once,
float32, 2 threads, torch 2.13 / MKL (`python -m stagewise.bench.cpu_forms
--only gemm`, fastest of 3 alternating passes):

    M   2-core AMD EPYC               2-core Intel Xeon (480 MB L3)
        plain    transposed           plain    transposed  blocked
    1   30.8 ms  16.6 ms              19.4 ms  48.5 ms     20.9 ms
    3                                 22.6 ms  53.2 ms     25.0 ms
    8   82.8 ms  43.0 ms              46.8 ms  55.4 ms     31.2 ms
    12                                56.9 ms  56.3 ms     34.9 ms
    16                                46.8 ms  55.1 ms     49.9 ms
    32                                56.1 ms  64.1 ms     66.6 ms

(the AMD machine was first measured before the blocked form existed; on a
shared machine the digits drift by up to 35 % within a day, the order does
not). The same 2-core AMD EPYC (KVM guest, family 25) again, with all three
forms, while other jobs shared its two cores (so every time is inflated,
roughly 2x):

    M     plain     transposed  blocked
    1     75.3 ms   50.6 ms     47.2 ms
    3    177.0 ms   66.9 ms     66.9 ms
    8    135.4 ms   84.0 ms     78.3 ms
    12   140.3 ms  121.5 ms     87.3 ms
    16   149.2 ms  101.2 ms     89.1 ms
    32   183.9 ms  150.3 ms    121.5 ms

On the AMD machine the textbook `x @ w` takes 1.5x to 1.9x as long as the
best form for one decode row: that is why the CPU default is this tier, not
naive.
On the Intel machine 8 rows take the plain product 2.4x as long as one row,
and the same call split into 64-column blocks 1.6x (blocks of 16 to 128
columns measure within 10 % of each other). The likely reason: for these M
the BLAS first copies ("packs") each weight panel into a buffer and then
multiplies, a second pass over the bytes, while a batch of small products is
multiplied in place. From M of about 16 the packed GEMM's better arithmetic
wins again.

So the choice is measured on the model's own weights:
`calibrate_for(weights, tiers)` (called by `LLM` when it loads a CPU model
whose projections run this tier) streams them with each form (alternating,
best of a few passes) at one M per bucket (a lone decode row, a small batch,
a batch), and `gemm` then asks the BLAS the fastest way for each. Until then
(and off the CPU, for other layouts, or for M > SMALL_M) it is plain `x @ w`.
`CPU_FORMS` says what was chosen: like an autotuner's cache it is the one
per-process record here, a property of the machine, not of a request. Like
an autotuner's cache it is also kept on disk (`gemm_torch_cache.py`), keyed
by the CPU, torch version, thread count and shapes, so the next process on
the same machine reads the answer instead of measuring again.
"""

import time
from dataclasses import dataclass, field

import torch

from stagewise.runtime import load_phase
from stagewise.stages import cpu_load, dequant_gemm, gemm_torch_cache
from stagewise.stages.packed_weight import is_packed

SMALL_M = 64  # above this many rows every form is compute-bound and `x @ w` is at least as fast
FORMS = ("plain", "transposed", "blocked")
BUCKET_M = {"decode": 1, "small batch": 8, "batch": 32}  # the M each bucket is measured at
BLOCK_N = 64  # output columns per block of the blocked form ([K, 64] floats: 147 KB at K = 576)


def bucket(m: int) -> str:
    """Which measured choice covers M rows: decode rows (M <= 3), a small batch (M <= 12), a batch.

    The edges are where the Intel machine's table in the module docstring changes its winner.
    """
    return "decode" if m <= 3 else "small batch" if m <= 12 else "batch"


@dataclass
class CpuForms:
    """The form `gemm` uses on the CPU for small M, per bucket, and the timings that chose it."""

    # bucket -> form
    chosen: dict[str, str] = field(default_factory=lambda: dict.fromkeys(BUCKET_M, "plain"))
    # bucket -> form -> ms per pass
    measured_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    cached_in: str = ""  # the cache file the timings were read from ("": measured in this process)
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


def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] -> [M, N], contiguous (a packed w: the stock quantized kernels)."""
    if is_packed(w):  # the dequantize-GEMM's torch tier (part by part for mixed kinds)
        return dequant_gemm.torch_tier(x, w)
    m = x.shape[0]
    if x.device.type != "cpu" or m == 0 or m > SMALL_M or not is_out_major(w):
        return x @ w  # [M, K] @ [K, N] -> [M, N]
    form = CPU_FORMS.chosen[bucket(m)]
    if form == "transposed":
        return gemm_transposed(x, w)
    if form == "blocked":
        return gemm_blocked(x, w)
    return x @ w


def time_forms(weights: list[torch.Tensor], m: int, passes: int = 3) -> dict[str, float]:
    """ms for one pass of every form over `weights` (out-major [K, N] views) with M = m rows.

    The forms alternate (plain, transposed, blocked, plain, ...) so a drift of the machine hits
    all alike; a form's time is its fastest full pass over every matrix.
    """
    xs = {w.shape[0]: torch.randn(m, w.shape[0], dtype=w.dtype) for w in weights}  # one x per K
    best = dict.fromkeys(FORMS, float("inf"))
    for _ in range(passes):
        for form in FORMS:
            start = time.perf_counter()
            for w in weights:
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
    CPU_FORMS.others_share = probe.others
    CPU_FORMS.measured_ms = measured
    CPU_FORMS.chosen = {name: min(times, key=times.get) for name, times in measured.items()}
    CPU_FORMS.cached_in = ""
    return CPU_FORMS


def calibrate_cached(
    weights: list[torch.Tensor], recalibrate: bool = False, passes: int = 3
) -> CpuForms:
    """`calibrate`, unless this machine has measured these shapes before: then the answer is read
    from the cache file (`gemm_torch_cache.py`). `recalibrate=True` measures again and rewrites
    the entry. An answer measured while other processes kept the cores busy (`cpu_load.py`) serves
    this process only and is not written. Sets and returns `CPU_FORMS`.
    """
    weights = [w for w in weights if w.device.type == "cpu" and is_out_major(w)]
    if not weights:
        return CPU_FORMS
    key = gemm_torch_cache.calibration_key(weights, BUCKET_M, FORMS)
    cached = None if recalibrate else gemm_torch_cache.load(key)
    if cached is not None:
        CPU_FORMS.chosen, CPU_FORMS.measured_ms = cached
        CPU_FORMS.cached_in = str(gemm_torch_cache.cache_path())
        return CPU_FORMS
    with load_phase("calibrating the CPU GEMM forms (once per machine and model shape)"):
        calibrate(weights, passes)
    others = CPU_FORMS.others_share
    if others is not None and others > cpu_load.busy_share():
        gemm_torch_cache.notice(
            f"other processes used {others:.0%} of the CPU while the GEMM forms were timed; "
            "their choice is used for this run only and measured again next time"
        )
        return CPU_FORMS
    gemm_torch_cache.store(key, CPU_FORMS.chosen, CPU_FORMS.measured_ms)
    return CPU_FORMS


# ---- when to calibrate: at load, for a CPU model whose projections run this tier ----

PROJECTIONS = ("qkv_proj", "o_proj", "ffn", "lm_head")  # the stages whose torch tier is `gemm`
CALIBRATE_BYTES = 64 * 2**20  # below this the weights sit in cache and the form hardly matters
CALIBRATE_SAMPLE_BYTES = 2 * 2**30  # far beyond any L3, so streamed from memory; bounds the cost


def calibration_sample(weights, budget: int | None = None) -> list[torch.Tensor]:
    """Whole layers' projection weights, in order, up to `budget` bytes; the LM head if it fits too.

    `weights` is a model's `LlamaWeights` (read by its fields: `layers[i].w_qkv`, `w_o`,
    `w_gate_up`, `w_down`, and `lm_head`). The same shapes repeat in every layer, so an 8B model
    is measured on its first layers instead of streaming 32 GB per pass.
    """
    budget = CALIBRATE_SAMPLE_BYTES if budget is None else budget
    sample, size = [], 0
    for lw in weights.layers:
        layer = [t for t in (lw.w_qkv, lw.w_o, lw.w_gate_up, lw.w_down) if not is_packed(t)]
        sample += layer
        size += sum(t.numel() * t.element_size() for t in layer)
        if size >= budget:
            break
    if is_packed(weights.lm_head):
        return sample
    head_bytes = weights.lm_head.numel() * weights.lm_head.element_size()
    return sample + [weights.lm_head] if size + head_bytes <= budget else sample


def calibrate_for(weights, tiers: dict[str, str], recalibrate: bool = False) -> CpuForms:
    """Choose the forms once per process, when it matters: every projection runs the torch tier
    (`tiers`: stage name -> the tier that runs, `StageOps.backends`), the weights are on the CPU
    and at least CALIBRATE_BYTES. Otherwise (or when already chosen, unless `recalibrate`)
    `CPU_FORMS` is left as is. The answer comes from the cache when this machine measured the
    same shapes before (`calibrate_cached`).
    """
    torch_projections = all(tiers.get(name) == "torch" for name in PROJECTIONS)
    on_cpu = weights.embed.device.type == "cpu"
    big = weights.decode_bytes() >= CALIBRATE_BYTES
    if torch_projections and on_cpu and big and (recalibrate or not CPU_FORMS.measured_ms):
        calibrate_cached(calibration_sample(weights), recalibrate)
    return CPU_FORMS


# ---- the torch tier of each projection stage: the same signature as its `naive` ----


def qkv_proj(x: torch.Tensor, w_qkv: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], w_qkv [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d], in this CPU's fastest form."""
    return gemm(x, w_qkv)  # [T, hidden] @ [hidden, (H+2Hkv)*d] -> [T, (H+2Hkv)*d]


def o_proj(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """x [T, H*d], w_o [H*d, hidden] -> [T, hidden], in this CPU's fastest form."""
    return gemm(x, w_o)  # [T, H*d] @ [H*d, hidden] -> [T, hidden]


def ffn(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]: both GEMMs of the SwiGLU FFN in this CPU's fastest form.

    Packed weights on the CPU: their kernels take and give bfloat16 (`dequant_gemm_torch.py`),
    so the activation stays bfloat16 from the first GEMM to the second, two casts fewer per layer
    than a float32 round trip in between; silu and the product each round once more to bfloat16.
    """
    if x.device.type == "cpu" and is_packed(w_gate_up) and is_packed(w_down):
        gate_up = gemm(x.to(torch.bfloat16), w_gate_up)  # [T, hidden] -> [T, 2*inter] bf16
        gate, up = gate_up.chunk(2, dim=-1)  # -> 2 x [T, inter]
        h = torch.nn.functional.silu(gate).mul_(up)  # [T, inter] bf16
        return gemm(h, w_down).to(x.dtype)  # [T, inter] @ [inter, hidden] -> [T, hidden]
    gate_up = gemm(x, w_gate_up)  # [T, hidden] @ [hidden, 2*inter] -> [T, 2*inter]
    gate, up = gate_up.chunk(2, dim=-1)  # -> 2 x [T, inter]
    h = torch.nn.functional.silu(gate) * up  # [T, inter]
    return gemm(h, w_down)  # [T, inter] @ [inter, hidden] -> [T, hidden]


def lm_head(
    hidden: torch.Tensor, last_token_index: torch.Tensor, w_lm: torch.Tensor
) -> torch.Tensor:
    """hidden [T, hidden], last_token_index [B], w_lm [hidden, vocab] -> logits [B, vocab]."""
    last = hidden[last_token_index]  # [T, hidden] -> [num_seqs, hidden]
    return gemm(last, w_lm)  # [num_seqs, hidden] @ [hidden, vocab] -> [num_seqs, vocab]
