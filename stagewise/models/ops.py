"""`StageOps`: call each stage through its chosen tier (and the tracer, when one is active).

The model never calls a stage function directly; it calls the stage by its
module, `ops(rmsnorm, layer=i, x=..., weight=..., eps=...)`, so an editor (and
a reader) can jump from the model to the stage. That one indirection lets a
run pick a tier per stage — `naive` (the textbook), `torch` (the fast PyTorch
formulation where a stage has one, else naive) or `triton` — and lets the
tracer see every stage's inputs and outputs and which tier ran.

Where two neighbouring stages both run the triton tier, one kernel may do both
(`fuses`, `fused`): RMSNorm inside qkv_proj's input load (`norm_qkv`,
kernels/norm_matmul.py), RoPE inside the paged KV store (`PagedKVStep.rope_and_attend`,
kernels/rope_kv_store.py). The model calls `norm_qkv` and the KV step's
`rope_and_attend` the same way whatever the tiers; they choose. The tracer records
a fused call once, as the later stage, with the scalar `fused` naming both.
`StageOps(..., fuse=False)` (or `ops.fuse = False`) keeps every stage its own
kernel, for comparison.

Batch invariance (the project's design notes): by default a request's numbers
never depend on who else is in the batch. `StageOps(..., batch_invariant=False)` runs the tiers'
batch-variant paths instead, where a stage has some (`Stage.torch_variant`:
a prefill's attention in one product, GEMM forms chosen by the row count;
`Stage.triton_variant`: decode and prefill GEMM kernels, split-K attention by
occupancy, the decode-only fusions): faster, and the negative control of the
invariance tests. The fused RMSNorm + QKV GEMM below is decode-only, so it runs
only then.
"""

from types import ModuleType

from stagewise.errors import StagewiseError
from stagewise.stages import STAGES, qkv_proj, rmsnorm
from stagewise.stages.base import TIERS, stage_of
from stagewise.trace.hooks import active_tracer

BACKENDS = TIERS  # "naive", "torch", "triton"


class StageOps:
    def __init__(
        self,
        backend: str = "torch",
        overrides: dict[str, str] | None = None,
        fuse: bool = True,
        batch_invariant: bool = True,
    ):
        if not isinstance(batch_invariant, bool):
            raise StagewiseError(f"batch_invariant must be True or False, got {batch_invariant!r}")
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
        # False: the tiers' batch-variant paths (`Stage.torch_variant`, `Stage.triton_variant`)
        self.batch_invariant = batch_invariant
        self.overrides = overrides  # stage -> tier, where one stage was asked otherwise
        # stage -> the tier that runs ("torch" falls back to "naive" where a stage has none)
        self.backends = {
            name: stage.tier_that_runs(overrides.get(name, backend))
            for name, stage in STAGES.items()
        }
        if "triton" in self.backends.values():
            from stagewise.runtime import configure_triton

            configure_triton()
        self._fns = {
            name: STAGES[name].tier(tier, batch_invariant) for name, tier in self.backends.items()
        }
        # what a trace calls each: the tier, or what it is ("rust" for tokenize's "triton" tier)
        self._labels = {name: STAGES[name].label(tier) for name, tier in self.backends.items()}
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
        return tracer.record_stage(name, layer, self._labels[name], fn, kwargs)

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

    def norm_qkv(self, layer: int | None, x, weight, eps: float, residual, w_qkv):
        """rmsnorm (+ residual add), then qkv_proj: x [T, hidden] -> qkv [T, (H+2Hkv)*d], residual.

        With both stages on the triton tier, a decode batch (T <= 16) of plain weights runs one
        kernel whose GEMM normalises its input rows as it loads them (kernels/norm_matmul.py) —
        not batch-invariant: its sum of squares is another order than the rmsnorm kernel's, so
        batch-invariant runs keep the two kernels for every T.
        """
        if self.fuses(rmsnorm, qkv_proj) and not self.batch_invariant:
            from stagewise.kernels import norm_matmul as kernel  # lazily: picks the interpreter

            if kernel.fits_norm_matmul(x, weight, w_qkv):
                args = {"x": x, "norm_weight": weight, "eps": eps, "residual": residual, "w": w_qkv}
                return self.fused((rmsnorm, qkv_proj), kernel.norm_matmul, layer=layer, **args)
        x, residual = self(rmsnorm, layer=layer, x=x, weight=weight, eps=eps, residual=residual)
        return self(qkv_proj, layer=layer, x=x, w_qkv=w_qkv), residual  # [T, (H+2Hkv)*d]

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
