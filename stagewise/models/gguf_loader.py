"""Load a Llama-architecture GGUF file (llama.cpp's format) into `LlamaWeights`.

A GGUF file is a header of typed key/value metadata (architecture, sizes,
the tokenizer) followed by tensors, possibly quantized. We read it with the
`gguf` package, dequantize every tensor to float32 with `gguf.quants` (Q4_1 and
Q8_0 for the default model; about a second), and rearrange:

- GGUF stores a weight as [out, in] rows, like `torch.nn.Linear`; we view it
  as [in, out] (a transpose, no copy) and concatenate Q|K|V and gate|up; the
  memory layout per device is chosen in `weights.py`.
- llama.cpp's converter permutes the rows of W_q and W_k so that its RoPE can
  rotate interleaved pairs (2i, 2i+1). We undo that permutation here, head by
  head, and keep Hugging Face's rotate-half RoPE (pairs (i, i + d/2)).
- Llama 3.1+ RoPE scaling arrives as a tensor of per-frequency divisors,
  `rope_freqs.weight`; it becomes `config.rope_scaling` (`rope_scaling_from_gguf`).
"""

from pathlib import Path

import numpy as np
import torch

from stagewise.config import ModelConfig, RopeScaling
from stagewise.errors import StagewiseError
from stagewise.models.weights import LayerWeights, LlamaWeights


def open_gguf(path: str | Path):
    """Open a GGUF file with clear errors for a missing, truncated or corrupt file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise StagewiseError(f"model file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StagewiseError(f"{path} is not a valid GGUF file (truncated or corrupt?): {reason}") from None


def field(reader, key: str, default=None):
    """The value of one metadata key, or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise StagewiseError(f"{name}: architecture '{arch}' is not supported; stagewise runs Llama models")

    def need(key: str):
        value = field(reader, f"llama.{key}")
        if value is None:
            raise StagewiseError(f"{name}: GGUF metadata lacks llama.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    return ModelConfig(
        name=name,
        vocab_size=int(field(reader, "llama.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(field(reader, "llama.attention.key_length", hidden // heads)),
        rope_theta=float(field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(field(reader, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=rope_scaling_from_gguf(reader, name),
    )


def rope_scaling_from_gguf(reader, name: str) -> RopeScaling | None:
    """llama.cpp's two spellings of RoPE scaling -> RopeScaling or None.

    Llama 3.1+ (llama3 scaling): the converter computes one divisor per frequency pair from
    config.json's four numbers and stores them as the float32 tensor `rope_freqs.weight`
    [head_dim / 2]. Linear scaling: the keys `llama.rope.scaling.type = "linear"` and
    `llama.rope.scaling.factor` (older files: `llama.rope.scale_linear`).
    """
    from gguf.quants import dequantize

    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1)
        return RopeScaling(kind="freq_factors", freq_factors=tuple(float(f) for f in factors))
    kind = field(reader, "llama.rope.scaling.type", "none")
    factor = field(reader, "llama.rope.scaling.factor") or field(reader, "llama.rope.scale_linear")
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return RopeScaling(kind="linear", factor=float(factor))
    if kind == "none":
        return None
    raise StagewiseError(f"{name}: RoPE scaling '{kind}' is not supported; known: none, linear, rope_freqs (llama3)")


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [out, in] with interleaved pairs -> rotate-half order.

    Per head, llama.cpp reorders rows [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] into
    [x_0, y_0, x_1, y_1, ...]; reshaping to (heads, d/2, 2) and swapping the
    last two axes puts them back.
    """
    out_features, in_features = w.shape
    head_dim = out_features // num_heads
    w = w.reshape(num_heads, head_dim // 2, 2, in_features)
    return w.swapaxes(1, 2).reshape(out_features, in_features)


def load_gguf(path: str | Path, reader=None) -> tuple[ModelConfig, LlamaWeights]:
    """GGUF file -> (config, float32 weights on CPU); pass `reader` to reuse an open file."""
    from gguf.quants import dequantize

    path = Path(path)
    reader = reader if reader is not None else open_gguf(path)
    config = config_from_gguf(reader, str(path))
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise StagewiseError(f"{path}: tensor '{name}' is missing")
        t = tensors[name]
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise StagewiseError(f"{path}: cannot read tensor '{name}' ({type(exc).__name__}: {exc})") from None
        if tuple(array.shape) != shape:
            raise StagewiseError(f"{path}: tensor '{name}' has shape {tuple(array.shape)}, expected {shape}")
        return np.array(array, dtype=np.float32, order="C", copy=True)  # writable, owned

    def linear(name: str, out_f: int, in_f: int) -> np.ndarray:
        return get(name, (out_f, in_f))  # [out, in] as stored

    hidden, inter = config.hidden_size, config.intermediate_size
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        wq = unpermute_rows(linear(p + "attn_q.weight", config.q_size, hidden), config.num_heads)
        wk = unpermute_rows(linear(p + "attn_k.weight", config.kv_size, hidden), config.num_kv_heads)
        wv = linear(p + "attn_v.weight", config.kv_size, hidden)
        w_qkv = np.concatenate([wq, wk, wv], axis=0).T  # [(H+2Hkv)*d, hidden] -> [hidden, (H+2Hkv)*d]
        gate = linear(p + "ffn_gate.weight", inter, hidden)
        up = linear(p + "ffn_up.weight", inter, hidden)
        layers.append(
            LayerWeights(
                attn_norm=torch.from_numpy(get(p + "attn_norm.weight", (hidden,))),
                w_qkv=torch.from_numpy(w_qkv),  # transposed views; LlamaWeights.to picks the layout
                w_o=torch.from_numpy(linear(p + "attn_output.weight", hidden, config.q_size).T),
                ffn_norm=torch.from_numpy(get(p + "ffn_norm.weight", (hidden,))),
                w_gate_up=torch.from_numpy(np.concatenate([gate, up], axis=0).T),
                w_down=torch.from_numpy(linear(p + "ffn_down.weight", hidden, inter).T),
            )
        )
    embed = torch.from_numpy(get("token_embd.weight", (config.vocab_size, hidden)))  # [vocab, hidden]
    head = embed if config.tie_word_embeddings else torch.from_numpy(get("output.weight", (config.vocab_size, hidden)))
    lm_head = head.t()  # [vocab, hidden] -> [hidden, vocab] view (tied: the table itself)
    final_norm = torch.from_numpy(get("output_norm.weight", (hidden,)))
    return config, LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
