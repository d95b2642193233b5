"""The API boundary's checks: the arguments of `LLM(...)`, and whether a KV cache fits.

They run once, before anything is loaded or allocated — never inside an engine
step, whose launchers must stay free of host synchronisations. Each failure is
a one-line `StagewiseError` naming the argument and what it accepts.
"""

import torch

from stagewise.config import EngineConfig, ModelConfig, ParallelConfig
from stagewise.engine.speculative import SpeculativeConfig, parse_speculative_config
from stagewise.errors import StagewiseError
from stagewise.kv.paged import (
    free_memory_bytes,
    kv_bytes_per_token,
    num_blocks_for_budget,
)
from stagewise.kv.prefix_cache import check_prefix_cache
from stagewise.models import memory
from stagewise.models.registry import LoadedModel

MODES = ("paged", "kv", "naive")


# what every stage computes in
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


def engine_config_of(engine_config: EngineConfig | None, prefix_cache) -> EngineConfig | None:
    """`engine_config` with LLM's `prefix_cache` ("hash", "radix", "none"; None: the config's)."""
    if prefix_cache is None:
        return engine_config
    check_prefix_cache(prefix_cache)
    ecfg = engine_config or EngineConfig()
    if not ecfg.enable_prefix_caching and prefix_cache != "none":
        raise StagewiseError(
            f"prefix_cache={prefix_cache!r} but engine_config has enable_prefix_caching=False"
        )
    return ecfg.with_updates(prefix_cache=prefix_cache)


def check_flags(**flags) -> None:
    """Each of `flags` (name=value) must be True or False."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise StagewiseError(f"{name} must be True or False, got {value!r}")


def speculative_config_of(value, mode: str) -> SpeculativeConfig | None:
    """`speculative_config` ({"method": "ngram", ...}, JSON, "ngram:4", a config or None), parsed;
    only mode "paged" speculates."""
    spec = parse_speculative_config(value)
    if spec is not None and mode != "paged":
        raise StagewiseError(
            f"speculative_config needs mode='paged' (mode '{mode}' does not speculate)"
        )
    return spec


def parallel_config_of(
    tensor_parallel_size: int, parallel_config: ParallelConfig | None
) -> ParallelConfig:
    """The tensor-parallel settings: a `ParallelConfig`, or one of `tensor_parallel_size` ranks."""
    pcfg = parallel_config or ParallelConfig(tensor_parallel_size=tensor_parallel_size)
    if parallel_config is not None and tensor_parallel_size not in (1, pcfg.tensor_parallel_size):
        raise StagewiseError(
            "give tensor_parallel_size or parallel_config, not two different sizes"
        )
    return pcfg


def max_model_len_of(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """The engine's longest prompt + output: `ecfg.max_model_len`, or the model's limit."""
    limit, asked = cfg.max_position_embeddings, ecfg.max_model_len
    if asked is not None and asked > limit:
        raise StagewiseError(f"max_model_len={asked} is out of range: {cfg.name} allows 1..{limit}")
    return asked or limit


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
