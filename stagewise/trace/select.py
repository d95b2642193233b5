"""Which part of a trace to show: `--layers`, `--steps`, `--stage`, for every output format.

Index lists like `0,2-4` are parsed into ranges first and checked against what
exists (the model's layers, the run's steps) before they are expanded, so
`--layers 0-999999999` is an error naming the valid range, not a list of a
billion numbers. The same selection drives the tree, the tables and the JSON
and Chrome exports (`select()` keeps only the selected steps and stage calls).
"""

from dataclasses import replace

from stagewise.errors import StagewiseError
from stagewise.trace.tracer import Tracer


def parse_ranges(text: str, what: str) -> list[tuple[int, int]]:
    """'0,2-4' -> [(0, 0), (2, 4)], refusing empty lists, negative numbers and reversed ranges."""
    ranges = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise StagewiseError(f"--{what} has an empty item in '{text}'; use numbers like 0,2-4")
        lo, sep, hi = part.partition("-")
        if not (lo.strip().isdigit() and (not sep or hi.strip().isdigit())):
            raise StagewiseError(f"--{what} expects numbers like 0,2-4, got '{text}'")
        low, high = int(lo), int(hi) if sep else int(lo)
        if low > high:
            raise StagewiseError(f"--{what} range {part} runs backwards; write {high}-{low}")
        ranges.append((low, high))
    return ranges


def check_ranges(ranges: list[tuple[int, int]], count: int, what: str, owner: str) -> list[int]:
    """The indices of `ranges`, each checked to lie in 0..count-1 (`owner` has `count` of `what`)."""
    for low, high in ranges:
        if high >= count:
            bad = f"{low}-{high}" if low != high else str(low)
            raise StagewiseError(f"--{what} {bad} is out of range: {owner} has {count} {what}, valid 0-{count - 1}")
    return sorted({i for low, high in ranges for i in range(low, high + 1)})


def select(tracer: Tracer, layers, steps, stages) -> Tracer:
    """A copy of `tracer` with only the selected steps, layers and stages (for the JSON / Chrome exports).

    layers: "all" or a list of layer indices (stage calls outside the layers stay);
    steps: None (all) or a list of step indices; stages: empty (all) or a set of stage names.
    """

    def keep(rec) -> bool:
        in_layers = layers == "all" or rec.layer is None or rec.layer in layers
        return in_layers and (not stages or rec.stage in stages)

    out = Tracer(timing=tracer.timing)
    out.model, out.summary = tracer.model, tracer.summary
    out.prelude = [rec for rec in tracer.prelude if keep(rec)]
    out.steps = [
        replace(step, stages=[rec for rec in step.stages if keep(rec)])
        for step in tracer.steps
        if steps is None or step.index in steps
    ]
    return out
