"""What rank 0 tells the other ranks each step (as vLLM's driver worker broadcasts its batch).

Rank 0 alone schedules and samples. Before every forward pass it broadcasts a
`StepMessage` on the control group: the step's `ForwardBatch` (input_ids,
positions, ...) and its KV access with its `AttentionMetadata` (slot_mapping,
block_table rows, seq_lens, ...) — the same objects its own forward reads, with the cache
replaced by a `CacheSpec` that says which cache of the worker's own to use.
Each worker's cache has the same blocks and the same block table as rank 0's,
holding only that rank's KV heads, so the same slot numbers are valid on
every rank.
"""

import copy
import dataclasses
from dataclasses import dataclass

import torch

from stagewise.kv.contiguous import ContiguousKVCache
from stagewise.kv.paged import PagedKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.stages.attention_metadata import AttentionMetadata


@dataclass
class CacheSpec:
    """Which cache a step reads and writes, and how a worker builds its own copy of it."""

    key: int  # rank 0's cache number: a new number = a new cache (kv mode makes one per batch)
    kind: str  # "paged" or "contiguous"
    sizes: dict  # the constructor's sizes (blocks, rows, capacity, ...)


@dataclass
class TraceRequest:
    """Rank 0 is tracing this step: trace yours too and send the records back."""

    timing: bool  # record wall times
    t0: float  # rank 0's tracer time origin (perf_counter: one clock for every process of a machine)
    index: int  # the step's index in rank 0's trace


@dataclass
class StepMessage:
    batch: ForwardBatch  # the flattened token batch, on the host
    kv: object  # PagedKVStep / ContiguousKVStep with cache=None, or NoKVCache (kv/)
    cache: CacheSpec | None  # the cache `kv` reads (None: NoKVCache)
    trace: TraceRequest | None  # None: not tracing


@dataclass
class Shutdown:
    """The run is over: leave the loop, close the process groups, exit."""


_keys = iter(range(1, 2**62))


def cache_spec(cache) -> CacheSpec | None:
    if cache is None:
        return None
    if not hasattr(cache, "_tp_key"):
        cache._tp_key = next(_keys)  # rank 0 numbers each cache once; workers build one per number
    if isinstance(cache, PagedKVCache):
        sizes = {
            "num_blocks": cache.num_blocks,
            "block_size": cache.block_size,
            "max_num_reqs": cache.block_table.shape[0],
            "max_model_len": cache.max_blocks_per_req * cache.block_size,
            "spare_block": cache.spare_slot is not None,
        }
        return CacheSpec(cache._tp_key, "paged", sizes)
    if isinstance(cache, ContiguousKVCache):
        return CacheSpec(cache._tp_key, "contiguous", {"num_rows": cache.num_rows, "capacity": cache.capacity})
    raise TypeError(f"tensor parallelism does not know the cache {type(cache).__name__}")


def build_cache(spec: CacheSpec, cfg, dtype, device, table_device):
    """A worker's own cache for `spec`: its KV heads only (`cfg` is the rank's local config)."""
    if spec.kind == "paged":
        return PagedKVCache(cfg, dtype=dtype, device=device, table_device=table_device, **spec.sizes)
    return ContiguousKVCache(
        cfg.num_layers, spec.sizes["num_rows"], spec.sizes["capacity"], cfg.num_kv_heads, cfg.head_dim, dtype, device
    )


def step_message(batch: ForwardBatch, kv, trace: TraceRequest | None) -> StepMessage:
    cache = getattr(kv, "cache", None)
    plain = copy.copy(kv)
    if cache is not None:
        plain.cache = None  # the worker's own cache takes its place
    plain.metadata = dataclasses.replace(kv.metadata, decode_plan=None)  # each rank plans its own
    return StepMessage(_moved(batch, "cpu"), _moved(plain, "cpu"), cache_spec(cache), trace)


def with_cache(kv, cache):
    if cache is None:
        return kv
    kv = copy.copy(kv)
    kv.cache = cache
    return kv


def _moved(obj, device):
    """A copy of `obj` with every tensor attribute (and its metadata's) on `device` (or `obj`)."""
    changes = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor) and value.device != torch.device(device):
            changes[name] = value.to(device)
        elif isinstance(value, AttentionMetadata) and _moved(value, device) is not value:
            changes[name] = _moved(value, device)
    if not changes:
        return obj
    moved = copy.copy(obj)
    vars(moved).update(changes)
    return moved


def to_device(obj, device):
    """A received batch or KV access, its tensors moved to this rank's device."""
    return _moved(obj, device)
