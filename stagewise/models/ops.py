"""`StageOps`: call each stage through its chosen tier (and the tracer, when one is active).

The model never calls a stage function directly; it calls the stage by its
module, `ops(rmsnorm, layer=i, x=..., weight=..., eps=...)`, so an editor (and
a reader) can jump from the model to the stage. That one indirection lets a
run pick a tier per stage — `naive` (the textbook), `torch` (the fast PyTorch
formulation where a stage has one, else naive) or `triton` — and lets the
tracer see every stage's inputs and outputs and which tier ran.

Where two neighbouring stages both run the triton tier, the model may call one
kernel that does both (`fuses`, `fused`): RMSNorm inside qkv_proj's input load
(kernels/norm_matmul.py), RoPE inside the paged KV store (kernels/rope_kv_store.py).
The tracer records such a call once, as the later stage, with the scalar
`fused` naming both. `StageOps(..., fuse=False)` (or `ops.fuse = False`) keeps
every stage its own kernel, for comparison.
"""

from types import ModuleType

from stagewise.errors import StagewiseError
from stagewise.stages import STAGES
from stagewise.stages.base import TIERS, stage_of
from stagewise.trace.hooks import active_tracer

BACKENDS = TIERS  # "naive", "torch", "triton"


class StageOps:
    def __init__(
        self, backend: str = "torch", overrides: dict[str, str] | None = None, fuse: bool = True
    ):
        overrides = dict(overrides or {})
        for name, choice in [("*", backend), *overrides.items()]:
            if choice not in BACKENDS:
                choices = ", ".join(BACKENDS)
                raise StagewiseError(
                    f"unknown backend '{choice}' for stage '{name}'; use one of {choices}"
                )
            if name != "*" and name not in STAGES:
                raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
        self.backend = backend  # the tier asked for every stage
        self.fuse = fuse  # allow one kernel for neighbouring triton stages (`fuses`)
        self.overrides = overrides  # stage -> tier, where one stage was asked otherwise
        # stage -> the tier that runs ("torch" falls back to "naive" where a stage has none)
        self.backends = {
            name: stage.tier_that_runs(overrides.get(name, backend))
            for name, stage in STAGES.items()
        }
        if "triton" in self.backends.values():
            from stagewise.runtime import configure_triton

            configure_triton()
        self._fns = {name: STAGES[name].tier(tier) for name, tier in self.backends.items()}
        # stage module -> its name: a forward pass makes ~8 stage calls per layer, and a dict
        # lookup is cheaper than `stage_of`'s checks (modules live as long as the process)
        self._names: dict[ModuleType, str] = {}

    def __call__(self, stage, layer: int | None = None, **kwargs):
        """Run `stage` (its module, its `Stage` record or its name) with keyword arguments."""
        name = self._names.get(stage) if isinstance(stage, ModuleType) else None
        if name is None:
            name = stage_of(stage, STAGES).name
            if isinstance(stage, ModuleType):
                self._names[stage] = name
        fn = self._fns[name]
        tracer = active_tracer()
        if tracer is None:
            return fn(**kwargs)
        return tracer.record_stage(name, layer, self.backends[name], fn, kwargs)

    def fuses(self, *stages) -> bool:
        """True when fusion is on and every one of `stages` runs the triton tier."""
        return self.fuse and all(self.tier(stage) == "triton" for stage in stages)

    def fused(self, stages: tuple, fn, layer: int | None = None, **kwargs):
        """Run `fn(**kwargs)`, one kernel doing the work of `stages` (modules, in order).

        Traced as the last stage (its registry entry names the outputs), with the scalar
        `fused` = "rmsnorm+qkv_proj": a trace shows one call where the kernels are one.
        """
        tracer = active_tracer()
        if tracer is None:
            return fn(**kwargs)
        names = [stage_of(stage, STAGES).name for stage in stages]
        result = tracer.record_stage(names[-1], layer, "triton", fn, kwargs)
        tracer.current_step_records()[-1].scalars["fused"] = "+".join(names)
        return result

    def tier(self, stage) -> str:
        """The tier that runs `stage` (module, record or name): "naive", "torch" or "triton"."""
        return self.backends[stage_of(stage, STAGES).name]

    def describe(self) -> str:
        """The tier asked for, then any per-stage overrides: "torch", "triton, attention=naive"."""
        if not self.overrides:
            return self.backend
        return ", ".join([self.backend, *(f"{n}={b}" for n, b in self.overrides.items())])

    def tiers_run(self) -> str:
        """Which stages each tier runs: "torch: qkv_proj, rope, ...; naive: tokenize, ..."."""
        by_tier: dict[str, list[str]] = {}
        for name, tier in self.backends.items():
            by_tier.setdefault(tier, []).append(name)
        return "; ".join(f"{tier}: {', '.join(names)}" for tier, names in by_tier.items())
