"""The one dot-precision policy (`kernels/precision.py`) and what it does to results.

Chain: the policy table (dtype x interpreter x torch's TF32 switch) -> the
autotune keys hold the precision (GPU) -> TF32 on a GPU is really TF32 and
within its tolerance (GPU) -> IEEE fp32 when the switch is off (everywhere).
"""

import pytest
import torch

from stagewise.kernels import INTERPRETER
from stagewise.kernels.precision import DotPolicy, dot_policy
from tests.helpers import assert_close
from tests.kernels.conftest import tf32

GPU = pytest.mark.skipif(INTERPRETER, reason="TF32 and autotuning exist on a GPU only")


@pytest.mark.parametrize("allow_tf32", [False, True], ids=["tf32-off", "tf32-on"])
def test_policy_table(allow_tf32):
    fp32_gpu = "tf32" if allow_tf32 else "ieee"
    expected = {  # (dtype, interpreter): policy
        (torch.float32, False): DotPolicy(fp32_dots=True, input_precision=fp32_gpu),  # torch's switch decides
        (torch.float32, True): DotPolicy(fp32_dots=True, input_precision="ieee"),  # the interpreter has no TF32
        (torch.float16, False): DotPolicy(fp32_dots=False, input_precision="tf32"),  # 16-bit dots; precision unused
        (torch.float16, True): DotPolicy(fp32_dots=False, input_precision="tf32"),  # fp16 dots run in the interpreter
        (torch.bfloat16, False): DotPolicy(fp32_dots=False, input_precision="tf32"),
        (torch.bfloat16, True): DotPolicy(fp32_dots=True, input_precision="ieee"),  # interpreter bf16 is wrong: upcast
    }
    with tf32(allow_tf32):
        for (dtype, interpreter), policy in expected.items():
            assert dot_policy(dtype, interpreter=interpreter) == policy, (dtype, interpreter)


def test_set_float32_matmul_precision_is_the_same_switch():
    """torch.set_float32_matmul_precision('high') turns TF32 on for our kernels as for torch.matmul."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert dot_policy(torch.float32, interpreter=False).input_precision == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert dot_policy(torch.float32, interpreter=False).input_precision == "ieee"
    finally:
        torch.set_float32_matmul_precision(before)


@GPU
def test_autotune_keys_hold_the_precision():
    from stagewise.kernels import flash_attention, matmul

    tuners = [matmul.tuned_kernel(), flash_attention.tuned_kernel()]
    for tuner in tuners:
        assert "INPUT_PRECISION" in tuner.keys and "FP32_DOTS" in tuner.keys, tuner.keys


def _fp32_matmul(allow_tf32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's fp32 a @ b under the given switch, and the exact (float64) product."""
    from stagewise.kernels.matmul import matmul

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(33, 512, generator=gen), torch.randn(512, 96, generator=gen) / 512**0.5
    device = "cuda" if not INTERPRETER else "cpu"
    with tf32(allow_tf32):
        out = matmul(a.to(device), b.to(device))
    return out, (a.double() @ b.double()).float()


def test_fp32_dots_are_ieee_when_tf32_is_off():
    out, exact = _fp32_matmul(allow_tf32=False)
    assert_close(out, exact, 1e-5, 1e-5, "IEEE fp32 matmul")


@GPU
def test_fp32_dots_are_tf32_when_torch_allows_it():
    """TF32 keeps 10 mantissa bits: each operand is off by up to 2^-11 relative, so an output (a sum of
    512 products of rms 1/sqrt(512), random signs) is off by ~5e-4 rms, ~2e-3 at worst over 3168 outputs:
    5e-3 bounds it. IEEE fp32 is off by ~1e-6, so an error above 1e-5 shows that TF32 really ran."""
    out, exact = _fp32_matmul(allow_tf32=True)
    assert_close(out, exact, 5e-3, 5e-3, "TF32 matmul")
    assert (out.cpu() - exact).abs().max() > 1e-5, "allow_tf32 is on but the dots look like IEEE fp32"


@GPU
def test_attention_fp32_dots_follow_the_same_switch():
    """FlashAttention's QK^T and PV dots use TF32 too when allowed: within 1e-2 (scores of size ~1 off by
    ~1e-3, outputs weighted means of N(0, 1) values), and no longer IEEE-exact (error above 1e-5)."""
    from stagewise.kernels.flash_attention import flash_attention
    from stagewise.stages.attention import naive

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(40, 4, 64, generator=gen).cuda() for _ in range(3))
    cu = torch.tensor([0, 40], dtype=torch.int32, device="cuda")
    with tf32(False):
        reference = naive(q, k, v, cu, cu, 0.125)  # fp32 PyTorch, IEEE (the switch off)
    with tf32(True):
        out = flash_attention(q, k, v, cu, cu, 0.125)
    assert_close(out, reference, 1e-2, 1e-2, "TF32 attention")
    assert (out - reference).abs().max() > 1e-5, "allow_tf32 is on but attention's dots look like IEEE fp32"
