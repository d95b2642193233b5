"""Random Q4_0 GGUF files with real Llama shapes and SmolLM2's tokenizer, for benchmarks at scale.

    path = random_gguf("llama-3-8b")               # ~4.3 GB, written once into the cache folder
    path = random_gguf("llama-3.2-1b", layers=2)   # the same shapes, fewer layers (a quick run)

A decode step's time depends on the bytes and the shapes, not on the numbers, so a file of random
blocks measures an 8B model without downloading one. Every projection, the embedding table and
(untied models) the output head are Q4_0 blocks: a float16 scale d chosen so the weights have a
std near 1/sqrt(in), and 16 random bytes of codes per 32 weights; the norms are float32 ones.
The tokenizer is SmolLM2's (the shipped GGUF's vocabulary, merges and chat template, 49152
tokens), so llama.cpp loads the file too and both systems read the same prompt ids; the vocabulary
(and so the embedding and the head) is 49152 rows instead of Llama 3's 128256.

Files are written into <cache dir>/random_gguf/ (`tuning/gemm_forms_cache.cache_dir`) by the
benchmarks that need them, one tensor at a time (never the whole file in memory), and reused.
Never by the tests: they are gigabytes.
"""

from pathlib import Path

import gguf
import numpy as np

from stagewise.files import atomic_path
from stagewise.tuning.gemm_forms_cache import cache_dir

FOLDER = "random_gguf"
# name -> Llama shapes (the vocabulary is SmolLM2's tokenizer's, below)
SHAPES = {
    "llama-3.2-1b": dict(
        layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, head_dim=64, tied=True, rope_theta=500000.0
    ),
    "llama-3-8b": dict(
        layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, tied=False, rope_theta=500000.0
    ),
}
Q4_0 = gguf.GGMLQuantizationType.Q4_0
TOKENIZER_KEYS = "tokenizer."  # every key under it is copied from SmolLM2's file


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 18] uint8: per block d (float16, little-endian) then 16 bytes of codes."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
    d = np.full((rows, cols // 32), 1.0 / (4.6 * cols**0.5), dtype=np.float16)  # (q - 8): std ~4.6
    blocks[:, :, :2] = d[..., None].view(np.uint8).reshape(rows, cols // 32, 2)
    return blocks.reshape(rows, -1)


def _tokenizer_fields() -> tuple[list[tuple[str, object, list]], int]:
    """SmolLM2's tokenizer keys (name, value, types) and its vocabulary size."""
    from stagewise.models.files import smollm2_gguf_path

    reader = gguf.GGUFReader(smollm2_gguf_path())
    fields = [
        (name, field.contents(), field.types)
        for name, field in reader.fields.items()
        if name.startswith(TOKENIZER_KEYS)
    ]
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    return fields, vocab


def tensors(s: dict, layers: int, vocab: int) -> list[tuple[str, tuple[int, int] | int]]:
    """(name, [out, in] of a Q4_0 matrix, or the length of a float32 norm), in file order."""
    h, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    out: list = [("token_embd.weight", (vocab, h)), ("output_norm.weight", h)]
    if not s["tied"]:
        out.append(("output.weight", (vocab, h)))
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", h), (b + "attn_q.weight", (s["heads"] * s["head_dim"], h))]
        out += [(b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h))]
        out += [(b + "attn_output.weight", (h, s["heads"] * s["head_dim"])), (b + "ffn_norm.weight", h)]
        out += [(b + "ffn_gate.weight", (s["ffn"], h)), (b + "ffn_up.weight", (s["ffn"], h))]
        out += [(b + "ffn_down.weight", (h, s["ffn"]))]
    return out


def write(path: Path, shape: str, layers: int | None = None, context: int = 4096, seed: int = 0) -> Path:
    """Write the random file (atomically: a half-written file is never left under `path`)."""
    s = SHAPES[shape]
    layers = s["layers"] if layers is None else layers
    fields, vocab = _tokenizer_fields()
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(f"random {shape} ({layers} layers, Q4_0)")
        w.add_block_count(layers)
        w.add_context_length(context)
        w.add_embedding_length(s["hidden"])
        w.add_feed_forward_length(s["ffn"])
        w.add_head_count(s["heads"])
        w.add_head_count_kv(s["kv_heads"])
        w.add_rope_freq_base(s["rope_theta"])
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(s["head_dim"])
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
        w.add_vocab_size(vocab)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        for name, value, types in fields:
            if types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(name, value)
            else:
                w.add_key_value(name, value, types[0])
        write_tensors(w, tensors(s, layers, vocab), seed)
    return path


def write_tensors(w: "gguf.GGUFWriter", plan: list[tuple[str, tuple[int, int] | int]], seed: int) -> None:
    """After the metadata: the header, then every tensor of `plan` (a length: float32 ones, a norm;
    (rows, cols): random Q4_0 blocks), streamed one at a time; closes `w`."""
    for name, dims in plan:
        if isinstance(dims, int):
            w.add_tensor_info(name, (dims,), np.dtype(np.float32), dims * 4)
        else:
            rows, cols = dims
            w.add_tensor_info(name, (rows, cols // 32 * 18), np.dtype(np.uint8), rows * cols // 32 * 18, Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims in plan:
        w.write_tensor_data(np.ones(dims, np.float32) if isinstance(dims, int) else q4_0_blocks(rng, *dims))
    w.close()


def random_gguf(shape: str, layers: int | None = None, folder: Path | None = None) -> Path:
    """The random file for `shape` (and `layers`), written on first use into the cache folder."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape '{shape}'; known: {', '.join(SHAPES)}")
    tag = "" if layers is None else f"-{layers}layers"
    path = (folder or cache_dir() / FOLDER) / f"{shape}{tag}-q4_0-random.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, shape, layers)
    return path
