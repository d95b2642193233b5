"""`StageOps`: call each stage through its chosen backend (and the tracer, when one is active).

The model never calls a stage function directly; it calls
`ops("rmsnorm", layer=i, x=..., weight=..., eps=...)`. That one indirection
lets a run pick naive or Triton per stage (e.g. Triton everywhere but
attention) and lets the tracer see every stage's inputs and outputs.
"""

from stagewise.errors import StagewiseError
from stagewise.stages import STAGES
from stagewise.trace.hooks import active_tracer

BACKENDS = ("naive", "triton")


class StageOps:
    def __init__(self, backend: str = "naive", overrides: dict[str, str] | None = None):
        overrides = dict(overrides or {})
        for name, choice in [("*", backend), *overrides.items()]:
            if choice not in BACKENDS:
                raise StagewiseError(f"unknown backend '{choice}' for stage '{name}'; use one of {', '.join(BACKENDS)}")
            if name != "*" and name not in STAGES:
                raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
        self.backends = {name: overrides.get(name, backend) for name in STAGES}  # stage -> naive|triton
        if "triton" in self.backends.values():
            from stagewise.runtime import configure_triton

            configure_triton()
        self._fns = {
            name: STAGES[name].naive if b == "naive" else STAGES[name].optimized for name, b in self.backends.items()
        }

    def __call__(self, stage: str, layer: int | None = None, **kwargs):
        fn = self._fns[stage]
        tracer = active_tracer()
        if tracer is None:
            return fn(**kwargs)
        return tracer.record_stage(stage, layer, self.backends[stage], fn, kwargs)

    def describe(self) -> str:
        kinds = set(self.backends.values())
        if len(kinds) == 1:
            return kinds.pop()
        return ", ".join(f"{n}={b}" for n, b in self.backends.items())
