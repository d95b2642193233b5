"""What machine a number was measured on: embedded in every benchmark result file.

A timing without its machine is not a result. `machine_info()` records the CPU
model, logical cores, the threads torch uses, RAM, the GPU (if any), the
versions of python / torch / triton / transformers / stagewise and the date;
`machine_tag()` turns that into a short folder name such as
`amd-epyc-2t` or `nvidia-h200`, so results from different machines sit side by
side under `benchmarks/results/<tag>/`.
"""

import datetime
import importlib.metadata
import json
import os
import platform
import re
from pathlib import Path

import torch

from stagewise.cpu.build import ENV_SWITCH
from stagewise.files import write_text_atomic
from stagewise.tuning.gemm_forms_cache import cpu_model


def _ram_bytes() -> int | None:
    """Total physical memory in bytes (Linux /proc/meminfo, or sysconf), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file says kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(package: str) -> str | None:
    """Installed version of `package` without importing it (importing triton early would pick a mode)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """Everything needed to know where a benchmark ran; JSON-serializable."""
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "memory_GB": round(props.total_memory / 1e9, 1),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    ram = _ram_bytes()
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_GB": round(ram / 1e9, 1) if ram else None,
        "gpu": gpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "stagewise": _version("stagewise"),  # the installed package (pyproject.toml's version)
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        # the compiled CPU kernels (stagewise/cpu/) switched on for this run, or PyTorch's own
        "cpu_kernels": os.environ.get(ENV_SWITCH) == "1",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|cpu|processor|\d+-core", " ", text.lower())
    text = re.sub(r"@.*$", "", text)  # drop the clock speed ("@ 2.10GHz")
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def machine_tag(info: dict | None = None) -> str:
    """A short folder name for this machine: the GPU's name, or the CPU's name plus torch threads."""
    info = info or machine_info()
    if info.get("gpu"):
        return _slug(info["gpu"]["name"])
    return f"{_slug(info['cpu'])}-{info['torch_threads']}t"


def write_result_json(result: dict, path: str | Path) -> Path:
    """Write a benchmark result (with its `machine` entry) as indented JSON, atomically; parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(result, indent=1, default=str) + "\n")


def busy_note(others: float | None, what: str) -> str | None:
    """A note for a result whose timed runs shared the machine: `others` is the share of the CPU other
    processes used meanwhile (`tuning/cpu_load.LoadProbe`). Above the busy share (25%), a timing
    measures the contention more than the code, and a comparison of two systems can even turn
    around (continuous batching 1.45x, then 1.03x; paged "0.3x" naive): the note says so beside the
    numbers. None on a quiet machine, or where the share is unknown."""
    from stagewise.tuning.cpu_load import busy_share

    if others is None or others <= busy_share():
        return None
    return (
        f"the machine was busy: other processes used {others:.0%} of the CPU while {what} ran, so these "
        "timings and ratios measure that contention, not the systems; rerun on a quiet machine before "
        "drawing a conclusion (TBT p99/p50 far above 1 says the same)"
    )
