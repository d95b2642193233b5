"""The `Stage` record: one pipeline stage and its three tiers.

    naive    the formula a textbook prints, in PyTorch: the reference everything is tested against
    torch    optional: a faster PyTorch formulation for CPUs, in its own module beside the stage
    triton   the Triton kernel (the interpreter on a CPU, compiled on a GPU); for tokenize, Rust

All tiers take the same keyword arguments; `example_inputs` builds a set of
them for a given model config and token count, so generic tests, the `stages`
CLI, benchmarks and notebooks can run any stage without knowing it.
`optimized` is the Triton tier under its older name (an alias kept for one release).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from stagewise.config import ModelConfig

ExampleInputs = Callable[[ModelConfig, int, torch.device, torch.dtype], dict]
# what `LLM(backend=...)`, the CLI's --backend and `Stage.tier` take
TIERS = ("naive", "torch", "triton")


@dataclass(frozen=True)
class Stage:
    name: str  # registry key, e.g. "rmsnorm"
    summary: str  # one line: what the stage computes
    shapes: str  # the shape change, e.g. "[T, hidden] -> [T, hidden]"
    naive: Callable  # the textbook formula in PyTorch: the reference
    triton: Callable  # same signature as `naive`: the Triton kernel (tokenize: Rust `tokenizers`)
    triton_kind: str  # what `triton` is: "triton: ...", "rust tokenizers"
    example_inputs: ExampleInputs  # (config, num_tokens, device, dtype) -> kwargs for every tier
    # names of the returned tensors, in order (() = returns nothing)
    outputs: tuple[str, ...] = ("out",)
    # tensor name -> axis names, "num_tokens hidden"
    axes: dict[str, str] = field(default_factory=dict)
    torch: Callable | None = None  # same signature: the fast PyTorch tier, where a stage has one
    torch_kind: str = ""  # what `torch` changes, one line ("" when there is no torch tier)
    # same signature: the torch tier's faster paths whose numbers depend on the batch (a prefill's
    # attention in one product, GEMM forms chosen by the row count): what the torch tier runs with
    # `batch_invariant=False`; None = the torch tier has no such paths
    torch_variant: Callable | None = None
    # same signature: the Triton tier's faster paths whose numbers depend on the batch (a kernel or
    # a fusion chosen by the row count, split-K by occupancy): what it runs with
    # `batch_invariant=False`; None = the Triton tier is batch-invariant either way
    triton_variant: Callable | None = None

    # the Triton tier and its description under their older names: aliases for one release
    optimized = property(lambda self: self.triton, doc="The Triton tier (use `triton`).")
    optimized_kind = property(lambda self: self.triton_kind, doc="Use `triton_kind`.")

    def label(self, tier: str) -> str:
        """What a trace calls a tier that runs: its name, or what a "triton" tier that is no Triton
        kernel really is (tokenize's: "rust", the Rust `tokenizers` library)."""
        if tier == "triton" and not self.triton_kind.startswith("triton"):
            return self.triton_kind.split()[0]
        return tier

    def tier_that_runs(self, tier: str) -> str:
        """The tier a request for `tier` runs: "torch" falls back to "naive" where there is none."""
        tier = "triton" if tier == "optimized" else tier
        if tier not in TIERS:
            choices = ", ".join(TIERS)
            raise ValueError(
                f"unknown backend '{tier}' for stage '{self.name}'; use one of {choices}"
            )
        return "naive" if tier == "torch" and self.torch is None else tier

    def tier(self, tier: str, batch_invariant: bool = True) -> Callable:
        """The callable of a tier, by name (`tier_that_runs` decides the fallback).

        `batch_invariant=False`: the tier's batch-variant paths, where it has some."""
        name = self.tier_that_runs(tier)
        if not batch_invariant:
            variant = {"torch": self.torch_variant, "triton": self.triton_variant}.get(name)
            if variant is not None:
                return variant
        return getattr(self, name)

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
