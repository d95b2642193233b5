"""The calculator: what a model should cost on a machine, before anything is timed (`stagewise calc`).

Short modules, read in this order:

- `hardware`         peak FLOP/s, memory bandwidth and capacity of a few GPUs, and a probe of this machine
- `counts`           parameters, FLOPs and KV-cache bytes: exact counts and the seeds' shortcuts
- `weight_formats`   bytes per weight of a storage format (4- and 8-bit blocks, floats) or of a GGUF's tensors
- `steps`            prefill / decode / naive steps on the roofline, and the largest batch that fits
- `seeds`            the seeds' worked numbers (Llama 3 405B) next to ours
- `roofline`         the facade: `analyze()`, `summarize()`
- `tensor_parallel`  the same arithmetic per device when a model is split over N GPUs
- `plots`            the roofline and KV-memory figures

The `stagewise calc` command (`stagewise/cli/calc.py`) only formats what these return.
"""

from stagewise.calc.hardware import HARDWARE, Hardware
from stagewise.calc.roofline import Analysis, Quantity, analyze, load_hardware, load_model_config, summarize

__all__ = ["HARDWARE", "Analysis", "Hardware", "Quantity", "analyze", "load_hardware", "load_model_config", "summarize"]
