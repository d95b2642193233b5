"""Launching a student's Triton kernel on buffers the check owns, so that only the kernel can answer.

12a's checks take the `@triton.jit` kernel itself, not a launcher: the check allocates every
tensor, launches the kernel with the stub's parameters, and reads the result from the output
buffer the kernel wrote. No Python function stands between the kernel and the result, so plain
PyTorch, the package's own kernels or a reference's output cannot pass.

Each tensor lives inside a larger buffer (`Guarded`): a guard band of `GUARD` elements on each
side, and for a strided view the gap between its rows, all poisoned. Inputs are poisoned with
NaN: a load that a mask should have switched off reads NaN, and the NaN reaches the output. The
output starts as a sentinel, inside and around it: an element the kernel never writes, or a
write past the edge, changes nothing else and is found afterwards.

In Triton's CPU interpreter a load or store outside every buffer would read or corrupt this
process's memory (a crash, not a FAIL). There `launch` watches every address the kernel touches
(`_Watch`, wrapping the interpreter's load and store) and stops the launch with a FAIL before an
access that leaves the buffers; a compiled kernel on a GPU has only the guard bands.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

import stagewise.kernels  # noqa: F401 - first: chooses the GPU or the CPU interpreter before triton is imported
from stagewise.exercises.core import Mismatch, NotYet

GUARD = 4096  # poisoned elements before and after every tensor
SENTINEL = -7.0e33  # what the output holds where the kernel has not written


def device() -> torch.device:
    """Where the student's kernel runs: the GPU when Triton compiles for one, else the CPU."""
    return torch.device("cuda" if stagewise.kernels.TRITON_MODE == "cuda" else "cpu")


def interpreted() -> bool:
    return stagewise.kernels.TRITON_MODE != "cuda"


@dataclass
class Guarded:
    """A 1-D or 2-D tensor (`view`) inside a poisoned buffer (`base`); rows may be `row_stride` apart."""

    name: str
    base: torch.Tensor  # [GUARD + span + GUARD], 1-D, contiguous
    view: torch.Tensor  # the tensor the kernel is handed
    inside: torch.Tensor  # bool [len(base)]: elements that belong to the view
    before: torch.Tensor = field(init=False)  # a copy of base at launch, to compare with afterwards

    @classmethod
    def of(cls, name: str, values: torch.Tensor, poison: float, row_stride: int | None = None) -> "Guarded":
        rows, cols = (1, values.shape[0]) if values.dim() == 1 else values.shape
        stride = cols if row_stride is None else row_stride  # elements between row starts
        span = (rows - 1) * stride + cols
        base = torch.full((GUARD + span + GUARD,), poison, dtype=values.dtype, device=device())
        shape, strides = tuple(values.shape), (stride, 1)[-values.dim() :]
        view = base[GUARD:].as_strided(shape, strides)
        view.copy_(values)
        inside = torch.zeros(base.shape[0], dtype=torch.bool)
        inside[GUARD:].as_strided(shape, strides).fill_(True)
        return cls(name, base, view, inside)

    @classmethod
    def output(cls, name: str, shape: tuple[int, ...], dtype=torch.float32) -> "Guarded":
        return cls.of(name, torch.full(shape, SENTINEL, dtype=dtype), poison=SENTINEL)

    def snapshot(self) -> None:
        self.before = self.base.clone()

    def changed(self) -> torch.Tensor:
        """bool [len(base)]: elements whose bits differ from the snapshot."""
        now, was = self.base.view(torch.int32), self.before.view(torch.int32)  # bits: NaN == NaN
        return (now != was).cpu()

    def where(self, index: int) -> str:
        """Name element `index` of the buffer: a view position, or how far outside the view."""
        offset, name = index - GUARD, self.name.removesuffix("_ptr")
        if self.view.dim() == 2:
            stride, cols = self.view.stride(0), self.view.shape[1]
            if 0 <= offset and offset // stride < self.view.shape[0] and offset % stride < cols:
                return f"{name}[{offset // stride}, {offset % stride}]"
        elif 0 <= offset < self.view.shape[0]:
            return f"{name}[{offset}]"
        span = int(self.inside.nonzero().max()) - GUARD + 1
        if offset < 0:
            return f"{_elements(-offset)} before {name}"
        if offset >= span:
            return f"{_elements(offset - span + 1)} past the end of {name}"
        return f"the gap between two rows of {name} (row stride {self.view.stride(0)})"


def _elements(n: int) -> str:
    return f"{n} element" + ("s" if n != 1 else "")


class _Watch:
    """Every address the interpreted kernel loads or stores, checked against the buffers first."""

    def __init__(self, buffers: list[Guarded]):
        self.buffers = buffers
        self.ranges = [(b.base.data_ptr(), b.base.element_size(), b.base.shape[0]) for b in buffers]
        self.loads: dict[str, list[np.ndarray]] = {b.name: [] for b in buffers}  # element indices per load

    def _indices(self, ptrs, mask, what: str) -> None:
        addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.int64)
        owned = np.zeros(addresses.shape, dtype=bool)
        for buffer, (start, size, length) in zip(self.buffers, self.ranges):
            index = (addresses - start) // size
            hit = (addresses >= start) & (index < length)
            owned |= hit
            if what == "load" and hit.any():
                self.loads[buffer.name].append(index[hit])
        if not owned.all():
            address = int(addresses[np.argmin(owned)])

            def distance(b: Guarded) -> int:
                start, end = b.base.data_ptr(), b.base.data_ptr() + b.base.numel() * b.base.element_size()
                return max(start - address, address - end, 0)

            near = min(self.buffers, key=distance)
            index = (address - near.base.data_ptr()) // near.base.element_size()
            raise Mismatch(
                f"your kernel would {what} {_elements(int((~owned).sum()))} outside every tensor it was handed "
                f"(one: {near.where(index)}); stopped before the access. What does the mask let through?"
            )

    @contextmanager
    def watching(self):
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        load, store = builder.create_masked_load, builder.create_masked_store

        def checked_load(ptrs, mask, other, *args):
            self._indices(ptrs, mask, "load")
            return load(ptrs, mask, other, *args)

        def checked_store(ptrs, value, mask, *args):
            self._indices(ptrs, mask, "store")
            return store(ptrs, value, mask, *args)

        builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
        try:
            yield self
        finally:
            del builder.create_masked_load, builder.create_masked_store  # the class's methods again


def kernel_function(kernel, params: list[str]):
    """The Python function inside a student's `@triton.jit` kernel; Mismatch or NotYet otherwise."""
    from triton.runtime import KernelInterface

    if not isinstance(kernel, KernelInterface):
        kind = "a Python function" if callable(kernel) else type(kernel).__name__
        raise Mismatch(
            f"pass the @triton.jit kernel itself, not {kind}: the check launches it on tensors it owns "
            "and reads what the kernel wrote"
        )
    fn = kernel
    while not inspect.isfunction(fn):
        fn = fn.fn  # a JITFunction (GPU) or InterpretedFunction (CPU) holds the Python function
    if fn.__module__.startswith("stagewise."):
        raise Mismatch(f"that is the package's own kernel ({fn.__module__}.{fn.__name__}): write yours")
    try:
        todo = [line.strip() for line in inspect.getsource(fn).splitlines() if "TODO" in line]
    except OSError:  # no source to read (exec'd code): nothing to say
        todo = []
    if todo:
        raise NotYet(f"{len(todo)} lines still marked TODO (delete the mark once a line is done), first: {todo[0]}")
    got = list(inspect.signature(fn).parameters)
    if got != params:
        raise Mismatch(f"the check launches the kernel as ({', '.join(params)}); yours takes ({', '.join(got)})")
    return fn


def launch(kernel, grid: tuple[int, ...], inputs: list[Guarded], output: Guarded, watch: bool, **scalars) -> _Watch:
    """Launch `kernel[grid]` on the buffers' views (by name) and `scalars`; check what it wrote.

    Mismatch when the kernel reads outside an input (seen in the interpreter only), writes into
    an input, writes outside the output, or leaves part of the output unwritten. -> the watch
    (its record of loads; empty on a GPU).
    """
    from triton.runtime.errors import InterpreterError

    buffers = [*inputs, output]
    for b in buffers:
        b.snapshot()
    args = {b.name: b.view for b in buffers}
    recorder = _Watch(buffers)
    try:
        if watch and interpreted():
            with recorder.watching():
                kernel[grid](**args, **scalars)
        else:
            kernel[grid](**args, **scalars)
    except InterpreterError as err:  # the interpreter wraps what the kernel raised
        if isinstance(err.__cause__, Mismatch):
            raise err.__cause__ from None
        raise
    if device().type == "cuda":
        torch.cuda.synchronize()
    for b in inputs:
        read = np.concatenate(recorder.loads[b.name]) if recorder.loads[b.name] else np.zeros(0, np.int64)
        stray = read[~b.inside.numpy()[read]]  # loads that landed in a guard band or a gap (interpreter only)
        if len(stray):
            raise Mismatch(
                f"your kernel reads {_elements(len(stray))} outside {b.name.removesuffix('_ptr')} (the first: "
                f"{b.where(int(stray[0]))}): a mask that lets lanes past the edge, or a wrong row stride?"
            )
        changed = b.changed()
        if changed.any():
            raise Mismatch(f"your kernel writes into its input: {b.where(int(changed.nonzero()[0]))} changed")
    changed = output.changed()
    outside = changed & ~output.inside
    if outside.any():
        first = int(outside.nonzero()[0])
        raise Mismatch(
            f"your kernel writes {_elements(int(outside.sum()))} outside {output.name.removesuffix('_ptr')} (the "
            f"first: {output.where(first)}): a store whose mask lets lanes past the edge"
        )
    missed = output.inside & ~changed
    if missed.any():
        raise Mismatch(
            f"your kernel never writes {int(missed.sum())} of the {output.view.numel()} elements of "
            f"{output.name.removesuffix('_ptr')} (the first: {output.where(int(missed.nonzero()[0]))})"
        )
    return recorder


def no_poison(got: torch.Tensor, what: str) -> None:
    """Mismatch naming the first NaN: every element around the inputs is NaN, so a NaN comes from there."""
    bad = torch.isnan(got)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise Mismatch(
            f"{what}: NaN in {int(bad.sum())} output elements (first at {first}); the check fills everything "
            "around the inputs with NaN, so a load read past the tensor (is it masked?)"
        )
