"""Load a Llama-architecture GGUF file (llama.cpp's format) into `LlamaWeights`.

A GGUF file is a header of typed key/value metadata (architecture, sizes,
the tokenizer) followed by tensors, possibly quantized. We read it with the
`gguf` package, dequantize each tensor to float32 with `gguf.quants` (Q4_1 and
Q8_0 for the default model; about a second), rearrange it, and cast it to the
target dtype before reading the next one:

- GGUF stores a weight as [out, in] rows, like `torch.nn.Linear`; we view it
  as [in, out] (a transpose, no copy) and concatenate Q|K|V and gate|up; the
  memory layout per device is chosen in `weights.py`. Packed parts of different kinds
  (a Q4_K_M file's Q4_K W_q, W_k beside a Q6_K W_v) stay packed side by side
  (`quant/packed_parts.py`).
- llama.cpp's converter permutes the rows of W_q and W_k so that its RoPE can
  rotate interleaved pairs (2i, 2i+1). We undo that permutation here, head by
  head, and keep Hugging Face's rotate-half RoPE (pairs (i, i + d/2)).
- Llama 3.1+ RoPE scaling arrives as a tensor of per-frequency divisors,
  `rope_freqs.weight`; it becomes `config.rope_scaling` (`rope_scaling_from_gguf`).
"""

import sys
from pathlib import Path

import numpy as np
import torch

from stagewise.config import ModelConfig, RopeScaling, is_number
from stagewise.errors import StagewiseError
from stagewise.models.files import unused_tensors
from stagewise.models.quantized import check_quantization, kept_kind, notice_dequantized
from stagewise.models.weights import LayerWeights, LlamaWeights
from stagewise.quant.dequantize import dequantize_rows
from stagewise.quant.gguf_blocks import packed_from_blocks
from stagewise.quant.packed_parts import PackedParts
from stagewise.quant.packed_weight import PackedWeight, cat_out_features, is_packed


def open_gguf(path: str | Path):
    """Open a GGUF file with clear errors for a missing, truncated or corrupt file.

    The metadata (with the tokenizer's ~100 000 strings) is parsed by `gguf_metadata.py` in well
    under a second; the tensors are memory-mapped by the `gguf` package and read when used.
    """
    from stagewise.models.gguf_metadata import GGUFMetadataReader

    path = Path(path)
    if not path.is_file():
        raise StagewiseError(f"model file not found: {path}")
    try:
        return GGUFMetadataReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors, ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StagewiseError(
            f"{path} is not a valid GGUF file (truncated or corrupt?): {reason}"
        ) from None


def field(reader, key: str, default=None):
    """The value of one metadata key, or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise StagewiseError(
            f"{name}: architecture '{arch}' is not supported; stagewise runs Llama models"
        )

    def value(key: str, default, kind: type):
        """llama.<key> as an int or a float; a missing required key or a wrong type: one line."""
        raw = field(reader, f"llama.{key}", default)
        if raw is None:
            raise StagewiseError(f"{name}: GGUF metadata lacks llama.{key}")
        if not is_number(raw) or (kind is int and raw != int(raw)):
            raise StagewiseError(
                f"{name}: GGUF metadata llama.{key} must be {kind.__name__}, got {raw!r}"
            )
        return kind(raw)

    hidden, heads = value("embedding_length", None, int), value("attention.head_count", None, int)
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, "llama.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise StagewiseError(
            f"{name}: GGUF metadata lacks both llama.vocab_size and tokenizer.ggml.tokens"
        )
    names = {t.name for t in reader.tensors}
    experts = field(reader, "llama.expert_count", 0)
    if is_number(experts) and experts > 0:  # Mixtral-style files use the llama architecture name
        raise StagewiseError(
            f"{name}: a mixture of {experts} experts (llama.expert_count); "
            "stagewise runs dense Llama"
        )
    return ModelConfig(
        name=name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=value("feed_forward_length", None, int),
        num_layers=value("block_count", None, int),
        num_heads=heads,
        num_kv_heads=value("attention.head_count_kv", heads, int),
        head_dim=value("attention.key_length", hidden // heads if heads > 0 else 0, int),
        rope_theta=value("rope.freq_base", 10000.0, float),
        rms_norm_eps=value("attention.layer_norm_rms_epsilon", 1e-5, float),
        max_position_embeddings=value("context_length", 2048, int),
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
        factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(
            -1
        )
        return RopeScaling(kind="freq_factors", freq_factors=tuple(float(f) for f in factors))
    kind = field(reader, "llama.rope.scaling.type", "none")
    factor = field(reader, "llama.rope.scaling.factor") or field(reader, "llama.rope.scale_linear")
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        if not is_number(factor):
            raise StagewiseError(
                f"{name}: linear RoPE scaling needs a numeric factor, got {factor!r}"
            )
        return RopeScaling(kind="linear", factor=float(factor))
    if kind == "none":
        return None
    raise StagewiseError(
        f"{name}: RoPE scaling '{kind}' is not supported; known: none, linear, rope_freqs (llama3)"
    )


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


def load_gguf(
    path: str | Path, reader=None, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> tuple[ModelConfig, LlamaWeights]:
    """GGUF file -> (config, weights in `dtype` on CPU); pass `reader` to reuse an open file.

    quantization "auto": Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K matrices stay packed
    (`models/quantized.py`), their values as in the file ("int8" / "int4" are refused: they
    quantize float checkpoints, not an already quantized file); "none" (this function's default;
    `load_model` and `LLM` default to "auto"): every tensor is dequantized. One tensor at a
    time: dequantize to float32, rearrange, cast to `dtype`, drop the float32 copy; a 7B model
    loads in bfloat16 with 14 GB of weights, never 28 GB of float32 at once.
    """
    from gguf.quants import dequantize

    path = Path(path)
    quantization = check_quantization(quantization)
    if quantization.startswith("int"):  # int8 / int4 quantize floats; a GGUF brings its own types
        raise StagewiseError(
            f"{path}: quantization '{quantization}' quantizes a float checkpoint (a Hugging Face "
            "directory); a GGUF keeps its own types with 'auto', or loads as floats with 'none'"
        )
    reader = reader if reader is not None else open_gguf(path)
    config = config_from_gguf(reader, str(path))
    tensors = {t.name: t for t in reader.tensors}
    used = {"rope_freqs.weight"}  # read by rope_scaling_from_gguf
    dequantized_types: set[str] = set()
    mixed: set[str] = set()  # fused weights with packed and float parts (dequantized)

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        used.add(name)
        if name not in tensors:
            raise StagewiseError(f"{path}: tensor '{name}' is missing")
        t = tensors[name]
        dequantized_types.add(t.tensor_type.name)
        try:
            with np.errstate(all="ignore"):  # a corrupt block's inf * 0: refused below, in one line
                array = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise StagewiseError(
                f"{path}: cannot read tensor '{name}' ({type(exc).__name__}: {exc})"
            ) from None
        if tuple(array.shape) != shape:
            raise StagewiseError(
                f"{path}: tensor '{name}' has shape {tuple(array.shape)}, expected {shape}"
            )
        # float32, possibly a read-only view of the file
        array = np.asarray(array, dtype=np.float32)
        # a corrupt file would otherwise generate garbage without a word
        if not np.isfinite(array).all():
            raise StagewiseError(f"{path}: tensor '{name}' holds NaN or infinite values")
        return array

    def cast(array: np.ndarray) -> torch.Tensor:
        # an owned copy (the array may be a read-only view of the file)
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True)).to(dtype)

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return cast(read(name, shape))

    def linear(name: str, out_f: int, in_f: int, heads: int | None = None):
        """[out, in] float rows as stored, or a PackedWeight [in, out] when its type is kept."""
        t = tensors.get(name)
        kind = None if t is None else kept_kind(t.tensor_type.name, quantization)
        if kind is not None:  # kept packed: the file's blocks, moved apart, no value changed
            used.add(name)
            stored = tuple(int(n) for n in reversed(t.shape))  # GGUF lists [in, out]
            if stored != (out_f, in_f):
                raise StagewiseError(
                    f"{path}: tensor '{name}' has shape {stored}, expected {(out_f, in_f)}"
                )
            w = packed_from_blocks(t.data, t.tensor_type.name, (out_f, in_f), f"{path}: {name}")
            if heads:  # the same row permutation, applied to whole rows of codes and scales
                order = unpermute_rows(np.arange(out_f)[:, None], heads)[:, 0]
                w = w.out_features(torch.from_numpy(order))
            return w
        w = read(name, (out_f, in_f))  # [out, in] as stored
        return cast(unpermute_rows(w, heads) if heads else w)

    def fused(parts: list) -> "torch.Tensor | PackedWeight":
        """[out_i, in] rows (or packed [in, out_i]) -> one [in, sum out_i] weight (a view)."""
        if all(is_packed(p) for p in parts):
            if len({p.kind for p in parts}) == 1:
                return cat_out_features(parts)  # W_q | W_k | W_v stay packed as one weight
            return PackedParts(parts)  # e.g. Q4_K_M's q4_k W_q | W_k beside a q6_k W_v
        if any(is_packed(p) for p in parts):  # packed beside float parts (e.g. an F16 W_v)
            mixed.add(" + ".join(p.kind if is_packed(p) else "float" for p in parts))
        rows = [dequantize_rows(p).to(dtype) if is_packed(p) else p for p in parts]
        return torch.cat(rows).t()  # [sum out_i, in] -> [in, sum out_i] view

    def single(w) -> "torch.Tensor | PackedWeight":
        return w if is_packed(w) else w.t()  # [out, in] -> [in, out] view

    hidden, inter = config.hidden_size, config.intermediate_size
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        wq = linear(p + "attn_q.weight", config.q_size, hidden, heads=config.num_heads)
        wk = linear(p + "attn_k.weight", config.kv_size, hidden, heads=config.num_kv_heads)
        wv = linear(p + "attn_v.weight", config.kv_size, hidden)
        gate, up = (
            linear(p + "ffn_gate.weight", inter, hidden),
            linear(p + "ffn_up.weight", inter, hidden),
        )
        layers.append(
            LayerWeights(
                attn_norm=get(p + "attn_norm.weight", (hidden,)),
                w_qkv=fused([wq, wk, wv]),  # [hidden, (H+2Hkv)*d]
                w_o=single(linear(p + "attn_output.weight", hidden, config.q_size)),  # views;
                ffn_norm=get(p + "ffn_norm.weight", (hidden,)),  # LlamaWeights.to picks the
                w_gate_up=fused([gate, up]),  # [hidden, 2*inter]      layout per device
                w_down=single(linear(p + "ffn_down.weight", hidden, inter)),  # [inter, hidden]
            )
        )
        del wq, wk, wv, gate, up
    # [vocab, hidden] rows (a packed table: PackedWeight [hidden, vocab], read by rows)
    embed = linear("token_embd.weight", config.vocab_size, hidden)
    head = (
        embed if config.tie_word_embeddings else linear("output.weight", config.vocab_size, hidden)
    )
    lm_head = single(head)  # [vocab, hidden] -> [hidden, vocab] view (tied: the table itself)
    notice_dequantized(dequantized_types, path, quantization)
    if mixed:
        print(
            f"stagewise: {path}: fused projections of packed and float parts "
            f"({'; '.join(sorted(mixed))}) are dequantized at load",
            file=sys.stderr,
        )
    final_norm = get("output_norm.weight", (hidden,))
    # e.g. attn_q.bias: llama.cpp runs it, stagewise would drop it; attn_rot_embd (RoPE's inv_freq
    # in some old conversions) is derived from the metadata, so skipped
    shown = unused_tensors(set(tensors) - used, derived=("attn_rot_embd",))
    if shown:
        raise StagewiseError(
            f"{path}: the file holds tensors a Llama of this metadata does not use: {shown}"
        )
    return config, LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
