"""The `Stage` record: one pipeline stage with its naive and optimized paths.

Both callables take the same keyword arguments; `example_inputs` builds a set
of them for a given model config and token count, so generic tests, the
`stages` CLI, benchmarks and notebooks can run any stage without knowing it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stagewise.config import ModelConfig

ExampleInputs = Callable[[ModelConfig, int, torch.device, torch.dtype], dict]


@dataclass(frozen=True)
class Stage:
    name: str  # registry key, e.g. "rmsnorm"
    summary: str  # one line: what the stage computes
    shapes: str  # the shape change, e.g. "[T, hidden] -> [T, hidden]"
    naive: Callable  # PyTorch reference
    optimized: Callable  # same signature as `naive`
    optimized_kind: str  # what `optimized` is: "triton", "rust tokenizers", or "fallback: ..."
    example_inputs: ExampleInputs  # (config, num_tokens, device, dtype) -> kwargs for both paths
    outputs: tuple[str, ...] = ("out",)  # names of the returned tensors, in order (() = returns nothing)
    axes: dict[str, str] = field(default_factory=dict)  # tensor name -> axis names, e.g. "num_tokens hidden"

    def run(self, backend: str, **kwargs):
        """Call the naive or the optimized path by name."""
        if backend == "naive":
            return self.naive(**kwargs)
        if backend in ("optimized", "triton"):
            return self.optimized(**kwargs)
        raise ValueError(f"unknown backend '{backend}' for stage '{self.name}'; use naive or triton")
