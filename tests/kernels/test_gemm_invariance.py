"""The Triton GEMMs are batch-invariant: a row's bits are the same for every M and slot.

`batch_invariant=True` (what the stages run by default) sends every M to one configuration per
(N, K, dtype, format): the split-K kernel of kernels/matmul_decode.py, its splits added in parallel
programs for one 16-row tile and walked in each program past it (the same additions), and
dequant_matmul's decode config. Swept here under the interpreter with a fixed-order `tl.dot`
(tests/kernels/fixed_order_dot.py: numpy's BLAS, the interpreter's own dot, is not row-invariant).
K = 288 makes 5 steps of 64 (the last one partial), two splits of unequal length; N = 40 a partial
tile. The negative control runs `batch_invariant=False`, where M > 16 takes the prefill tiles and
its K loop adds the same steps in another order: it must find a difference, or the sweep could not.
"""

import pytest
import torch

from stagewise.kernels.dequant_matmul import dequant_matmul
from stagewise.kernels.matmul import matmul
from stagewise.quant.quantize import quantize
from tests.kernels.fixed_order_dot import fixed_order_dot  # noqa: F401  (a fixture)
from tests.kernels.row_sweep import assert_invariant, distinct_results, rows_with_probe

pytestmark = pytest.mark.usefixtures("fixed_order_dot")

K, N = 288, 40


def weights(dtype=torch.float32, seed: int = 2) -> torch.Tensor:
    return (torch.randn(K, N, generator=torch.Generator().manual_seed(seed)) / K**0.5).to(dtype)


def probe(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(K, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rows_are_the_same_bits_for_every_m_and_slot(dtype):
    w, x = weights(dtype), probe(dtype)
    groups = distinct_results(lambda m, slot: matmul(rows_with_probe(m, slot, x), w, batch_invariant=True)[slot])
    assert_invariant(groups, f"matmul {dtype}")


def test_gathered_rows_and_a_transposed_weight_too():
    """The LM head's form: rows read through an index, the weight a transposed [N, K] view."""
    hidden = rows_with_probe(70, 33, probe(), seed=4)  # the probe is hidden row 33
    w_t = weights().t().contiguous().t()  # [K, N], column-major

    def run(m, slot):
        index = torch.randint(0, 70, (m,), generator=torch.Generator().manual_seed(m))
        index[slot] = 33
        return matmul(hidden, w_t, row_index=index, batch_invariant=True)[slot]

    assert_invariant(distinct_results(run), "matmul with row_index")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_dequant_matmul_rows_are_the_same_bits_for_every_m_and_slot(kind):
    w, x = quantize(weights(), kind), probe()

    def run(m, slot):
        a = rows_with_probe(m, slot, x)
        return dequant_matmul(a, w.codes, w.scales, w.mins, bits=w.bits, offset=w.offset, batch_invariant=True)[slot]

    assert_invariant(distinct_results(run), f"dequant_matmul {kind}")


def test_without_batch_invariance_the_sweep_finds_a_difference():
    """The negative control: decode (M <= 16) and prefill kernels add a row's K steps differently."""
    w, x, ms = weights(), probe(), (1, 5, 16, 17, 64)
    groups = distinct_results(lambda m, slot: matmul(rows_with_probe(m, slot, x), w)[slot], ms)
    assert len(groups) > 1, "batch_invariant=False gave one result: the sweep would prove nothing"
    assert {m for m, _ in groups[0]} == {1, 5, 16}  # the decode kernel's rows agree among themselves
    q = quantize(w, "q4_1")
    run = lambda m, slot: dequant_matmul(rows_with_probe(m, slot, x), q.codes, q.scales, q.mins, bits=4, offset=0)[slot]  # noqa: E731
    assert len(distinct_results(run, ms)) > 1
