"""The seeds' arithmetic for any model and any hardware: the `stagewise calc` calculator.

    from stagewise.calc.roofline import summarize
    from stagewise.calc.hardware import HARDWARE
    from stagewise.config import PRESETS
    summarize(PRESETS["llama-3-8b"], HARDWARE["h100"], context=8192, batch=16, dtype="bf16")

answers, for one model, one machine, one context length N and one batch B:
what the weights and the KV cache weigh (MHA vs the model's real GQA), how
many FLOPs a token costs, what one naive recompute step costs against one
KV-cached step, where prefill and decode sit on the roofline (arithmetic
intensity vs the ridge point), their speed-of-light times (TTFT, time per
output token) and the largest batch whose KV cache still fits.

The pieces, each a short module that reads top to bottom:

- `counts`  parameters, FLOPs and KV bytes; exact counts and the seeds' shortcuts
- `steps`   one prefill / decode / naive step on the roofline; memory capacity
- `seeds`   the seeds' worked numbers next to ours (`seeds_worked_examples()`)
- `weight_formats`  bytes per weight of a storage format (q4_1, q8_0, bf16, ...) or of a GGUF's tensors

Every number is a `Quantity` (value, unit, formula), so `summarize()` is a
JSON-ready dict and `stagewise calc --explain` can show each formula.
"""

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from stagewise.calc.counts import (
    Quantity,
    attention_flops,
    kv_bytes,
    kv_bytes_per_token,
    linear_coefficient,
    linear_flops,
    matmul_parameters,
    num,
    parameters,
    seeds_attention_flops,
    seeds_linear_flops,
    seeds_params_flops,
    weight_bytes,
)
from stagewise.calc.hardware import DTYPE_BYTES, HARDWARE, Hardware, canonical_dtype, probe_this_machine
from stagewise.calc.seeds import Row, SeedsAssumptions, seeds_worked_examples
from stagewise.calc.steps import Capacity, Step, capacity, decode_step, naive_step, prefill_step
from stagewise.calc.weight_formats import WeightBytes
from stagewise.config import PRESETS, ModelConfig, config_from_hf_dict
from stagewise.errors import StagewiseError
from stagewise.models.files import read_json_object

__all__ = [
    "Analysis",
    "Quantity",
    "Row",
    "SeedsAssumptions",
    "analyze",
    "load_hardware",
    "load_model_config",
    "seeds_worked_examples",
    "summarize",
]


def load_model_config(model: str) -> ModelConfig:
    """A preset name, a Hugging Face `config.json` file, a directory holding one, or a `.gguf` file.

    Only the sizes are read (a GGUF's metadata, not its tensors), so a config with RoPE scaling
    (Llama 3.1's `rope_scaling: llama3`) or another Llama-like architecture is fine here.
    """
    if model in PRESETS:
        return PRESETS[model]
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        from stagewise.models.gguf_loader import config_from_gguf, open_gguf

        return replace(config_from_gguf(open_gguf(path), str(path)), shape_only=True)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise StagewiseError(
            f"unknown model '{model}'; choose one of {', '.join(PRESETS)}, a config.json path or a .gguf file"
        )
    return config_from_hf_dict(read_json_object(path), str(model), str(path), shape_only=True)


def load_hardware(name: str, probe_seconds: float = 3.0) -> Hardware:
    """A preset name ('h100', 'h200', 'a100', 'h100-seeds'), or 'probe' to measure this machine."""
    if name.strip().lower() == "probe":
        return probe_this_machine(seconds=probe_seconds)
    if name.strip().lower() not in HARDWARE:
        raise StagewiseError(f"unknown hardware '{name}'; choose one of {', '.join(HARDWARE)} or probe")
    return HARDWARE[name.strip().lower()]


@dataclass(frozen=True)
class Analysis:
    model: ModelConfig  # the architecture
    hardware: Hardware  # the machine
    dtype: str  # canonical compute/storage dtype ("bf16", ...)
    dtype_bytes: int  # bytes per KV element (and per weight, unless `weights` says otherwise)
    weights: str  # the weights' storage format ("bf16", "q4_1", "<file> (per tensor)")
    context: int  # N, tokens in the sequence (the prompt for a prefill)
    batch: int  # B, sequences processed together
    parameters: Quantity  # exact parameter count
    matmul_parameters: Quantity  # weights a token is multiplied by (blocks + LM head)
    weight_bytes: Quantity  # weights in memory
    bytes_per_weight: Quantity  # weight bytes / parameters (block formats: scales and minimums included)
    linear_coefficient: Quantity  # per-block matmul weights / hidden^2 (the seeds' 11)
    linear_flops_per_token: Quantity  # 2 * matmul parameters
    attention_flops_at_n: Quantity  # QK^T + PV for one token attending to N keys
    seeds_linear_flops_per_token: Quantity  # seeds: 2 * P
    seeds_attention_flops_at_n: Quantity  # seeds: 4 * L * N * hidden
    kv_per_token: Quantity  # the model's real Hkv
    kv_per_token_mha: Quantity  # if Hkv = H
    kv_at_n: Quantity  # one sequence of N tokens, real Hkv
    kv_at_n_mha: Quantity  # one sequence of N tokens, MHA
    naive_step_seeds: Quantity  # seeds ch.5: 2*L*11*N*hidden^2 + 4*L*N^2*hidden
    naive_over_cached: Quantity  # FLOPs of a naive step / FLOPs of a KV-cached step
    prefill: Step  # B prompts of N tokens: speed-of-light TTFT
    decode: Step  # one token for B sequences at context N: time per output token
    naive: Step  # one token by recomputing all N tokens (no cache)
    decode_tokens_per_s: Quantity  # B / decode time
    capacity: Capacity  # largest batch whose KV fits next to the weights


def analyze(
    config: ModelConfig,
    hardware: Hardware,
    context: int,
    batch: int = 1,
    dtype: str = "bf16",
    weights: WeightBytes | None = None,
) -> Analysis:
    """Every number of the calculator for one (model, hardware, N, B, dtype).

    `weights`: the weights' storage (`weight_formats.uniform` / `from_gguf`, e.g. 4-bit blocks
    while the arithmetic and the KV cache stay in `dtype`); None stores them in `dtype` too.
    """
    if context <= 0:
        raise StagewiseError(f"context must be > 0 tokens, got {context}")
    if batch <= 0:
        raise StagewiseError(f"batch must be > 0 sequences, got {batch}")
    dt = canonical_dtype(dtype)
    hardware.peak_flops(dt)  # fails early, with one line, on a dtype the hardware lacks
    nbytes = DTYPE_BYTES[dt]
    cfg, L, hidden = config, config.num_layers, config.hidden_size
    seeds_lin, seeds_att = seeds_linear_flops(L, hidden, context), seeds_attention_flops(L, hidden, context, context)
    args = (cfg, hardware, dt, nbytes, context, batch, weights)
    prefill, decode, naive = prefill_step(*args), decode_step(*args), naive_step(*args)
    held = weight_bytes(cfg, nbytes) if weights is None else weights.total()
    per_weight = Quantity(
        held.value / cfg.num_parameters(),
        "B/weight",
        f"weight bytes / parameters = {num(held.value)} / {num(cfg.num_parameters())}",
    )
    ratio = naive.flops.value / decode.flops.value
    return Analysis(
        model=cfg,
        hardware=hardware,
        dtype=dt,
        dtype_bytes=nbytes,
        weights=dt if weights is None else weights.name,
        context=context,
        batch=batch,
        parameters=parameters(cfg),
        matmul_parameters=matmul_parameters(cfg),
        weight_bytes=held,
        bytes_per_weight=per_weight,
        linear_coefficient=linear_coefficient(cfg),
        linear_flops_per_token=linear_flops(cfg, 1),
        attention_flops_at_n=attention_flops(cfg, context, 1),
        seeds_linear_flops_per_token=seeds_params_flops(cfg.num_parameters(), 1),
        seeds_attention_flops_at_n=seeds_attention_flops(L, hidden, 1, context),
        kv_per_token=kv_bytes_per_token(cfg, nbytes),
        kv_per_token_mha=kv_bytes_per_token(cfg, nbytes, mha=True),
        kv_at_n=kv_bytes(cfg, nbytes, context),
        kv_at_n_mha=kv_bytes(cfg, nbytes, context, mha=True),
        naive_step_seeds=Quantity(
            seeds_lin.value + seeds_att.value, "FLOP", f"({seeds_lin.formula}) + ({seeds_att.formula})"
        ),
        naive_over_cached=Quantity(ratio, "x", "naive step FLOPs / KV-cached decode step FLOPs"),
        prefill=prefill,
        decode=decode,
        naive=naive,
        decode_tokens_per_s=Quantity(batch / decode.time.value, "tokens/s", "B / time per output token"),
        capacity=capacity(cfg, hardware, nbytes, context, weights),
    )


def summarize(
    config: ModelConfig,
    hardware: Hardware,
    context: int,
    batch: int = 1,
    dtype: str = "bf16",
    weights: WeightBytes | None = None,
) -> dict:
    """`analyze()` as a JSON-ready dict: every Quantity is {"value", "unit", "formula"}."""
    result = analyze(config, hardware, context, batch, dtype, weights)
    out = asdict(result)  # nested dataclasses (Quantity, Step, Hardware, ...) become dicts
    out["hardware"]["ridge_point"] = hardware.ridge_point(result.dtype)
    return out


def seeds_table() -> list[dict]:
    """`seeds_worked_examples()` as JSON-ready dicts (with the relative difference)."""
    return [{**asdict(row), "rel_diff": row.rel_diff} for row in seeds_worked_examples()]
