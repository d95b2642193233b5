"""FlashAttention's tensor-descriptor (TMA) K/V loads: which target gets them, and that they compute
what the pointer loads do.

Chain: the plan gives descriptors to sm_90 16-bit prefill only (pointers for sm_80 / sm_89, fp32,
the decode tile and the interpreter) -> the launcher's default in the interpreter is the pointer
path -> forced on in the interpreter (Triton 3.9's interpreter runs descriptor loads), the
descriptor path gives the pointer path's bits and matches naive, never reads keys past a
sequence's end, and splits keys like the pointer path -> memory a descriptor cannot describe is
refused with a clear error.
"""

import pytest
import torch

from stagewise.kernels import INTERPRETER
from stagewise.kernels.attention_tma import HAS_TENSOR_DESCRIPTORS, descriptors_fit
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.flash_attention import flash_attention, flash_attention_plan
from stagewise.kernels.targets import INTERPRETER_TARGET, gpu_target
from tests.helpers import assert_close
from tests.kernels.test_flash_attention import DEVICE, TOL, packed_batch, reference

needs_interpreter = pytest.mark.skipif(
    not (INTERPRETER and HAS_TENSOR_DESCRIPTORS),
    reason="tensor_descriptors=True is forced only in the interpreter (triton >= 3.4); "
    "on a GPU the plan picks them on sm_90 and the compile gate checks that path",
)
LLAMA_3_8B = dict(group=4, head_dim=128)  # 32 query heads over 8 KV heads, d 128


@pytest.mark.parametrize(
    "capability, dtype, max_q_len, expected",
    [
        (90, torch.bfloat16, 512, HAS_TENSOR_DESCRIPTORS),  # Hopper prefill: TMA
        (90, torch.float16, 512, HAS_TENSOR_DESCRIPTORS),
        (90, torch.float32, 512, False),  # FMA dots read registers, not shared memory
        (90, torch.bfloat16, 1, False),  # the decode tile keeps pointers
        (89, torch.bfloat16, 512, False),  # no TMA before sm_90
        (80, torch.bfloat16, 512, False),
    ],
)
def test_plan_gives_descriptors_to_sm90_16_bit_prefill_only(capability, dtype, max_q_len, expected):
    plan = flash_attention_plan(max_q_len, **LLAMA_3_8B, dtype=dtype, target=gpu_target(capability))
    assert plan.constexprs["TMA"] is expected


def test_interpreter_plan_keeps_pointers():
    plan = flash_attention_plan(512, **LLAMA_3_8B, dtype=torch.bfloat16, target=INTERPRETER_TARGET)
    assert plan.constexprs["TMA"] is False


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_descriptor_loads_give_the_pointer_paths_bits(dtype):
    """Prefill, a chunk on a prefix and a decode row, GQA 3:1: same tiles, same sums, same bits."""
    inputs = packed_batch([37, 5, 1], [37, 21, 9], 6, 2, 32, dtype, seed=7)
    pointers = flash_attention(**inputs)
    descriptors = flash_attention(**inputs, tensor_descriptors=True)
    assert torch.equal(descriptors, pointers)
    assert torch.equal(flash_attention(**inputs, tensor_descriptors=False), pointers)
    assert_close(descriptors, reference(inputs), *TOL[dtype], "descriptors")


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_descriptor_loads_stop_at_each_sequences_keys(num_splits):
    """A cache with gaps: slots past seqused_k hold NaN; the descriptor's shape ends at the sequence's
    keys, so its tail tiles come back as zeros and no NaN is read."""
    capacity, used, q_lens = 40, [33, 1, 17], [1, 1, 17]
    inputs = packed_batch(q_lens, [capacity] * 3, 4, 2, 16, torch.float32, seed=1)
    for b, n in enumerate(used):
        inputs["k"][b * capacity + n : (b + 1) * capacity] = float("nan")
        inputs["v"][b * capacity + n : (b + 1) * capacity] = float("nan")
    inputs["seqused_k"] = torch.tensor(used, dtype=torch.int32, device=DEVICE)
    out = flash_attention(**inputs, num_splits=num_splits, tensor_descriptors=True)
    assert torch.isfinite(out).all()
    assert_close(out, reference(inputs), *TOL[torch.float32], f"{num_splits} splits")


@needs_interpreter
def test_descriptors_refuse_misaligned_memory():
    """A descriptor's start must be 16-byte aligned: k one fp32 element into its storage is not."""
    inputs = packed_batch([4], [4], 2, 1, 16, torch.float32)
    storage = torch.zeros(inputs["k"].numel() + 1, device=DEVICE)
    inputs["k"] = storage[1:].view_as(inputs["k"])
    assert descriptors_fit(inputs["v"]) and not descriptors_fit(inputs["k"])
    with pytest.raises(KernelInputError, match="16-byte aligned"):
        flash_attention(**inputs, tensor_descriptors=True)
    assert torch.isfinite(flash_attention(**inputs)).all()  # the default: pointers
