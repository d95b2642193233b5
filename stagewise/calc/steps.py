"""One engine step on one machine, at the speed of light: prefill, decode, naive recompute.

For a step that does F FLOPs and moves B bytes on hardware with peak P
FLOP/s and bandwidth W bytes/s:

    compute time = F / P          memory time = B / W
    speed of light = max(compute time, memory time)    (perfect overlap, 100% utilisation)
    arithmetic intensity = F / B  (FLOP per byte), compared with the ridge P / W

The seeds' chapter 8 asymmetry falls out: a prefill shares one read of the
weights among N tokens (intensity ~N, compute-bound), a decode step shares it
among B sequences only, and each of them also reads its own KV cache
(intensity ~1-2 at batch 1, memory-bound).

The weights may be stored in another format than the compute dtype (`weights`, a
`WeightBytes` from `weight_formats.py`: 4-bit blocks with bfloat16 arithmetic); without
it they take `dtype_bytes` per weight, like the KV cache.

Activations are not counted as memory traffic (they are small and often stay
in cache); neither is the communication of a multi-GPU setup.
"""

from dataclasses import dataclass

from stagewise.calc.counts import (
    Quantity,
    attention_flops,
    kv_bytes_per_token,
    linear_flops,
    num,
    weight_bytes,
    weight_bytes_streamed,
)
from stagewise.calc.hardware import Hardware
from stagewise.calc.weight_formats import WeightBytes
from stagewise.config import ModelConfig


@dataclass(frozen=True)
class Step:
    name: str  # "prefill", "decode" or "naive step"
    flops: Quantity  # FLOPs of the whole step (all sequences of the batch)
    bytes: Quantity  # bytes read from and written to memory (weights + KV cache)
    intensity: Quantity  # flops / bytes, FLOP per byte
    ridge: Quantity  # the hardware's peak FLOP/s / bandwidth, FLOP per byte
    compute_time: Quantity  # flops / peak FLOP/s
    memory_time: Quantity  # bytes / bandwidth
    time: Quantity  # speed of light: max(compute_time, memory_time)
    bound: str  # "compute-bound" when intensity > ridge, else "memory-bound"


def _add(name: str, unit: str, *parts: Quantity) -> Quantity:
    value = sum(p.value for p in parts)
    terms = " + ".join(num(p.value) for p in parts)
    return Quantity(value, unit, f"{name} = {terms} = {num(value)}")


def _scale(q: Quantity, factor: int, what: str) -> Quantity:
    if factor == 1:
        return q
    return Quantity(q.value * factor, q.unit, f"{what} * ({q.formula})")


def _streamed(cfg: ModelConfig, dtype_bytes: int, num_tokens: int, weights: WeightBytes | None) -> Quantity:
    """Weight bytes a step over `num_tokens` tokens reads: in `weights`' format, else `dtype_bytes` each."""
    if weights is None:
        return weight_bytes_streamed(cfg, dtype_bytes, num_tokens)
    return weights.streamed(num_tokens)


def roofline(name: str, flops: Quantity, moved: Quantity, hw: Hardware, dtype: str) -> Step:
    """Put a step's FLOPs and bytes on the hardware's roofline."""
    peak, bw = hw.peak_flops(dtype), hw.memory_bandwidth
    intensity = flops.value / moved.value
    ridge = peak / bw
    compute = flops.value / peak
    memory = moved.value / bw
    return Step(
        name=name,
        flops=flops,
        bytes=moved,
        intensity=Quantity(intensity, "FLOP/B", f"FLOPs / bytes = {num(flops.value)} / {num(moved.value)}"),
        ridge=Quantity(ridge, "FLOP/B", f"peak / bandwidth = {num(peak)} / {num(bw)} ({hw.name}, {dtype})"),
        compute_time=Quantity(compute, "s", f"FLOPs / peak = {num(flops.value)} / {num(peak)}"),
        memory_time=Quantity(memory, "s", f"bytes / bandwidth = {num(moved.value)} / {num(bw)}"),
        time=Quantity(max(compute, memory), "s", "max(compute time, memory time)"),
        bound="compute-bound" if intensity > ridge else "memory-bound",
    )


def prefill_step(
    cfg: ModelConfig,
    hw: Hardware,
    dtype: str,
    dtype_bytes: int,
    context: int,
    batch: int,
    weights: WeightBytes | None = None,
) -> Step:
    """`batch` prompts of `context` tokens each, in one step; its time is the speed-of-light TTFT.

    FLOPs: every prompt token through every matmul, causal attention, logits
    for the last token only. Bytes: the weights once + the K/V of every prompt
    token written to the cache (the seeds: "load weights + write KV").
    """
    per_seq = _add(
        "linear + attention",
        "FLOP",
        linear_flops(cfg, context, logits_tokens=1),
        attention_flops(cfg, context, new_tokens=context),
    )
    flops = _scale(per_seq, batch, f"B={batch}")
    read = _streamed(cfg, dtype_bytes, batch * context, weights)
    per_token = kv_bytes_per_token(cfg, dtype_bytes).value
    kv_formula = f"KV written: B*N*KV/token = {batch}*{num(context)}*{num(per_token)}"
    kv = Quantity(per_token * context * batch, "B", kv_formula)
    return roofline("prefill", flops, _add("weights + KV written", "B", read, kv), hw, dtype)


def decode_step(
    cfg: ModelConfig,
    hw: Hardware,
    dtype: str,
    dtype_bytes: int,
    context: int,
    batch: int,
    weights: WeightBytes | None = None,
) -> Step:
    """One new token for each of `batch` sequences already `context` tokens long (its own included).

    FLOPs: one token through every matmul and the LM head, attention over N
    keys. Bytes: the weights once (shared by the batch) + each sequence's K/V
    of N tokens read + the new token's K/V written.
    """
    per_seq = _add(
        "linear + attention",
        "FLOP",
        linear_flops(cfg, 1, logits_tokens=1),
        attention_flops(cfg, context, new_tokens=1),
    )
    flops = _scale(per_seq, batch, f"B={batch}")
    read = _streamed(cfg, dtype_bytes, batch, weights)
    per_token = kv_bytes_per_token(cfg, dtype_bytes).value
    kv_formula = f"KV read + written: B*(N+1)*KV/token = {batch}*{num(context + 1)}*{num(per_token)}"
    kv = Quantity(per_token * (context + 1) * batch, "B", kv_formula)
    return roofline("decode", flops, _add("weights + KV read/written", "B", read, kv), hw, dtype)


def naive_step(
    cfg: ModelConfig,
    hw: Hardware,
    dtype: str,
    dtype_bytes: int,
    context: int,
    batch: int,
    weights: WeightBytes | None = None,
) -> Step:
    """One new token with no cache: the whole `context`-token sequence goes through the model again.

    FLOPs: the same as a prefill of N tokens, with the full N x N score matrix
    computed and then masked (what a naive `softmax(QK^T + mask) V` executes).
    Bytes: the weights once; nothing is cached, so no KV traffic.
    """
    per_seq = _add(
        "linear + attention (masked)",
        "FLOP",
        linear_flops(cfg, context, logits_tokens=1),
        attention_flops(cfg, context, new_tokens=context, causal=False),
    )
    flops = _scale(per_seq, batch, f"B={batch}")
    moved = _streamed(cfg, dtype_bytes, batch * context, weights)
    return roofline("naive step", flops, moved, hw, dtype)


@dataclass(frozen=True)
class Capacity:
    weights: Quantity  # bytes of the weights, resident in memory
    free_for_kv: Quantity  # memory left for the KV cache after the weights (0 when they do not fit)
    kv_per_sequence: Quantity  # KV bytes of one sequence of N tokens (the model's real Hkv)
    kv_per_sequence_mha: Quantity  # the same if the model had MHA (Hkv = H)
    max_batch: Quantity  # sequences of N tokens whose KV fits next to the weights
    max_batch_mha: Quantity  # the same with MHA


def capacity(
    cfg: ModelConfig, hw: Hardware, dtype_bytes: int, context: int, weights: WeightBytes | None = None
) -> Capacity:
    """The largest batch of `context`-token sequences whose KV cache fits in memory after the weights."""
    held = weight_bytes(cfg, dtype_bytes) if weights is None else weights.total()
    free = max(0, hw.memory_bytes - int(held.value))
    free_q = Quantity(free, "B", f"max(0, memory - weights) = max(0, {num(hw.memory_bytes)} - {num(held.value)})")
    out = {}
    for key, mha in (("", False), ("_mha", True)):
        per_token = kv_bytes_per_token(cfg, dtype_bytes, mha=mha).value
        per_seq = per_token * context
        out["kv_per_sequence" + key] = Quantity(per_seq, "B", f"N * KV/token = {num(context)} * {num(per_token)}")
        out["max_batch" + key] = Quantity(
            free // per_seq, "sequences", f"floor(free / KV per sequence) = floor({num(free)} / {num(per_seq)})"
        )
    return Capacity(weights=held, free_for_kv=free_q, **out)
