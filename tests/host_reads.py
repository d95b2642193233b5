"""Count host reads of tensor values: the operations that, on a GPU, make the host wait for the device.

On a GPU, reading a tensor's values on the host (`.item()`, `.tolist()`,
`int(t)`, `if t.any():`, a boolean mask whose result size depends on the data)
waits for every kernel queued before it: a host sync. On a CPU nothing waits,
so `HostReadCounter` records the reads themselves, in two nets:

- Python-level: `torch.Tensor.item`, `tolist`, `numpy`, `cpu`, `__bool__`,
  `__int__`, `__float__`, `__index__`, `__complex__`, `__array__`,
  `__repr__`, `__str__`, `__format__`, `__contains__` are wrapped;
- dispatcher-level (a `TorchDispatchMode`): `_local_scalar_dense` (what
  item/int/bool lower to), ops whose output size depends on the values
  (`nonzero`, `masked_select`, `unique`, boolean-mask indexing, ...), value
  comparisons that return a Python bool (`equal`, `allclose`), and copies from
  a CUDA tensor into host memory.

Triton's CPU interpreter copies kernel arguments to numpy: that is the kernel
launch (on a GPU, a queued launch), so counting pauses inside it. Each read
is recorded as (what, where): `where` is the first frame outside torch,
triton and this module, e.g. `stagewise/engine/sampler.py:33`.

What a CPU run cannot see: `.to("cpu")` / `.copy_()` of a device tensor into
host memory, since on a CPU the "device" is the host (the GPU check with
`torch.cuda.set_sync_debug_mode` covers that).
"""

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PYTHON_READS = (
    "item",
    "tolist",
    "numpy",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__complex__",
    "__array__",
    "__repr__",
    "__str__",
    "__format__",
    "__contains__",
)
# aten ops that read values on the host, or whose output shape depends on the values (a sync on a GPU)
DISPATCH_READS = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_numpy",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "equal",
    "allclose",
    "is_nonzero",
    "bincount",
    "multinomial",  # checks the probabilities on the host (`.item()` inside) before drawing
}
MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}  # a bool index runs nonzero inside
_SKIP_DIRS = (str(Path(torch.__file__).parent), "/triton/", str(Path(__file__)))


def _where() -> str:
    """The first caller outside torch, triton and this module: 'path/relative/to/repo.py:line'."""
    frame = sys._getframe(1)
    while frame is not None and any(d in frame.f_code.co_filename for d in _SKIP_DIRS):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    for root in ("/stagewise/", "/tests/"):
        if root in path:
            path = root.lstrip("/") + path.split(root, 1)[1]
            break
    return f"{path}:{frame.f_lineno}"


def _is_mask(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)


def _reads_values(func, args, kwargs) -> bool:
    name = func.overloadpacket.__name__
    if name in DISPATCH_READS:
        return True
    if name == "repeat_interleave":  # with tensor repeats, the output size is their sum (unless given)
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None
    if name in MASK_INDEXING and len(args) > 1:
        return any(_is_mask(i) for i in args[1] if i is not None)
    if name in ("_to_copy", "copy_"):  # device -> host copies (seen on a GPU only)
        src = args[1] if name == "copy_" else args[0]
        dst_cpu = (args[0].device.type == "cpu") if name == "copy_" else kwargs.get("device") == torch.device("cpu")
        return isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst_cpu
    return False


class HostReadCounter(TorchDispatchMode):
    """`with HostReadCounter() as counter:` ... `counter.reads` lists (what, where) of every host read."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self._paused = 0
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused and _reads_values(func, args, kwargs):
            self.reads.append((func.overloadpacket.__name__, _where()))
        return func(*args, **kwargs)

    def _wrap(self, name: str):
        original = getattr(torch.Tensor, name)
        counter = self

        def _counting_read(tensor, *args, **kwargs):
            if not counter._paused:
                counter.reads.append((name, _where()))
            counter._paused += 1  # the call below lowers to aten ops: count the read once
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._paused -= 1

        return _counting_read

    def _pause_around(self, original):
        counter = self

        def _counting_paused(*args, **kwargs):
            counter._paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._paused -= 1

        return _counting_paused

    def __enter__(self):
        for name in PYTHON_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name))
        self._interpreter = None
        if "triton.runtime.interpreter" in sys.modules:  # a kernel launch, not a read: pause inside
            self._interpreter = sys.modules["triton.runtime.interpreter"].GridExecutor
            self._grid_call = self._interpreter.__call__
            self._interpreter.__call__ = self._pause_around(self._grid_call)
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)  # it was inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, original)
        if self._interpreter is not None:
            self._interpreter.__call__ = self._grid_call
        return result
