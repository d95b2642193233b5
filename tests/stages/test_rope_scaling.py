"""RoPE scaling (Llama 3.1+ `llama3`, `linear`, llama.cpp's `rope_freqs`) against transformers.

The oracle for the frequencies is transformers' own `ROPE_INIT_FUNCTIONS`; the oracle for whole
models is `LlamaForCausalLM` with the same `rope_scaling`, on prompts longer than the
pre-training context (`original_max_position_embeddings`), where the scaling changes the angles.
"""

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stagewise.config import PRESETS, RopeScaling
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.stages.rope import build_cos_sin_cache, inverse_frequencies
from tests.checkpoints import hf_tiny_model, write_gguf, write_hf_dir
from tests.helpers import assert_close
from tests.models.test_loaders import all_logits

# Small numbers so that the tiny model (head_dim 16, theta 1e4) has pairs in all three llama3 regions:
# wavelengths 6.3 (< 64/4: kept), 19.9 and 62.8 (blended), 199 and up (> 64/1: divided by factor).
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 3.0}
LONG_PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(150)], [11, 12, 13]]  # 150 > 64 original positions


def hf_inv_freq(rope: dict, head_dim: int, theta: float) -> torch.Tensor:
    config = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta, rope_scaling=dict(rope)
    )
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")[0]


def scaling_of(rope: dict) -> RopeScaling:
    params = {k: v for k, v in rope.items() if k != "rope_type"}
    return RopeScaling(kind=rope["rope_type"], **params)


def llama_cpp_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), written out as it does it."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.oracle
@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 500000.0), (128, 500000.0)])
def test_inverse_frequencies_match_transformers(rope, head_dim, theta):
    expected = hf_inv_freq(rope, head_dim, theta)
    actual = inverse_frequencies(head_dim, theta, scaling_of(rope))
    assert_close(actual, expected, 1e-6, 0, f"{rope['rope_type']} inv_freq, d={head_dim}")
    assert not torch.allclose(actual, inverse_frequencies(head_dim, theta)), "the scaling must change something"


@pytest.mark.oracle
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.2-3b", "llama-3-405b"])
def test_presets_scale_like_the_real_configs(preset):
    """Llama 3.2 1B/3B: factor 32; Llama 3.1 405B: factor 8; both llama3 with (1, 4, 8192)."""
    config = PRESETS[preset]
    factor = 8.0 if preset == "llama-3-405b" else 32.0
    real = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    expected = hf_inv_freq(real, config.head_dim, config.rope_theta)
    actual = inverse_frequencies(config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert_close(actual, expected, 1e-6, 0, preset)
    assert config.max_position_embeddings == 131072


def test_llama_cpp_rope_freqs_equal_llama3():
    """The GGUF form: dividing by llama.cpp's per-pair factors gives the llama3 frequencies."""
    factors = llama_cpp_rope_freqs(LLAMA3, 16, 10000.0)
    assert factors[0] == 1 and factors[-1] == 4 and 1 < factors[1] < 4  # all three regions
    by_factors = inverse_frequencies(16, 10000.0, RopeScaling(kind="freq_factors", freq_factors=tuple(factors)))
    assert_close(by_factors, inverse_frequencies(16, 10000.0, scaling_of(LLAMA3)), 1e-6, 0, "rope_freqs")


def test_cache_rows_hold_the_scaled_angles():
    """Worked example: row p of the cache is [cos(p * inv_freq), sin(p * inv_freq)]."""
    cache = build_cos_sin_cache(100, 16, 10000.0, scaling=RopeScaling(kind="linear", factor=2.0))
    assert cache.shape == (100, 16)
    # pair 0 has inv_freq 1, halved by the linear factor 2: position 10 turns by 5 radians
    assert cache[10, 0].item() == pytest.approx(math.cos(5.0), abs=1e-6)
    assert cache[10, 8].item() == pytest.approx(math.sin(5.0), abs=1e-6)


def hf_logits_of(model, prompts) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.mark.oracle
@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_hf_dir_with_rope_scaling_matches_transformers(tmp_path, rope, monkeypatch):
    import tests.models.test_loaders as tl

    monkeypatch.setattr(tl, "PROMPTS", LONG_PROMPTS)
    model = hf_tiny_model(seed=5, rope_scaling=dict(rope))
    loaded = load_model(str(write_hf_dir(tmp_path / "hf", model)))
    assert loaded.config.rope_scaling == scaling_of(rope)
    expected = hf_logits_of(model, LONG_PROMPTS)
    assert_close(all_logits(loaded), expected, 1e-4, 1e-4, f"tiny HF dir, {rope['rope_type']} RoPE")
    plain = hf_logits_of(hf_tiny_model(seed=5), LONG_PROMPTS)
    assert (plain - expected).abs().max() > 1e-2, "the scaling must change the logits"


@pytest.mark.oracle
def test_gguf_rope_freqs_matches_transformers_llama3(tmp_path, monkeypatch):
    """A GGUF carrying llama.cpp's `rope_freqs.weight` gives transformers' llama3 logits."""
    import tests.models.test_loaders as tl

    monkeypatch.setattr(tl, "PROMPTS", LONG_PROMPTS)
    model = tl.round_embedding_to_q8_0(hf_tiny_model(seed=6, rope_scaling=dict(LLAMA3)))
    factors = llama_cpp_rope_freqs(LLAMA3, 16, 10000.0)
    loaded = load_model(str(write_gguf(tmp_path / "tiny.gguf", model, rope_freqs=factors)))
    assert loaded.config.rope_scaling.kind == "freq_factors"
    assert_close(all_logits(loaded), hf_logits_of(model, LONG_PROMPTS), 1e-4, 1e-4, "GGUF rope_freqs vs HF llama3")


def test_unsupported_rope_scaling_is_one_line(tmp_path):
    import json

    d = write_hf_dir(tmp_path / "hf", hf_tiny_model(seed=1))
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StagewiseError, match=r"RoPE scaling 'yarn' is not supported; known: default, linear, llama3$"):
        load_model(str(d))


def test_triton_kernel_reads_the_scaled_cache():
    """The kernel is unchanged: given the llama3-scaled cache it rotates exactly as the naive stage."""
    from stagewise.stages.rope import naive, triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = build_cos_sin_cache(200, 16, 10000.0, device, scaling=scaling_of(LLAMA3))
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 63, 64, 150, 199], device=device)
    q = torch.randn(6, 4, 16, generator=gen).to(device)
    k = torch.randn(6, 2, 16, generator=gen).to(device)
    q_ref, k_ref = naive(positions, q, k, cache)
    q_out, k_out = triton(positions, q.clone(), k.clone(), cache)
    assert_close(q_out, q_ref, 1e-5, 1e-5, "triton rope, scaled cache, q")
    assert_close(k_out, k_ref, 1e-5, 1e-5, "triton rope, scaled cache, k")
    plain_q, _ = naive(positions, q, k, build_cos_sin_cache(200, 16, 10000.0, device))
    assert (plain_q - q_ref).abs().max() > 1e-2, "the scaled cache must rotate differently"
