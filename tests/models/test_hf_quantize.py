"""A Hugging Face checkpoint quantized at load (`quantization="int8" | "int4"`), against float32.

Two checks, apart: (1) the plumbing, exact: the quantized model's naive tier computes the float
model with each weight replaced by its dequantized codes, so its logits equal those of that
model to float32 rounding; (2) the rounding, bounded: every weight moves by at most half a step of
its group, and the logits' RMS error stays within a measured bound (scripts/measure_quantization.py:
tiny int8 0.013, int4 0.12 of the logits' std; the bounds below leave 2-4x of room).
"""

from dataclasses import replace

import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from stagewise.models.weights import LayerWeights
from stagewise.quant.dequantize import dequantize
from stagewise.quant.packed_weight import is_packed
from tests.checkpoints import hf_tiny_model, write_gguf, write_hf_dir

IDS = [[5, 17, 200, 31, 99], [7, 300, 12]]
RMS_BOUND = {"int8": 0.05, "int4": 0.25}  # RMS logit error / logit std (measured 0.013, 0.12)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("hf") / "tiny", hf_tiny_model(seed=3))


def logits(loaded) -> torch.Tensor:
    batch = ForwardBatch.from_sequences(IDS, [0] * len(IDS), torch.device("cpu"))
    return LlamaModel(loaded, StageOps("naive")).forward(batch, NoKVCache.of(batch))


def dequantized_model(loaded):
    """The same model with every packed weight expanded to float32 (what naive multiplies by)."""
    w = loaded.weights

    def f(t):
        return dequantize(t) if is_packed(t) else t

    layers = [LayerWeights(**{k: f(v) for k, v in vars(lw).items()}) for lw in w.layers]
    embed = dequantize(w.embed).t()  # packed [hidden, vocab] -> [vocab, hidden] rows
    weights = replace(w, embed=embed, layers=layers, lm_head=embed.t())
    return replace(loaded, weights=weights)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_at_load_against_float32(hf_dir, scheme):
    floats = load_model(str(hf_dir), device="cpu", quantization="none")
    quant = load_model(str(hf_dir), device="cpu", quantization=scheme)
    lw, lf = quant.weights.layers[0], floats.weights.layers[0]
    want = "q8_0" if scheme == "int8" else "q4_1"
    assert [getattr(lw, n).kind for n in ("w_qkv", "w_o", "w_gate_up", "w_down")] == [want] * 4
    assert quant.weights.embed.kind == "q8_0" and quant.weights.lm_head is quant.weights.embed
    for name in ("w_qkv", "w_down"):
        # |rounding| <= half the group's step d, plus d's (and m's) float16 rounding: the reference
        # picks codes with the unrounded d, so up to 127 (q8_0) or 15 codes x 2^-11 of d more
        p, f = getattr(lw, name), getattr(lf, name)

        def per_weight(t, g=p.group_size):  # [N, K/G] -> [K, N], one value per weight
            return t.float().abs().repeat_interleave(g, dim=1).t()

        levels = 127 if scheme == "int8" else 15
        bound = per_weight(p.scales) * (0.5 + levels * 2**-11) + 1e-7
        if p.mins is not None:
            bound = bound + per_weight(p.mins) * 2**-11
        assert ((dequantize(p) - f).abs() <= bound).all(), name
    out, ref = logits(quant), logits(floats)
    torch.testing.assert_close(out, logits(dequantized_model(quant)), rtol=1e-5, atol=1e-4)
    rms = (out - ref).pow(2).mean().sqrt() / ref.std()
    assert 0 < rms < RMS_BOUND[scheme], float(rms)


def test_bad_quantization_values_are_one_line(hf_dir, tmp_path):
    with pytest.raises(StagewiseError, match="w_qkv: K = 96 is not a whole number of groups of 64"):
        load_model(str(hf_dir), device="cpu", quantization="int4:g64")
    with pytest.raises(StagewiseError, match="group size is written g32, g64 or g128"):
        load_model(str(hf_dir), device="cpu", quantization="int4:g48")
    with pytest.raises(StagewiseError, match="unknown quantization 'int3'"):
        load_model(str(hf_dir), device="cpu", quantization="int3")
    with pytest.raises(StagewiseError, match="unknown quantization 'auto:g32'"):
        load_model(str(hf_dir), device="cpu", quantization="auto:g32")
    gguf_path = write_gguf(tmp_path / "t.gguf", hf_tiny_model(seed=3))
    with pytest.raises(StagewiseError, match="quantizes a float checkpoint"):
        load_model(str(gguf_path), device="cpu", quantization="int8")


def test_cli_quantizes_at_load(hf_dir, monkeypatch, capsys):
    import sys

    from stagewise import cli

    argv = ["generate", "hi", "--model", str(hf_dir), "--max-tokens", "2", "--quantization", "int4"]
    monkeypatch.setattr(sys, "argv", ["stagewise", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
        raise SystemExit(0)
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None) and out, err
    monkeypatch.setattr(sys, "argv", ["stagewise", *argv[:-1], "int4:g7"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "g32, g64 or g128" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_groups_of_64_in_every_tier(kind):
    """int4:g64 / int8:g64: a group spans two of the Triton kernel's 32-deep steps."""
    from stagewise.quant.quantize import quantize
    from stagewise.stages import dequant_gemm, dequant_gemm_torch

    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(128, 48, generator=gen), kind, group_size=64)  # [K, N], 2 groups
    x = torch.randn(3, 128, generator=gen)
    ref = dequant_gemm.naive(x, w)
    torch.testing.assert_close(dequant_gemm.triton(x, w), ref, rtol=1e-5, atol=1e-5)
    out = dequant_gemm_torch.gemm(x, w)  # bfloat16 activations and scales: 2% of the output
    torch.testing.assert_close(out, ref, rtol=0, atol=0.02 * float(ref.abs().max()))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_weight_beyond_float16_is_refused_not_turned_into_nan_logits(tmp_path, scheme):
    """int8's scale is max|w| / 127: a weight of 1e7 gives 78740, past float16's 65504 (inf, then NaN logits,
    empty text, exit 0). The GGUF path refuses non-finite scales; quantize-at-load does too."""
    model = hf_tiny_model(seed=3)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = 1e7
    path = write_hf_dir(tmp_path / "big", model)
    with pytest.raises(StagewiseError, match=f"{scheme}: layer 1 w_down: its float16 scales hold NaN or infinite"):
        load_model(str(path), quantization=scheme)
    assert torch.isfinite(logits(load_model(str(path), quantization="none"))).all()  # the float model is fine
