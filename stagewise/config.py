"""Model and engine configuration.

`ModelConfig` names every dimension the stages use; the shape annotations in
the code use the same names (T = num_tokens, H = num_heads, Hkv = num_kv_heads,
d = head_dim). Presets cover the default model, a tiny random model for tests,
and shape-only Llama 3 / 3.1 / 3.2 models that run on the `meta` device.
"""

import math
import numbers
from dataclasses import dataclass, replace

from stagewise.errors import StagewiseError

ROPE_SCALING_KINDS = ("linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    """How a long-context model stretches RoPE's angles (`stages/rope.py` shows the formulas).

    - "linear": every inverse frequency divided by `factor` (positions squeezed by `factor`).
    - "llama3" (Llama 3.1 / 3.2 / 3.3): high frequencies kept, low frequencies divided by
      `factor`, a smooth blend in between, set by the wavelength compared with the
      pre-training context `original_max_position_embeddings`.
    - "freq_factors": one divisor per frequency, as llama.cpp stores llama3 scaling in a
      GGUF (`rope_freqs.weight`, computed by its converter from the four numbers above).
    """

    kind: str  # one of ROPE_SCALING_KINDS
    factor: float = 1.0  # linear and llama3: how much longer the context became
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor get the full factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor stay unscaled
    original_max_position_embeddings: int = 8192  # llama3: the context length of pre-training
    freq_factors: tuple[float, ...] = ()  # freq_factors: divisor of each of the rotary_dim / 2 frequencies

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise StagewiseError(f"RoPE scaling '{self.kind}' is not supported; known: {', '.join(ROPE_SCALING_KINDS)}")
        if self.kind == "freq_factors" and not self.freq_factors:
            raise StagewiseError("RoPE scaling 'freq_factors' needs one factor per frequency")
        factors = {
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
        }
        factors.update({f"freq_factors[{i}]": f for i, f in enumerate(self.freq_factors)})
        for name, value in factors.items():
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise StagewiseError(f"RoPE scaling '{self.kind}': {name} must be a finite number > 0, got {value!r}")
        original = self.original_max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise StagewiseError(
                f"RoPE scaling: original_max_position_embeddings must be an int >= 1, got {original!r}"
            )
        if self.kind == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise StagewiseError("llama3 RoPE scaling needs low_freq_factor < high_freq_factor")


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy's floats too


# Llama 3.1 / 3.2 / 3.3's `rope_scaling` in config.json (all sizes use the same numbers).
LLAMA31_ROPE_SCALING = RopeScaling(
    kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
LLAMA32_ROPE_SCALING = replace(LLAMA31_ROPE_SCALING, factor=32.0)  # Llama 3.2 1B and 3B


@dataclass(frozen=True)
class ModelConfig:
    name: str  # preset name or the path the model came from
    vocab_size: int  # rows of the embedding table and of the LM head
    hidden_size: int  # width of the residual stream ("hidden")
    intermediate_size: int  # width of the FFN between gate/up and down ("inter")
    num_layers: int  # transformer blocks
    num_heads: int  # query heads (H)
    num_kv_heads: int  # key/value heads (Hkv); H % Hkv == 0, GQA group = H // Hkv
    head_dim: int  # per-head width (d)
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-5  # epsilon inside RMSNorm's rsqrt
    max_position_embeddings: int = 2048  # rows of cos_sin_cache; the longest sequence
    tie_word_embeddings: bool = True  # LM head reuses the embedding matrix
    rope_scaling: RopeScaling | None = None  # long-context RoPE scaling (Llama 3.1+); None = plain RoPE
    shape_only: bool = False  # True for presets that only exist on the meta device

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StagewiseError(f"{self.name}: {name} must be an int >= 1, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or not value > 0:
                raise StagewiseError(f"{self.name}: {name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))  # frozen: a JSON int becomes the float it means
        if self.max_position_embeddings > MAX_POSITIONS:
            raise StagewiseError(
                f"{self.name}: max_position_embeddings must be at most {MAX_POSITIONS:,} (2**24: float32 positions"
                f" are exact up to there), got {self.max_position_embeddings:,}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise StagewiseError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim  # H * d

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim  # Hkv * d

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size  # (H + 2*Hkv) * d

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads  # query heads per KV head

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # Llama rotates the whole head

    def num_parameters(self) -> int:
        """Exact parameter count (tied LM head counted once)."""
        per_layer = (
            2 * self.hidden_size  # two RMSNorm weights
            + self.hidden_size * self.qkv_size  # fused QKV
            + self.q_size * self.hidden_size  # output projection
            + self.hidden_size * 2 * self.intermediate_size  # fused gate/up
            + self.intermediate_size * self.hidden_size  # down
        )
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + self.num_layers * per_layer + self.hidden_size + head


MAX_POSITIONS = 2**24  # the cos/sin cache computes angles from float32 positions, exact integers up to 2**24

SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)


def hf_rope_dict(raw: dict, where: str) -> dict:
    """config.json's RoPE settings as transformers reads them: `rope_scaling` (the older name) if set, else
    `rope_parameters` (transformers >= 5); {} for neither. A `rope_theta` inside it beats the top-level one."""
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.get(key)
        if params:
            if not isinstance(params, dict):
                raise StagewiseError(f"{where}: {key} must be a JSON object, got {params!r}")
            return params
    return {}


def config_from_hf_dict(
    raw, name: str, where: str, shape_only: bool = False, rope_scaling: RopeScaling | None = None
) -> ModelConfig:
    """The sizes of a Hugging Face Llama `config.json` (already parsed), each checked.

    `where` names the file in errors: a missing key, a non-object, zero heads all
    become one-line `StagewiseError`s instead of a KeyError or a ZeroDivisionError.
    """
    if not isinstance(raw, dict):
        raise StagewiseError(f"{where} must hold a JSON object, got {type(raw).__name__}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in raw]
    if missing:
        raise StagewiseError(f"{where} lacks the size field {', '.join(missing)}; is it a Hugging Face config.json?")
    heads = raw["num_attention_heads"]
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise StagewiseError(f"{where}: num_attention_heads must be an int >= 1, got {heads!r}")
    rope_params = hf_rope_dict(raw, where)
    hidden = raw["hidden_size"]
    head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) else hidden)
    return ModelConfig(
        name=name,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads if raw.get("num_key_value_heads") is None else raw["num_key_value_heads"],
        head_dim=head_dim,
        rope_theta=rope_params.get("rope_theta", raw.get("rope_theta", 10000.0)),  # the RoPE dict's own first
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),  # transformers' LlamaConfig default
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        shape_only=shape_only,
        rope_scaling=rope_scaling,
    )


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        name="smollm2-135m",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Same architecture (GQA 3:1, tied embeddings), random seeded weights, tiny sizes.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=96,
        intermediate_size=256,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
}

# Shape-only presets (meta device): the seeds' Llama 3 numbers. Every one has the 128256-token
# vocabulary, 8 KV heads and rope_theta 500000; per model:
#   hidden, inter, layers, heads (H), head_dim, max positions, tied embeddings, RoPE scaling
LLAMA3_SHAPES = {
    "llama-3-8b": (4096, 14336, 32, 32, 128, 8192, False, None),
    "llama-3-70b": (8192, 28672, 80, 64, 128, 8192, False, None),
    # Llama 3.1 405B (the seeds' model): 128k context through llama3 RoPE scaling
    "llama-3-405b": (16384, 53248, 126, 128, 128, 131072, False, LLAMA31_ROPE_SCALING),
    # Llama 3.2 1B and 3B (meta-llama/Llama-3.2-1B, -3B config.json): tied, factor-32 llama3 RoPE
    "llama-3.2-1b": (2048, 8192, 16, 32, 64, 131072, True, LLAMA32_ROPE_SCALING),
    "llama-3.2-3b": (3072, 8192, 28, 24, 128, 131072, True, LLAMA32_ROPE_SCALING),
}


def llama3_shape(name: str) -> ModelConfig:
    """The shape-only ModelConfig of a row of LLAMA3_SHAPES."""
    hidden, inter, layers, heads, head_dim, max_positions, tied, scaling = LLAMA3_SHAPES[name]
    return ModelConfig(
        name=name,
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=head_dim,
        rope_theta=500000.0,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        rope_scaling=scaling,
        shape_only=True,
    )


PRESETS.update({name: llama3_shape(name) for name in LLAMA3_SHAPES})

DEFAULT_MODEL = "smollm2-135m"


def get_preset(name: str) -> ModelConfig:
    """Look up a preset by name, with a one-line error listing the valid names."""
    if name not in PRESETS:
        raise StagewiseError(f"unknown model '{name}'; choose one of {', '.join(PRESETS)} or a path")
    return PRESETS[name]


# On a CPU a prompt token costs ~1/80 of a decode step of 8 requests: 64 keep TBT p99 near 2x p50 (measured in
# benchmarks/README.md: 512 gave 6.4x, with no more throughput)
CPU_PREFILL_BESIDE_DECODES = 64
# With the compiled CPU kernels (stagewise/cpu/) a decode step of 8 requests takes a third of the time and a 64-token
# chunk beside it made TBT p99 3.8x p50; 32 gave 2.4x at the same throughput (benchmarks/README.md, #42)
CPU_PREFILL_BESIDE_DECODES_COMPILED = 32

PREFIX_CACHES = ("hash", "radix", "none")  # the prefix caches an engine can run (kv/prefix_cache.py)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16  # most requests running at once
    max_num_batched_tokens: int = 512  # token budget of one engine step
    # Prompt tokens a step may take while some request is decoding (chunked prefill beside decodes; the
    # scheduler's docstring). None: the device's default, CPU_PREFILL_BESIDE_DECODES on a CPU (measured:
    # benchmarks/README.md) and no cap beyond max_num_batched_tokens on a GPU.
    prefill_beside_decodes: int | None = None
    max_model_len: int | None = None  # longest prompt + output; None = the model's limit
    block_size: int = 16  # tokens per KV block (paged mode)
    num_kv_blocks: int | None = None  # KV cache size in blocks; overrides both budgets below
    kv_cache_bytes: int | None = None  # KV memory budget in bytes; None = kv_cache_fraction
    kv_cache_fraction: float = 0.25  # share of free memory for KV when no byte budget is given
    enable_prefix_caching: bool = True  # reuse K/V of prefixes computed before (False: prefix_cache "none")
    # The prefix cache's design (kv/prefix_cache.py): "hash" (vLLM's: full blocks named by a chained
    # digest), "radix" (SGLang's: a radix tree of token runs, matches end at any token) or "none"
    prefix_cache: str = "hash"
    # Replay pure-decode steps of up to max_num_seqs requests from captured CUDA graphs (paged mode):
    # one launch per step instead of hundreds (engine/cuda_graphs.py). On a CPU nothing is captured
    # and the same padded static-buffer path runs eagerly.
    cuda_graphs: bool = False
    # With cuda_graphs, read a greedy decode step's sampled ids one step late: the next step is queued
    # first, its input ids taken on the device from this step's output (engine/graph_runner.py).
    defer_graph_reads: bool = True

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
        }
        for opt in ("max_model_len", "num_kv_blocks", "kv_cache_bytes", "prefill_beside_decodes"):
            if getattr(self, opt) is not None:
                positive[opt] = getattr(self, opt)
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StagewiseError(f"{name} must be an int >= 1, got {value!r}")
        fraction = self.kv_cache_fraction
        if not isinstance(fraction, int | float) or isinstance(fraction, bool) or not 0.0 < fraction <= 1.0:
            raise StagewiseError(f"kv_cache_fraction must be a number in (0, 1], got {fraction!r}")
        for flag in ("enable_prefix_caching", "cuda_graphs", "defer_graph_reads"):
            if not isinstance(getattr(self, flag), bool):
                raise StagewiseError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.prefix_cache not in PREFIX_CACHES:
            raise StagewiseError(f"unknown prefix_cache {self.prefix_cache!r}; use one of {', '.join(PREFIX_CACHES)}")

    @property
    def prefix_cache_kind(self) -> str:
        """The prefix cache an engine built from this config runs: "none" when caching is off."""
        return self.prefix_cache if self.enable_prefix_caching else "none"

    def prefill_cap(self, device_type: str, compiled_cpu_kernels: bool = False) -> int | None:
        """Prompt tokens per step beside decodes on this device (None: only max_num_batched_tokens);
        `compiled_cpu_kernels`: the CPU runs stagewise/cpu/'s kernels (STAGEWISE_CPU_KERNELS=1)."""
        if self.prefill_beside_decodes is not None:
            return self.prefill_beside_decodes
        if device_type != "cpu":
            return None
        return CPU_PREFILL_BESIDE_DECODES_COMPILED if compiled_cpu_kernels else CPU_PREFILL_BESIDE_DECODES

    def with_updates(self, **kwargs) -> "EngineConfig":
        return replace(self, **kwargs)


TP_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """How a model is split across ranks (tensor parallelism, `stagewise/parallel/`)."""

    tensor_parallel_size: int = 1  # ranks that each hold 1/N of every matrix; 1 = one process, no collectives
    backend: str | None = None  # torch.distributed backend: gloo (CPU) or nccl (CUDA); None = by device
    timeout_s: float = 60.0  # a collective that waits longer than this fails: a dead or stuck rank ends the run
    start_timeout_s: float = 120.0  # the most time the worker processes may take to start and load their shards

    def __post_init__(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise StagewiseError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if self.backend is not None and self.backend not in TP_BACKENDS:
            raise StagewiseError(
                f"unknown tensor-parallel backend {self.backend!r}; use one of {', '.join(TP_BACKENDS)}"
            )
        for name in ("timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise StagewiseError(f"{name} must be a number of seconds > 0, got {value!r}")
