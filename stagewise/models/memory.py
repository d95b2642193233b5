"""Will the model fit? The memory a model needs, against what the machine has free, before loading.

A model's weights take `num_parameters * bytes per element`: Llama 2 7B (6.7e9
parameters) is 27 GB in float32 and 13.5 GB in bfloat16. The loaders read one
tensor at a time and cast it to the target dtype straight away, so the weights
never exist in float32 all at once; the check below refuses, with the numbers,
a model that cannot fit instead of letting the operating system kill the
process half-way through loading.
"""

import os

import torch

from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError

GB = 1e9
HEADROOM = 1.05  # activations, the KV cache and the allocator need a little more than the weights


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights in `dtype` (a tied LM head counted once)."""
    return config.num_parameters() * torch.empty(0, dtype=dtype).element_size()


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device` (None where the platform does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = _meminfo_available()
    limit = _cgroup_room()  # a container's memory limit is lower than what the host reports
    if free is None or limit is None:
        return free if limit is None else limit
    return min(free, limit)


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:  # Linux: what can be allocated without swapping
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # macOS and Windows lack these names
        return None


def _cgroup_room() -> int | None:
    """cgroup v2 `memory.max - memory.current`, None without a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def check_fits(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    name: str,
    kept: int | None = None,
) -> None:
    """Raise a one-line error when the weights in `dtype` do not fit on `device` (or in CPU memory,
    which every tensor passes through on its way to the device). `kept`: the bytes the weights take
    when some stay quantized (a GGUF's packed blocks), instead of every weight in `dtype`."""
    needed = weight_bytes(config, dtype) if kept is None else kept
    for where in dict.fromkeys([torch.device("cpu"), device]):
        free = free_bytes(where)
        if free is None or needed * HEADROOM <= free:
            continue
        if kept is not None:
            raise StagewiseError(
                f"{name} needs {kept / GB:.1f} GB kept quantized; {free / GB:.1f} GB free on "
                f"{where.type}"
            )
        # the size asked for, or the smaller one
        half = dtype if dtype != torch.float32 else torch.bfloat16
        sizes = (
            f"{weight_bytes(config, torch.float32) / GB:.1f} GB in float32, "
            f"{weight_bytes(config, half) / GB:.1f} GB in {str(half).removeprefix('torch.')}"
        )
        raise StagewiseError(f"{name} needs {sizes}; {free / GB:.1f} GB free on {where.type}")
