"""A Q4_K_M-style GGUF: W_q, W_k in Q4_K, W_v in Q6_K (and gate Q4_K, up Q6_K), kept packed.

The tiny preset's rows are 96 long; a K-quant block holds 256, so this model has hidden 256 and
8 query heads of 32 (W_o's rows are 256 long too).
"""

import dataclasses
import pickle

import gguf
import pytest
import torch

from stagewise.config import PRESETS
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.quantized import weight_formats
from stagewise.models.registry import load_model
from stagewise.parallel.shard import shard_layer, shard_plan
from stagewise.quant.packed_parts import PackedParts
from stagewise.quant.packed_weight import PackedWeightError, is_packed
from stagewise.quant.quantize import quantize
from stagewise.stages import dequant_gemm
from tests.checkpoints import hf_tiny_model, write_gguf

CFG = dataclasses.replace(PRESETS["tiny"], hidden_size=256, num_heads=8, head_dim=32)
T = gguf.GGMLQuantizationType
TYPES = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "ffn_gate": T.Q4_K}
TYPES |= {"ffn_up": T.Q6_K, "ffn_down": T.Q6_K, "attn_output": T.Q4_K}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "tiny-q4_k_m.gguf"
    model = hf_tiny_model(seed=5, cfg=CFG)
    return write_gguf(path, model, cfg=CFG, projection_type=lambda n: TYPES[n.split(".")[2]])


@pytest.fixture(scope="module")
def loaded(mixed_gguf):
    """(kept packed, dequantized to float32) models of the same file."""
    packed = load_model(str(mixed_gguf), device="cpu", quantization="auto")
    return packed, load_model(str(mixed_gguf), device="cpu", quantization="none")


def logits(loaded, tier: str) -> torch.Tensor:
    ids = [[5, 17, 200, 31, 99], [7, 300, 12]]
    batch = ForwardBatch.from_sequences(ids, [0] * len(ids), torch.device("cpu"))
    return LlamaModel(loaded, StageOps(tier)).forward(batch, NoKVCache.of(batch))  # [B, vocab]


def test_mixed_fused_weights_stay_packed(mixed_gguf, capsys):
    packed = load_model(str(mixed_gguf), device="cpu", quantization="auto")
    assert "dequantized" not in capsys.readouterr().err  # nothing expanded, no notice
    floats = load_model(str(mixed_gguf), device="cpu", quantization="none")
    for lp, lf in zip(packed.weights.layers, floats.weights.layers):
        qkv = lp.w_qkv
        assert isinstance(qkv, PackedParts) and qkv.dtype == "q4_k+q6_k"
        assert qkv.widths == [CFG.q_size + CFG.kv_size, CFG.kv_size]  # W_q | W_k joined
        assert qkv.shape == tuple(lf.w_qkv.shape) == (256, CFG.qkv_size)
        # bytes: q|k 0.75 per weight, v 1.25 (the file's blocks with float32 group scales)
        assert qkv.nbytes == 256 * (CFG.q_size + CFG.kv_size) * 3 // 4 + 256 * CFG.kv_size * 5 // 4
        assert lp.w_gate_up.dtype == "q4_k+q6_k"
        assert torch.equal(dequant_gemm.dequantize_fused(qkv), lf.w_qkv)  # gguf.quants' values
    assert "q4_k+q6_k x 4" in weight_formats(packed.weights)


def test_logits_of_each_tier_against_the_dequantized_model(loaded):
    """naive: x @ the same float32 matrix, so the float model's logits bit for bit; torch:
    bfloat16 activations and scales, RMS within 2% of the logits' std (as for one kind)."""
    packed, floats = loaded
    ref = logits(floats, "naive")
    assert torch.equal(logits(packed, "naive"), ref)
    out = logits(packed, "torch")
    assert 0 < (out - ref).pow(2).mean().sqrt() / ref.std() < 0.02


def test_parts_product_matches_dequantized_on_every_tier():
    """x @ [W_1 | W_2] with W_1 q4_0 and W_2 q8_0: every tier against x @ the float32 matrix."""
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(64, 48, generator=gen), torch.randn(64, 32, generator=gen)
    parts = PackedParts([quantize(w1, "q4_0"), quantize(w2, "q8_0")])
    x = torch.randn(5, 64, generator=gen)
    ref = x @ dequant_gemm.dequantize_fused(parts)  # [5, 80]
    assert torch.equal(dequant_gemm.naive(x, parts), ref)
    torch.testing.assert_close(dequant_gemm.triton(x, parts), ref, rtol=1e-4, atol=1e-4)
    # torch tier: x, scales and the output are bfloat16 (8 significant bits). Outputs here reach
    # |27| (std 8), where one bfloat16 step is 0.125: atol 0.15 is about one output rounding step
    # (measured max error 0.107), rtol 0.03 a few steps of the scales' and inputs' rounding
    torch.testing.assert_close(dequant_gemm.torch_tier(x, parts), ref, rtol=0.03, atol=0.15)


def test_columns_cut_part_by_part():
    """A rank's columns: runs inside each part; one kind left is a plain PackedWeight."""
    gen = torch.Generator().manual_seed(1)
    a, b = quantize(torch.randn(32, 16, generator=gen), "q4_1"), quantize(torch.randn(32, 8), "q8_0")
    parts = PackedParts([a, b])
    index = torch.tensor([2, 3, 17, 18, 20])  # two columns of a, three of b
    cut = parts.out_features(index)
    assert isinstance(cut, PackedParts) and cut.widths == [2, 3]
    full = dequant_gemm.dequantize_fused(parts)  # [32, 24]
    assert torch.equal(dequant_gemm.dequantize_fused(cut), full[:, index])
    only_a = parts.out_features(slice(4, 9))
    assert is_packed(only_a) and not isinstance(only_a, PackedParts) and only_a.kind == "q4_1"
    copy = pickle.loads(pickle.dumps(parts))  # what a spawned tensor-parallel rank receives
    assert copy.dtype == "q4_1+q8_0" and torch.equal(dequant_gemm.dequantize_fused(copy), full)
    with pytest.raises(PackedWeightError, match="no single codes"):
        parts.codes  # noqa: B018 (the property raises)
    with pytest.raises(PackedWeightError, match="does not fall on groups"):
        parts.in_features(0, 16)


def test_tensor_parallel_shards_keep_the_parts(loaded):
    """Rank r of 2: its query heads and KV head, each still in its part's format, exactly."""
    packed, floats = loaded
    for rank in range(2):
        plan = shard_plan(packed.config, rank, 2)
        mine = shard_layer(packed.weights.layers[0], packed.config, plan)
        want = shard_layer(floats.weights.layers[0], floats.config, plan)
        assert mine.w_qkv.dtype == "q4_k+q6_k" and mine.w_gate_up.dtype == "q4_k+q6_k"
        assert torch.equal(dequant_gemm.dequantize_fused(mine.w_qkv), want.w_qkv)
        assert torch.equal(dequant_gemm.dequantize_fused(mine.w_gate_up), want.w_gate_up)


def test_the_tracer_lists_each_part(loaded):
    from stagewise.trace.tracer import _packed_records

    records = _packed_records("w_qkv", loaded[0].weights.layers[0].w_qkv)
    names = [r.name for r in records]
    assert names == ["w_qkv[0].codes", "w_qkv[0].scales", "w_qkv[0].mins"] + [
        "w_qkv[1].codes",
        "w_qkv[1].scales",
    ]
    assert records[0].shape == [CFG.q_size + CFG.kv_size, 256 // 2]  # [N_1, K/2] uint8
    assert records[3].shape == [CFG.kv_size, 256]  # q6_k: one int8 code per value
