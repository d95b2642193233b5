"""Readying a loaded model's weights for the tiers that will read them: one call, at load.

Two things are done once, before the first token, for a model whose stages run
the torch tier on the CPU (`tiers`: stage name -> the tier that runs,
`StageOps.backends`):

- the CPU GEMM forms are chosen (`tuning/gemm_forms.py`): streamed with every
  form on a sample of the model's own projection weights, or read from this
  machine's cache when it measured the same shapes before;
- packed weights get the torch tier's own layout (`dequant_gemm_torch.prepare`: the
  integer-dot kernel's rows8, `quant/rows8.py`, or PyTorch's int4 CPU layout,
  `quant/int4pack.py`, where that kernel is not built), and the file-layout codes
  are released once that layout holds them exactly. Built once per weight file,
  torch version and CPU: kept on disk and read back at the next start
  (`tuning/packed_forms_cache.py`), as the calibration is.

`prepare_weights` does both; the two halves are callable on their own where a
process needs only one (a tensor-parallel rank calibrates, a draft model only
repacks: the calibration is per process and the target's already stands).
"""

from stagewise.quant import int4pack
from stagewise.quant.packed_parts import packed_leaves
from stagewise.quant.packed_weight import is_packed
from stagewise.runtime import load_phase
from stagewise.stages import dequant_gemm_torch
from stagewise.tuning import gemm_forms, packed_forms_cache

PROJECTIONS = ("qkv_proj", "o_proj", "ffn", "lm_head")  # the stages whose torch tier is `gemm`
CALIBRATE_BYTES = 64 * 2**20  # below this the weights sit in cache and the form hardly matters
CALIBRATE_SAMPLE_BYTES = 2 * 2**30  # far beyond any L3, so streamed from memory; bounds the cost


def prepare_weights(
    weights, tiers: dict[str, str], recalibrate: bool = False, source: str | None = None
) -> None:
    """Everything the tiers build from `weights` (a `LlamaWeights`) once: the CPU GEMM forms
    (`calibrate_for`), then the torch tier's forms of the packed weights (`build_packed_forms`;
    `source`, the weight file, keys their disk cache). A no-op off the CPU, for small float
    models, or when no stage runs the torch tier."""
    calibrate_for(weights, tiers, recalibrate)
    build_packed_forms(weights, tiers, source)


# ---- the CPU GEMM forms: when to calibrate, and on which of the model's weights ----


def calibration_sample(weights, budget: int | None = None) -> list:
    """Whole layers' projection weights, in order, up to `budget` bytes; the LM head if it fits too.

    The same shapes repeat in every layer, so an 8B model is measured on its first layers instead
    of streaming 32 GB per pass. Packed weights are left out (their torch tier is another kernel).
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


def calibrate_for(weights, tiers: dict[str, str], recalibrate: bool = False):
    """Choose the forms once per process, when it matters: every projection runs the torch tier,
    the weights are on the CPU and at least CALIBRATE_BYTES. Otherwise (or when already chosen,
    unless `recalibrate`) `CPU_FORMS` is left as is. The answer comes from the cache when this
    machine measured the same shapes before (`gemm_forms.calibrate_cached`). Returns `CPU_FORMS`.
    """
    torch_projections = all(tiers.get(name) == "torch" for name in PROJECTIONS)
    on_cpu = weights.embed.device.type == "cpu"
    big = weights.decode_bytes() >= CALIBRATE_BYTES
    chosen = gemm_forms.CPU_FORMS.measured_ms
    if torch_projections and on_cpu and big and (recalibrate or not chosen):
        gemm_forms.calibrate_cached(calibration_sample(weights), recalibrate)
    return gemm_forms.CPU_FORMS


# ---- packed weights: the torch tier's own layout, built at load ----


def build_packed_forms(weights, tiers: dict[str, str], source: str | None = None) -> None:
    """Build the torch tier's forms at load (not on the first token) for the packed weights whose
    stage runs that tier on the CPU; read them from the disk cache instead when `source` (the
    weight file) was repacked on this machine before (`tuning/packed_forms_cache.py`).

    Building a form releases the file-layout codes (held once, `quant/packed_weight.py`), so a
    weight another tier reads (a naive LM head beside torch projections, an untied table that is
    only gathered) is left as it is: that tier reads the file's codes, not codes rebuilt per call.
    The load line names the tier; with no stage on the torch tier (say, triton) there is none.
    """
    leaves = torch_tier_leaves(weights, tiers)
    if not leaves:
        return
    key = None
    identity = packed_forms_cache.file_identity(source) if source else None
    if identity is not None and packed_forms_cache.enabled():
        forms = [dequant_gemm_torch.form_name(w) for w in leaves]
        key = packed_forms_cache.make_key(identity, leaves, forms, int4pack.block_rows())
        layouts = [dequant_gemm_torch.form_layout(w) for w in leaves]
        cached = None
        if packed_forms_cache.exists(key):
            with load_phase("reading the torch tier's repacked weights from the cache"):
                cached = packed_forms_cache.load(key, layouts)
        if cached is not None:
            for w, form in zip(leaves, cached):
                w.prepared["torch"] = form
                w.release_codes()
            dequant_gemm_torch.return_freed_memory()
            return
    layouts = ", ".join(sorted({dequant_gemm_torch.form_name(w) for w in leaves}))
    with load_phase(f"repacking the quantized weights for the torch tier ({layouts} layout)"):
        for w in leaves:
            dequant_gemm_torch.prepare(w)  # the form built, the file-layout codes released
        if key is not None:
            packed_forms_cache.store(key, [w.prepared["torch"] for w in leaves])
    dequant_gemm_torch.return_freed_memory()


def torch_tier_leaves(weights, tiers: dict[str, str]) -> list:
    """The plain PackedWeights, in model order, that the torch tier reads on the CPU and whose form
    is not built yet (a PackedParts: each part)."""
    stage_of = {"w_qkv": "qkv_proj", "w_o": "o_proj", "w_gate_up": "ffn", "w_down": "ffn"}
    torch_stages = {stage for stage, tier in tiers.items() if tier == "torch"}
    picked = [weights.lm_head] if "lm_head" in torch_stages else []
    for lw in weights.layers:
        picked += [getattr(lw, name) for name, stage in stage_of.items() if stage in torch_stages]
    leaves = []
    for packed in {id(w): w for w in picked if is_packed(w)}.values():
        leaves += [
            w
            for w in packed_leaves(packed)
            if w.device.type == "cpu"
            and dequant_gemm_torch.supported(w)
            and "torch" not in w.prepared
        ]
    return leaves
