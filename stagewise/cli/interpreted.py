"""Triton on a CPU, said on screen: progress through each step, layer by layer, and an estimate.

Without a CUDA device the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): every
program instance is Python code, about a millisecond each, so one step of a real model takes
minutes (SmolLM2-135M's 30 layers: several), while `--model tiny` (2 layers, small matrices) runs
the same kernels in seconds. `generate` and `trace` with the triton tier on a CPU run under a
`ProgressTracer`: a tracer (it records what a trace records) that also moves a progress row on
stderr at every layer, and prints once, when the first layer is done, what the whole run will
take at that pace and how to see the kernels sooner.

    with traced(llm, prompts, max_tokens, timing) as tracer:   # trace: a Tracer, with progress when
        llm.generate(prompts, ...)                                  # interpreted
    with interpreter_progress(llm, prompts, max_tokens):           # generate: no tracer otherwise
        ...

The row is shown on a terminal only (`bench/harness/progress.py`), and not by `generate`, whose
text streams to the same terminal; the estimate line is printed on stderr unless STAGEWISE_QUIET
is set.
"""

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from stagewise.bench.harness.progress import Bar, progress
from stagewise.trace.tracer import Tracer

ESTIMATE_ABOVE_S = 20.0  # a run expected to take less than this gets no estimate line


def interpreted(llm) -> bool:
    """True when some stage of `llm` runs the triton tier in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1" and "triton" in llm.ops.backends.values() and not llm.weightless


def estimated_steps(llm, prompts: list, max_tokens: int) -> int:
    """Engine steps the run will take, about (fewer when a request stops early): the prompts'
    prefill (chunks of the token budget in paged mode; one batch each in kv mode), then one step per
    output token after the first."""
    lengths = [len(llm.tokenizer.encode(p)) if isinstance(p, str) else 64 for p in prompts]
    if llm.mode == "paged":
        budget = llm.engine_config.max_num_batched_tokens
        return math.ceil(sum(lengths) / budget) + max_tokens - 1
    if llm.mode == "kv":
        return math.ceil(len(prompts) / llm.engine_config.max_num_seqs) * max_tokens
    return len(prompts) * max_tokens  # naive: one request after another, every token a full pass


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ProgressTracer(Tracer):
    """A Tracer whose every layer advances a progress row; one estimate line after the first layer."""

    def __init__(self, bar, num_layers: int, steps: int, name: str, timing: bool = True):
        super().__init__(timing=timing)
        self.bar, self.num_layers, self.num_steps, self.name = bar, num_layers, steps, name
        self._layer: int | None = None  # the layer the last stage call ran in
        self._step = -1
        self._started = time.perf_counter()
        self._said = False

    def begin_step(self, index: int, *args, **kwargs):
        super().begin_step(index, *args, **kwargs)
        self._step, self._layer = index, None
        if index >= self.num_steps:  # more steps than estimated (a long chunked prefill, preemption)
            self.num_steps = index + 1
            self.bar.update(total=self.num_steps * (self.num_layers + 1))
        self._describe(0)

    def end_step(self, *args, **kwargs) -> None:
        super().end_step(*args, **kwargs)
        self.bar.advance()  # the step's last unit: LM head and sampling

    def record_stage(self, stage: str, layer, backend: str, fn, kwargs: dict):
        if self._step >= 0 and layer != self._layer:  # a layer ends where another stage begins
            if self._layer is not None:
                self.bar.advance()
                self._first_layer_done()
            self._layer = layer
            if layer is not None:
                self._describe(layer)
        return super().record_stage(stage, layer, backend, fn, kwargs)

    def _describe(self, layer: int) -> None:
        self.bar.update(
            f"triton in the CPU interpreter · step {self._step + 1} of ~{self.num_steps} · "
            f"layer {layer + 1} of {self.num_layers}"
        )

    def _first_layer_done(self) -> None:
        """After the first layer: what the whole run takes at this pace, once."""
        if self._said:
            return
        self._said = True
        per_layer = time.perf_counter() - self._started
        total = per_layer * (self.num_layers + 1) * self.num_steps
        if total < ESTIMATE_ABOVE_S or os.environ.get("STAGEWISE_QUIET"):
            return
        faster = "--backend torch runs this model fast"
        if self.name != "tiny":
            faster = "--model tiny runs the same kernels in seconds, " + faster
        print(
            f"note: the triton tier runs in Triton's CPU interpreter (no CUDA device): "
            f"{_duration(per_layer)} a layer here, so {self.name}'s ~{self.num_steps} steps of "
            f"{self.num_layers} layers take about {_duration(total)}. Ctrl-C stops; {faster}",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def interpreter_progress(
    llm, prompts: list, max_tokens: int, timing: bool = False, row: bool = True
) -> Iterator[ProgressTracer | None]:
    """A ProgressTracer, active, when `llm` runs Triton in the CPU interpreter; else None.
    `row=False`: the estimate line only, no live row (`generate` streams its text on the terminal)."""
    if not interpreted(llm):
        yield None
        return
    steps = estimated_steps(llm, prompts, max_tokens)
    layers = llm.config.num_layers
    name = llm.describe()["name"]
    with progress("triton in the CPU interpreter", total=steps * (layers + 1)) if row else nullcontext(Bar()) as bar:
        with ProgressTracer(bar, layers, steps, name, timing=timing) as tracer:
            yield tracer


@contextmanager
def traced(llm, prompts: list, max_tokens: int, timing: bool = True) -> Iterator[Tracer]:
    """An active Tracer for `trace`: a ProgressTracer when the kernels are interpreted."""
    with interpreter_progress(llm, prompts, max_tokens, timing=timing) as tracer:
        if tracer is not None:
            yield tracer
            return
    with Tracer(timing=timing) as tracer:
        yield tracer
