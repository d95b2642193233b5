"""Launch plans cached per shape key (`kernels/plan_cache.py`): same plans as computed fresh, computed once
per key, never shared across shapes, dtypes or targets; and the tuned kernel called directly after its
first launch.

The plans here are checked against numbers worked out by hand from the tile rules (the kernels'
docstrings) and against the uncached function (`fn.__wrapped__`) after the launcher has used the cached
one, which would catch a launcher that modifies a plan it shares with every later call. Every test starts
with empty caches (conftest.py).
"""

import pytest
import torch

import stagewise.kernels.activation as activation
import stagewise.kernels.dequant_matmul as dequant
import stagewise.kernels.flash_attention as flash
import stagewise.kernels.kv_store as kv_store
import stagewise.kernels.matmul as matmul
import stagewise.kernels.matmul_decode as decode
import stagewise.kernels.paged_attention as paged
import stagewise.kernels.rmsnorm as rmsnorm
import stagewise.kernels.rope as rope
import stagewise.kernels.row_tiles as row_tiles
from stagewise.kernels import INTERPRETER
from stagewise.kernels.checks import KernelInputError
from stagewise.kernels.plan_cache import cdiv, launch_tuned, next_power_of_2, tuned_choices
from stagewise.kernels.precision import dot_policy
from stagewise.kernels.targets import INTERPRETER_TARGET, gpu_target
from stagewise.stages.ffn import silu_and_mul_naive
from tests.helpers import TOLERANCES, assert_close

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _counting(monkeypatch, module, name: str) -> list:
    """Wrap module.name (a real plan function) so each computation is recorded; -> the record."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_host_integer_helpers_match_hand_values():
    assert [next_power_of_2(x) for x in (0, 1, 2, 3, 37, 64, 65, 576)] == [0, 1, 2, 4, 64, 64, 128, 1024]
    assert [cdiv(x, 16) for x in (0, 1, 16, 17, 960)] == [0, 1, 1, 2, 60]


def test_a_second_call_with_the_same_shape_does_not_replan(monkeypatch):
    computed = _counting(monkeypatch, rmsnorm, "rmsnorm_plan")
    weight = torch.ones(40, device=DEVICE)
    for _ in range(3):
        rmsnorm.rmsnorm(torch.randn(3, 40, device=DEVICE), weight, 1e-5)
    assert computed == [(40, False)]
    rmsnorm.rmsnorm(torch.randn(3, 40, device=DEVICE), weight, 1e-5, residual=torch.randn(3, 40, device=DEVICE))
    rmsnorm.rmsnorm(torch.randn(2, 24, device=DEVICE), torch.ones(24, device=DEVICE), 1e-5)
    assert computed == [(40, False), (40, True), (24, False)]  # residual and width are part of the key
    assert (
        rmsnorm.rmsnorm_options(40, False)["BLOCK_SIZE"] == 64
        and rmsnorm.rmsnorm_options(24, False)["BLOCK_SIZE"] == 32
    )


def test_decode_gemm_plans_once_and_keeps_the_plan_intact(monkeypatch):
    computed = _counting(monkeypatch, decode, "split_plan")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 200, generator=gen), torch.randn(200, 24, generator=gen)
    for _ in range(2):
        out = matmul.matmul(a.to(DEVICE), b.to(DEVICE))
        assert_close(out, a.double() @ b.double(), 1e-5, 1e-5, "decode matmul")
    assert len(computed) == 1  # one shape: planned once
    if INTERPRETER:  # 256 x 64 tiles, split 2: K = 200 is 4 steps of 64, 2 per split; N = 24 is one tile
        cfg = decode.INTERPRETER_CONFIG
        grid, k_per_split, options = decode.decode_launch(24, 200, cfg, dot_policy(torch.float32))
        assert (grid, k_per_split, options["BLOCK_N"], options["BLOCK_K"]) == ((1, 2), 128, 256, 64)
        assert decode.decode_launch(24, 200, cfg, dot_policy(torch.float32)) == decode.decode_launch.__wrapped__(
            24, 200, cfg, dot_policy(torch.float32)
        )


@pytest.mark.skipif(not INTERPRETER, reason="the interpreter's fixed prefill tile")
def test_prefill_gemm_grid_for_an_irregular_shape():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(37, 40, generator=gen), torch.randn(40, 130, generator=gen)
    out = matmul.matmul(a, b)
    assert_close(out, a.double() @ b.double(), 1e-5, 1e-5, "prefill matmul")
    grid, tiles = matmul.fixed_launch(37, 130, torch.float32, INTERPRETER_TARGET, None)
    # 64 x 128 tiles: cdiv(37, 64) = 1 tile-row, cdiv(130, 128) = 2 tile-columns
    assert grid == (2,) and (tiles["BLOCK_M"], tiles["BLOCK_N"]) == (64, 128)
    assert (grid, tiles) == matmul.fixed_launch.__wrapped__(37, 130, torch.float32, INTERPRETER_TARGET, None)


def test_dtypes_do_not_share_a_plan():
    def plan(dtype, launch=dequant.dequant_launch):  # SmolLM2's QKV in q4_1: N 960, K 576, groups of 32
        return launch(1, 960, 576, dtype, DEVICE, 4, 0, True, 32, None, dot_policy(dtype))

    f32, f16 = plan(torch.float32), plan(torch.float16)
    assert f32[2]["FP32_DOTS"] and not f16[2]["FP32_DOTS"]  # fp32 activations take fp32 dots, fp16 tensor-core ones
    assert dequant.dequant_launch.cache_info().currsize == 2
    assert f16 == plan(torch.float16, dequant.dequant_launch.__wrapped__)


def test_a_bad_config_is_refused_on_every_call():
    bad = dequant.DequantConfig(block_m=16, block_n=32, block_k=48, split_k=1)  # 48 cuts groups of 32
    for _ in range(2):  # an error is not cached as a plan
        with pytest.raises(KernelInputError, match="cuts groups"):
            dequant.dequant_launch(1, 64, 64, torch.float32, DEVICE, 4, 0, True, 32, bad, dot_policy(torch.float32))


def test_gpu_targets_do_not_share_a_plan():
    """fp32 dots run on FMA units, whose tiles spill on sm_90 at half the sm_89 size (attention_common's
    tile_fits): a prefill chunk of 64 rows x 3 heads at d 128 gets 32-row tiles on sm_89, 16-row on sm_90."""
    plans = {cap: paged.paged_attention_options(64, 3, 128, torch.float32, gpu_target(cap)) for cap in (89, 90)}
    for cap, options in plans.items():
        fresh = paged.paged_attention_plan(64, 3, 128, torch.float32, gpu_target(cap)).launch_options()
        assert options == fresh
    assert (plans[89]["BLOCK_M"], plans[90]["BLOCK_M"]) == (32, 16)
    assert paged.paged_attention_options.cache_info().currsize == 2
    args = (300, 3, 64, torch.bfloat16, gpu_target(90))  # a prefill: the tuner's candidates that fit sm_90
    tuned = flash.flash_attention_launch_plan(*args)
    assert tuned.autotuned and tuned == flash.flash_attention_plan(*args)


@pytest.mark.parametrize("num_tokens, heads, kv_heads, d", [(1, 9, 3, 64), (7, 5, 1, 32)])
def test_row_kernel_plans_match_fresh_ones_after_a_launch(num_tokens, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(num_tokens, heads, d, generator=gen), torch.randn(num_tokens, kv_heads, d, generator=gen)
    cos_sin = torch.randn(16, d, generator=gen)
    positions = torch.arange(num_tokens) % 16
    rope.rope(positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), cos_sin.to(DEVICE))
    assert rope.rope_launch(num_tokens, heads, kv_heads, d) == rope.rope_launch.__wrapped__(
        num_tokens, heads, kv_heads, d
    )
    heads_tiling, candidates, blocks = kv_store.kv_store_launch(num_tokens, kv_heads, d)
    assert blocks == 1 and heads_tiling == {"HEAD_DIM": d, "BLOCK_D": d, "BLOCK_HEADS": next_power_of_2(kv_heads)}
    assert (heads_tiling, candidates, blocks) == kv_store.kv_store_launch.__wrapped__(num_tokens, kv_heads, d)


def test_the_tuned_kernel_is_called_directly_after_its_first_launch(monkeypatch):
    """A one-config autotuner (the interpreter cannot time several): the first launch goes through it and
    records its choice; the second calls the kernel itself with that choice, and gives the same result."""
    kernel = activation._silu_and_mul_kernel
    (tile,) = activation.silu_and_mul_tiles(5, 48, interpreter=True)
    tuner = row_tiles.autotuner(kernel, (tile,), ("tokens_bucket", "inter"))
    runs, real_run = [], tuner.run
    monkeypatch.setattr(tuner, "run", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    gate_up = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    key = ("silu_and_mul", 8, 48, gate_up.dtype)
    outs = []
    for _ in range(2):
        out = torch.empty(5, 48, device=DEVICE)
        grid = lambda meta: (cdiv(5, meta["BLOCK_T"]), cdiv(48, meta["BLOCK_C"]))  # noqa: E731
        args = dict(gate_up_ptr=gate_up, out_ptr=out, num_tokens=5, inter=48, stride_in_row=96, stride_out_row=48,
                    tokens_bucket=8, INTERPRETED=INTERPRETER)  # fmt: skip
        launch_tuned(tuner, kernel, key, grid, args)
        outs.append(out)
    assert len(runs) == 1  # the second launch skipped the autotuner
    assert {**tile.meta(), "num_warps": tile.num_warps}.items() <= tuned_choices()[key].items()
    for out in outs:
        assert_close(out, silu_and_mul_naive(gate_up), *TOLERANCES[torch.float32], what="silu_and_mul")
