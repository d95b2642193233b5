"""The compiled RMSNorm and RoPE (stagewise/cpu/rows.py): RMSNorm is the formula and a row's bits do
not depend on its call (M = 1..2048, slots, 1 and 2 threads); RoPE gives the torch tier's own bits;
bad shapes are one line; the torch tier uses them only when the kernels are on."""

import pytest
import torch

from stagewise.cpu import build
from stagewise.cpu import rows as cpu_rows
from stagewise.errors import StagewiseError
from stagewise.stages import rmsnorm_torch, rope_torch
from stagewise.stages.rope import build_cos_sin_cache
from stagewise.stages.rope import naive as rope_naive
from tests.stages.test_batch_invariance_ops import assert_invariant, distinct_results, probe_of, rows_with_probe

pytestmark = [
    pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: the kernels are not built"),
    pytest.mark.usefixtures("int8_kernels"),  # the compiled CPU kernels are opt-in
]


@pytest.mark.parametrize("n", [576, 37, 8])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_is_the_formula(n, with_residual):
    gen = torch.Generator().manual_seed(n)
    x, res = torch.randn(5, n, generator=gen), torch.randn(5, n, generator=gen)
    w = 1 + 0.1 * torch.randn(n, generator=gen)
    out, total = cpu_rows.rmsnorm(x, w, 1e-5, res if with_residual else None)
    s = (x + res if with_residual else x).double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert (out.double() - want).abs().max() < 1e-5
    assert torch.equal(total, x + res) if with_residual else total is x


def test_rmsnorm_rows_are_batch_invariant():
    weight = 1 + 0.1 * probe_of(576, seed=2)
    probe, probe_res = probe_of(576), probe_of(576, seed=3)

    def run(m, slot):
        x, res = rows_with_probe(m, slot, probe, 4), rows_with_probe(m, slot, probe_res, 5)
        return cpu_rows.rmsnorm(x, weight, 1e-5, res)[0][slot]

    assert_invariant(distinct_results(run), "cpu rmsnorm")


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "d"), [(1, 9, 3, 64), (7, 4, 2, 6), (40, 3, 1, 16)])
def test_rope_gives_the_torch_tiers_bits(tokens, heads, kv_heads, d, monkeypatch):
    gen = torch.Generator().manual_seed(d)
    q, k = torch.randn(tokens, heads, d, generator=gen), torch.randn(tokens, kv_heads, d, generator=gen)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    cache = build_cos_sin_cache(128, d, 10000.0)  # [max_pos, d] = [cos, sin]
    compiled = rope_torch.rope(positions, q, k, cache)
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    stock = rope_torch.rope(positions, q, k, cache)
    assert torch.equal(compiled[0], stock[0]) and torch.equal(compiled[1], stock[1])
    want_q, want_k = rope_naive(positions, q, k, cache)
    assert (compiled[0] - want_q).abs().max() < 1e-5 and (compiled[1] - want_k).abs().max() < 1e-5


def test_the_torch_tier_norm_runs_it_only_when_on(monkeypatch):
    x, w = probe_of(3, 576), 1 + 0.1 * probe_of(576, seed=2)
    assert torch.equal(rmsnorm_torch.rmsnorm(x, w, 1e-5)[0], cpu_rows.rmsnorm(x, w, 1e-5)[0])
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    assert torch.equal(rmsnorm_torch.rmsnorm(x, w, 1e-5)[0], torch.rms_norm(x, (576,), w, 1e-5))


def test_bad_shapes_are_one_line():
    with pytest.raises(StagewiseError, match="cpu rmsnorm") as err:
        cpu_rows.rmsnorm(torch.randn(2, 8), torch.ones(7), 1e-5)
    assert "\n" not in str(err.value)
    table = torch.zeros(10, 16)
    with pytest.raises(StagewiseError, match="past the table"):
        cpu_rows.rope(torch.tensor([3, 10]), torch.randn(2, 2, 8), torch.randn(2, 1, 8), table)
    with pytest.raises(StagewiseError, match="cpu rope"):
        cpu_rows.rope(torch.tensor([3]), torch.randn(1, 2, 8), torch.randn(1, 1, 4), table)
    with pytest.raises(StagewiseError, match="takes float32 CPU tensors, got torch.float64"):
        cpu_rows.rmsnorm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(StagewiseError, match="want \\[T\\]"):
        cpu_rows.rope(torch.tensor([3, 4]), torch.randn(1, 2, 8), torch.randn(1, 1, 8), table)
