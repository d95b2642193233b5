"""The `Stage` record: one pipeline stage and its three tiers.

    naive    the formula a textbook prints, in PyTorch: the reference everything is tested against
    torch    optional: a faster PyTorch formulation for CPUs, in its own module beside the stage
    triton   the Triton kernel (the interpreter on a CPU, compiled on a GPU); for tokenize, Rust

All tiers take the same keyword arguments; `example_inputs` builds a set of
them for a given model config and token count, so generic tests, the `stages`
CLI, benchmarks and notebooks can run any stage without knowing it.
`optimized` is the Triton tier under its older name.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from stagewise.config import ModelConfig

ExampleInputs = Callable[[ModelConfig, int, torch.device, torch.dtype], dict]
TIERS = (
    "naive",
    "torch",
    "triton",
)  # what `LLM(backend=...)`, the CLI's --backend and `Stage.tier` take


@dataclass(frozen=True)
class Stage:
    name: str  # registry key, e.g. "rmsnorm"
    summary: str  # one line: what the stage computes
    shapes: str  # the shape change, e.g. "[T, hidden] -> [T, hidden]"
    naive: Callable  # the textbook formula in PyTorch: the reference
    triton: Callable  # same signature as `naive`: the Triton kernel (tokenize: Rust `tokenizers`)
    triton_kind: str  # what `triton` is: "triton: ...", "rust tokenizers"
    example_inputs: ExampleInputs  # (config, num_tokens, device, dtype) -> kwargs for every tier
    outputs: tuple[str, ...] = (
        "out",
    )  # names of the returned tensors, in order (() = returns nothing)
    axes: dict[str, str] = field(
        default_factory=dict
    )  # tensor name -> axis names, "num_tokens hidden"
    torch: Callable | None = None  # same signature: the fast PyTorch tier, where a stage has one
    torch_kind: str = ""  # what `torch` changes, one line ("" when there is no torch tier)

    @property
    def optimized(self) -> Callable:
        """The Triton tier (its name before the torch tier existed)."""
        return self.triton

    @property
    def optimized_kind(self) -> str:
        return self.triton_kind

    def tier_that_runs(self, tier: str) -> str:
        """The tier a request for `tier` runs: "torch" falls back to "naive" where there is none."""
        tier = "triton" if tier == "optimized" else tier
        if tier not in TIERS:
            choices = ", ".join(TIERS)
            raise ValueError(
                f"unknown backend '{tier}' for stage '{self.name}'; use one of {choices}"
            )
        return "naive" if tier == "torch" and self.torch is None else tier

    def tier(self, tier: str) -> Callable:
        """The callable of a tier, by name (`tier_that_runs` decides the fallback)."""
        return getattr(self, self.tier_that_runs(tier))

    def run(self, backend: str, **kwargs):
        """Call a tier by name: "naive", "torch" or "triton" ("optimized" = "triton")."""
        return self.tier(backend)(**kwargs)


def stage_of(stage: "Stage | ModuleType | str", registry: dict[str, "Stage"]) -> "Stage":
    """A stage given as its record, its module (which holds `STAGE`) or its registry name."""
    if isinstance(stage, Stage):
        return stage
    if isinstance(stage, ModuleType) and isinstance(getattr(stage, "STAGE", None), Stage):
        return stage.STAGE
    if isinstance(stage, str) and stage in registry:
        return registry[stage]
    raise KeyError(f"not a stage: {stage!r}; stages are {', '.join(registry)}")
