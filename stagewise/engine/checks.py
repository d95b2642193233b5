"""The API boundary's checks: argument types of `LLM(...)`, and whether a KV cache fits.

They run once, before anything is loaded or allocated — never inside an engine
step, whose launchers must stay free of host synchronisations. Each failure is
a one-line `StagewiseError` naming the argument and what it accepts.
"""

import torch

from stagewise.config import EngineConfig
from stagewise.errors import StagewiseError
from stagewise.kv.paged import (
    free_memory_bytes,
    kv_bytes_per_token,
    num_blocks_for_budget,
)
from stagewise.models import memory
from stagewise.models.registry import LoadedModel

MODES = ("paged", "kv", "naive")


DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)  # what every stage computes in


def check_llm_arguments(model, backend, mode, device, dtype, stage_backends, engine_config) -> None:
    """Types and names of `LLM(...)`'s arguments, checked before anything is loaded."""
    if not isinstance(model, str | LoadedModel):
        raise StagewiseError(
            f"model must be a preset name, a path or a LoadedModel, got {type(model).__name__}"
        )
    if not isinstance(backend, str):
        raise StagewiseError(f"backend must be 'naive', 'torch' or 'triton', got {backend!r}")
    if not isinstance(mode, str) or mode not in MODES:
        raise StagewiseError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    if device is not None and not isinstance(device, str | torch.device):
        raise StagewiseError(
            f"device must be a string such as 'cpu' or 'cuda', got {type(device).__name__}"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise StagewiseError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    if dtype is not None and dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise StagewiseError(f"dtype must be one of {names}, got {dtype!r}")
    if stage_backends is not None and not (
        isinstance(stage_backends, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in stage_backends.items())
    ):
        raise StagewiseError(
            f"stage_backends must be a dict of stage name -> backend name, got {stage_backends!r}"
        )
    if engine_config is not None and not isinstance(engine_config, EngineConfig):
        raise StagewiseError(
            f"engine_config must be an EngineConfig, got {type(engine_config).__name__}"
        )


def check_engine_memory(loaded: LoadedModel, ecfg: EngineConfig, max_model_len: int) -> None:
    """Refuse a KV pool + block table larger than the free memory, before allocating either."""
    device = loaded.device
    if device.type == "meta":
        return  # shape only: nothing is allocated
    cfg = loaded.config
    blocks = num_blocks_for_budget(cfg, ecfg, max_model_len, loaded.dtype, device)
    kv = blocks * ecfg.block_size * kv_bytes_per_token(cfg, loaded.dtype)
    table = ecfg.max_num_seqs * -(-max_model_len // ecfg.block_size) * 4  # int32 block table
    free = free_memory_bytes(device)
    if kv + table > free:
        raise StagewiseError(
            f"the paged KV cache needs {(kv + table) / 2**30:.1f} GiB ({blocks} blocks, "
            f"{ecfg.max_num_seqs} seats) but {free / 2**30:.1f} GiB are free; "
            "lower num_kv_blocks / max_num_seqs"
        )


def check_kv_batches(cfg, dtype, device, batches: list[tuple[int, int]]) -> None:
    """Mode "kv": refuse a static batch whose contiguous KV cache cannot fit, before any runs.

    `batches`: (rows, capacity) of each static batch; a batch reserves capacity = longest prompt
    + largest max_tokens for every row, used or not: rows * capacity * kv_bytes_per_token.
    """
    if device.type == "meta":
        return
    free = memory.free_bytes(device)
    rows, capacity = max(batches, key=lambda b: b[0] * b[1])
    need = rows * capacity * kv_bytes_per_token(cfg, dtype)
    if free is not None and need > free:
        raise StagewiseError(
            f"mode 'kv' needs a {need / 2**30:.1f} GiB contiguous KV cache ({rows} prompts x "
            f"{capacity} tokens, prompt + max_tokens reserved for each) but {free / 2**30:.1f} GiB "
            "are free; lower max_tokens or max_num_seqs, or use mode='paged'"
        )
