"""Count the bytes a kernel loads from given tensors, in Triton's CPU interpreter.

The interpreter turns every `tl.load` into one call of its builder's
`create_masked_load` with the addresses and the mask; wrapping that call counts
what a GPU would fetch (before caches): the lanes that are on and point into a
tensor's storage. A measurement of traffic claims, not of speed.
"""

import contextlib

import torch


@contextlib.contextmanager
def count_loaded_bytes(*tensors: torch.Tensor):
    """Yields a list, one entry per tensor, filled with the bytes loaded from it inside the block."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    loaded = [0] * len(tensors)
    original = builder.create_masked_load

    def counting_load(ptrs, mask, other, *args, **kwargs):
        addresses, on = ptrs.data, mask.data
        element_bytes = ptrs.get_element_ty().primitive_bitwidth // 8
        for i, (start, size) in enumerate(spans):
            loaded[i] += int((on & (addresses >= start) & (addresses < start + size)).sum()) * element_bytes
        return original(ptrs, mask, other, *args, **kwargs)

    builder.create_masked_load = counting_load
    try:
        yield loaded
    finally:
        del builder.create_masked_load  # back to the class's method
