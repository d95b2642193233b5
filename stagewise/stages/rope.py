"""Stage 5: RoPE — rotary position embedding applied to q and k.

    positions [T], q [T, H, d], k [T, Hkv, d], cos_sin_cache [max_position, rotary_dim]
        -> q, k rotated (same shapes)

Each pair of features (i, i + d/2) of a head is rotated by the angle
`position * theta^(-2i/d)`. Rotating q and k by their own positions makes the
dot product q.k depend only on the distance between the two tokens.

Convention: rotate-half ("NeoX" style, as Hugging Face's Llama uses): a head's
first half pairs with its second half. llama.cpp's GGUF converter permutes the
rows of W_q and W_k to use interleaved pairs (2i, 2i + 1) instead; our GGUF
loader undoes that permutation (`models/gguf_loader.py`), so the rotate-half
rule here is correct for weights from either source.

The angles are precomputed once (space for time, as in vLLM): row p of
`cos_sin_cache` is [cos(p * f_0..f_{d/2-1}), sin(p * f_0..f_{d/2-1})], so a
forward pass gathers rows by position instead of calling sin/cos millions of
times. Long-context models (Llama 3.1+: `llama3`, or `linear`) rescale the
frequencies before the cache is built (`inverse_frequencies`), so the stage
and its kernel are unchanged.

The Triton kernel (`kernels/rope.py`) rotates q and k *in place*: one program
per tile of tokens (and block of heads) loads their q and k heads, gathers each
token's cos/sin row once, rotates all of the token's q and k heads with it in
fp32, and writes them back over the inputs, so q and k are each read once and
written once and nothing is allocated. It works directly on the strided views
`split_qkv` returns. Unlike the naive path, which returns new tensors,
`triton` modifies q and k and returns those same objects; callers use the
return value either way.

The torch tier (`stages/rope_torch.py`) rotates q and k as one tensor with
half-width angles: fewer PyTorch ops per layer, measured there.
"""

import math

import torch
from einops import rearrange

from stagewise.config import ModelConfig, RopeScaling
from stagewise.errors import StagewiseError
from stagewise.stages import rope_torch
from stagewise.stages.base import Stage


def inverse_frequencies(
    rotary_dim: int, theta: float, scaling: RopeScaling | None = None, device=None
) -> torch.Tensor:
    """-> [rotary_dim / 2] float32: each feature pair's angle per position, `theta^(-2i/d)`, scaled.

    Long-context models change only these numbers (the rotation itself stays the same):

    - linear: `inv_freq / factor` for every pair, as if positions were `factor` times closer.
    - llama3 (Llama 3.1+): a pair turns through one full circle every `wavelen = 2*pi / inv_freq`
      positions. Pairs whose wavelength is short compared with the pre-training context
      (`wavelen < original / high_freq_factor`) keep their frequency; pairs whose wavelength
      exceeds it (`wavelen > original / low_freq_factor`) are divided by `factor`; in between,
      `smooth = (original / wavelen - low) / (high - low)` blends the two:
      `inv_freq * ((1 - smooth) / factor + smooth)`.
    - freq_factors (llama.cpp's `rope_freqs.weight`): `inv_freq / freq_factors[i]`, the llama3
      result precomputed per pair by llama.cpp's converter.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)  # [rotary_dim / 2]
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32, device=device)
        if factors.shape != inv_freq.shape:
            raise StagewiseError(
                f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}"
            )
        return inv_freq / factors
    # llama3
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor  # longer than this: fully scaled
    high_wavelen = original / scaling.high_freq_factor  # shorter than this: untouched
    wavelen = 2 * math.pi / inv_freq  # [rotary_dim / 2] positions per full turn
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = inv_freq * ((1 - smooth) / scaling.factor + smooth)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    return torch.where(wavelen < high_wavelen, inv_freq, scaled)  # [rotary_dim / 2]


def build_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    theta: float,
    device=None,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """-> [max_position, rotary_dim] float32: cos in the first half of each row, sin in the second.

    `scaling` (a model's `config.rope_scaling`) changes the frequencies only; the kernels read
    the finished cache, so a scaled model needs no other change.
    """
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling, device)  # [rotary_dim / 2]
    t = torch.arange(max_position, dtype=torch.float32, device=device)  # [max_position]
    freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, rotary_dim]


def describe_rope(theta: float, scaling: RopeScaling | None) -> str:
    """One line for traces: "theta 500000, llama3 x32 (pre-trained 8192, low 1, high 4)"."""
    text = f"theta {theta:g}"
    if scaling is None:
        return text
    if scaling.kind == "llama3":
        return (
            f"{text}, llama3 x{scaling.factor:g} "
            f"(pre-trained {scaling.original_max_position_embeddings}, "
            f"low {scaling.low_freq_factor:g}, high {scaling.high_freq_factor:g})"
        )
    if scaling.kind == "linear":
        return f"{text}, linear x{scaling.factor:g}"
    factors = scaling.freq_factors
    return f"{text}, rope_freqs from the GGUF (divisors {min(factors):g}..{max(factors):g})"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] = [x1, x2] (halves) -> [-x2, x1]: each pair (i, i + d/2) turned by 90 degrees."""
    x1, x2 = x.chunk(2, dim=-1)  # [..., d/2] each
    return torch.cat([-x2, x1], dim=-1)  # [..., d]


def naive(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T], q [T, H, d], k [T, Hkv, d] -> new rotated (q, k); inputs are not modified.

    x_rotated = x * cos + rotate_half(x) * sin, in float32, with each token's angles read from
    its row of the cache: [x1*cos - x2*sin, x2*cos + x1*sin].
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, d] -> [T, d/2] each
    cos = torch.cat([cos, cos], dim=-1)  # [T, d]: pair (i, i + d/2) shares angle i
    sin = torch.cat([sin, sin], dim=-1)  # [T, d]
    cos = rearrange(cos, "t d -> t 1 d")  # [T, 1, d]: the same angles for every head
    sin = rearrange(sin, "t d -> t 1 d")  # [T, 1, d]
    qf, kf = q.float(), k.float()
    q_out = qf * cos + rotate_half(qf) * sin  # [T, H, d]
    k_out = kf * cos + rotate_half(kf) * sin  # [T, Hkv, d]
    return q_out.to(q.dtype), k_out.to(k.dtype)


def triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton kernel, in place: q and k are rotated where they are and returned (same objects)."""
    from stagewise.kernels.rope import rope  # lazily: importing kernels picks GPU or interpreter

    return rope(positions, q, k, cos_sin_cache)  # -> (q [T, H, d], k [T, Hkv, d]), in place


def example_inputs(config: ModelConfig, num_tokens: int, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    max_position = min(config.max_position_embeddings, 4096)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    q = torch.randn(num_tokens, config.num_heads, config.head_dim, generator=gen)
    k = torch.randn(num_tokens, config.num_kv_heads, config.head_dim, generator=gen)
    cache = build_cos_sin_cache(
        max_position, config.rotary_dim, config.rope_theta, scaling=config.rope_scaling
    )
    return {
        "positions": positions.to(device),
        "q": q.to(device, dtype),
        "k": k.to(device, dtype),
        "cos_sin_cache": cache.to(device),
    }


STAGE = Stage(
    name="rope",
    summary="rotate each (i, i + d/2) feature pair of q and k by a position-dependent angle",
    shapes="q [T, H, d], k [T, Hkv, d] -> same shapes",
    naive=naive,
    triton=triton,
    triton_kind="triton: in place on q and k, a tile of tokens per program",
    torch=rope_torch.rope,
    torch_kind="torch: q and k rotated as one tensor, half-width angles (fewer ops per layer)",
    example_inputs=example_inputs,
    outputs=("q_out", "k_out"),
    axes={
        "positions": "num_tokens",
        "q": "num_tokens heads head_dim",
        "k": "num_tokens kv_heads head_dim",
        "cos_sin_cache": "max_position rotary_dim",
        "q_out": "num_tokens heads head_dim",
        "k_out": "num_tokens kv_heads head_dim",
    },
)
