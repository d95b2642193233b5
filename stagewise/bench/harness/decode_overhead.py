"""Where a decode token's time goes: streaming the weights, and everything else.

A decode step of one sequence multiplies one row by every weight matrix: each
weight byte is read once for 2 FLOPs, so no step can beat the time to stream
the weights from memory,

    t_stream = weight bytes read per token / plain-read bandwidth,

and whatever a token takes beyond that is overhead: Python, small PyTorch
ops, attention, sampling. `weight_streaming` measures the bandwidth the way a
`sum` reads a buffer far larger than the last-level cache (on a CPU with a
huge L3 a small buffer would be served from cache and flatter the machine);
`stage_breakdown` runs a traced decode and splits a step's time per stage.
"""

import torch

from stagewise.bench.harness.timing import synchronize
from stagewise.calc.hardware import last_level_cache_bytes, median_seconds
from stagewise.trace import Tracer

PROJECTIONS = ("qkv_proj", "o_proj", "ffn", "lm_head")  # the stages that stream the weights


def plain_read_bandwidth(device: torch.device | str = "cpu", seconds: float = 1.0) -> dict:
    """Bytes/s of `buffer.sum()` over a float32 buffer of max(1 GiB, 4 x the last-level cache): median of repeats."""
    device = torch.device(device)
    nbytes = max(2**30, 4 * last_level_cache_bytes()) if device.type == "cpu" else 2 * 2**30
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    sync = (lambda: synchronize(device)) if device.type == "cuda" else (lambda: None)
    seconds_per_read = median_seconds(buffer.sum, seconds, sync, max_repeats=20)  # warm-up read first
    return {"buffer_bytes": nbytes, "bytes_per_s": nbytes / seconds_per_read}


def weight_streaming(llm, seconds: float = 1.0) -> dict:
    """The weight-streaming time of one decode token of `llm`'s model on this machine."""
    weights = llm.model.weights
    decode_bytes = weights.decode_bytes()
    bw = plain_read_bandwidth(llm.model.device, seconds)
    return {
        "decode_bytes": decode_bytes,  # every layer's weights, the final norm, the LM head, one embedding row
        "read_GBps": bw["bytes_per_s"] / 1e9,
        "probe_buffer_MiB": bw["buffer_bytes"] / 2**20,
        "ms": 1e3 * decode_bytes / bw["bytes_per_s"],
    }


def stage_breakdown(llm, prompt: str, params, skip_steps: int = 2) -> dict:
    """Run one request traced (timing on); per decode step: ms in each stage, in all stages, and outside them.

    The first `skip_steps` steps (the prefill, a first decode) are left out. Tracing costs a little per
    stage call, so the traced step is somewhat slower than an untraced one: compare the parts, not the sum.
    """
    with Tracer(timing=True) as tracer:
        llm.generate([prompt], params)
    steps = tracer.steps[skip_steps:]
    if not steps:
        return {}
    per_stage: dict[str, float] = {}
    for step in steps:
        for record in step.stages:
            per_stage[record.stage] = per_stage.get(record.stage, 0.0) + record.dur_us / 1e3
    n = len(steps)
    per_stage = {k: v / n for k, v in sorted(per_stage.items(), key=lambda kv: -kv[1])}
    step_ms = sum(s.dur_us for s in steps) / 1e3 / n
    in_stages = sum(per_stage.values())
    return {
        "steps": n,
        "step_ms": step_ms,
        "stages_ms": per_stage,
        "projections_ms": sum(v for k, v in per_stage.items() if k in PROJECTIONS),
        "other_stages_ms": sum(v for k, v in per_stage.items() if k not in PROJECTIONS),
        "outside_stages_ms": step_ms - in_stages,
    }
