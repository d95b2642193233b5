"""What a model costs, counted: parameters, FLOPs, KV-cache bytes.

Two kinds of formulas live here, side by side:

- exact counts from a `ModelConfig` (the real architecture: GQA, SwiGLU,
  untied LM head, causal attention), and
- the seeds' back-of-envelope shortcuts (chapters 5-8), which take plain
  numbers: `2 * L * 11 * N * d^2` for the linear layers, `4 * L * N^2 * d` for
  attention, `2 * N * P` for a prefill, `2 * L * d * 2 bytes` of KV per token.

Symbols (as in config.py): L layers, hidden (the seeds call it d), inter
(FFN width), H query heads, Hkv KV heads, d head_dim, V vocab, T tokens in the
step, N context length. A multiply-add is 2 FLOPs; softmax, norms, RoPE and
activations are a rounding error next to the matmuls and are not counted.

Every function returns a `Quantity`: the value, its unit and the formula with
the numbers plugged in (what `stagewise calc --explain` prints).
"""

from dataclasses import dataclass

from stagewise.config import ModelConfig


@dataclass(frozen=True)
class Quantity:
    value: float  # the number, in `unit`
    unit: str  # "params", "FLOP", "B", "s", "FLOP/B", "FLOP/s", "tokens/s", "sequences"
    formula: str  # how it was computed: symbols, then the numbers plugged in

    def as_dict(self) -> dict:
        return {"value": self.value, "unit": self.unit, "formula": self.formula}


def num(x: float) -> str:
    """1234567 -> '1,234,567'; 0.000123 -> '0.000123'; 1.5e17 -> '1.5e+17' (for formula strings)."""
    if float(x).is_integer() and abs(x) < 1e16:
        return f"{int(x):,}"
    return f"{x:.4g}"


# ---------------------------------------------------------------- parameters and weights


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights one transformer block multiplies by: QKV, O, gate/up, down (norm weights excluded)."""
    qkv = cfg.hidden_size * cfg.qkv_size  # [hidden, (H + 2*Hkv) * d]
    o = cfg.q_size * cfg.hidden_size  # [H * d, hidden]
    gate_up = cfg.hidden_size * 2 * cfg.intermediate_size  # [hidden, 2 * inter]
    down = cfg.intermediate_size * cfg.hidden_size  # [inter, hidden]
    return qkv + o + gate_up + down


def parameters(cfg: ModelConfig) -> Quantity:
    """Exact parameter count (a tied LM head counted once), as stored on disk."""
    head = "" if cfg.tie_word_embeddings else " + V*hidden (LM head)"
    formula = (
        f"V*hidden (embedding){head} + L*(hidden*(H+2Hkv)*d + H*d*hidden + 3*hidden*inter + 2*hidden) + hidden"
        f" = {num(cfg.num_parameters())}"
    )
    return Quantity(cfg.num_parameters(), "params", formula)


def matmul_parameters(cfg: ModelConfig) -> Quantity:
    """Weights a token is multiplied by: every block's matmuls plus the LM head (the embedding is a gather)."""
    value = cfg.num_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    formula = f"L*(hidden*(H+2Hkv)*d + H*d*hidden + 3*hidden*inter) + V*hidden = {num(value)}"
    return Quantity(value, "params", formula)


def linear_coefficient(cfg: ModelConfig) -> Quantity:
    """Per-block matmul weights in units of hidden^2: the number the seeds round to 11."""
    value = layer_matmul_params(cfg) / cfg.hidden_size**2
    q, kv = cfg.q_size / cfg.hidden_size, 2 * cfg.kv_size / cfg.hidden_size
    ffn = 3 * cfg.intermediate_size / cfg.hidden_size
    formula = f"(Q {q:.4g} + KV {kv:.4g} + O {q:.4g} + FFN 3*inter/hidden {ffn:.4g}) = {value:.6g}"
    return Quantity(value, "x hidden^2", formula)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> Quantity:
    """Bytes the weights occupy in memory."""
    value = cfg.num_parameters() * dtype_bytes
    return Quantity(value, "B", f"params * bytes = {num(cfg.num_parameters())} * {dtype_bytes} = {num(value)}")


def weight_bytes_streamed(cfg: ModelConfig, dtype_bytes: int, num_tokens: int) -> Quantity:
    """Weight bytes one forward pass over `num_tokens` tokens reads from memory.

    Every matmul weight and norm weight is read once (shared by all tokens of
    the step); of an untied embedding table only the rows of the step's tokens
    are gathered (at most V).
    """
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    rows = 0 if cfg.tie_word_embeddings else min(num_tokens, cfg.vocab_size) * cfg.hidden_size
    params = matmul_parameters(cfg).value + norms + rows
    value = params * dtype_bytes
    gathered = "" if cfg.tie_word_embeddings else f" + min(T, V)*hidden (gathered rows, T={num(num_tokens)})"
    formula = f"(matmul weights + (2L+1)*hidden norms{gathered}) * bytes = {num(params)} * {dtype_bytes} = {num(value)}"
    return Quantity(value, "B", formula)


# ---------------------------------------------------------------- FLOPs


def linear_flops(cfg: ModelConfig, num_tokens: int, logits_tokens: int = 1) -> Quantity:
    """Matmul FLOPs of the blocks for `num_tokens` tokens, plus the LM head for `logits_tokens` of them.

    Only the last token of a sequence needs logits (vLLM and stagewise gather
    it before the LM head), so a prefill of N tokens pays the head once.
    """
    blocks = 2 * num_tokens * cfg.num_layers * layer_matmul_params(cfg)
    head = 2 * logits_tokens * cfg.vocab_size * cfg.hidden_size
    formula = (
        f"2*T*L*(per-block matmul weights) + 2*(sequences)*V*hidden = 2*{num(num_tokens)}*{cfg.num_layers}"
        f"*{num(layer_matmul_params(cfg))} + 2*{logits_tokens}*{cfg.vocab_size}*{cfg.hidden_size}"
        f" = {num(blocks + head)}"
    )
    return Quantity(blocks + head, "FLOP", formula)


def attention_flops(cfg: ModelConfig, context: int, new_tokens: int, causal: bool = True) -> Quantity:
    """QK^T and PV FLOPs for the last `new_tokens` tokens of a `context`-token sequence.

    A token at position n (1-based) attends to n keys: QK^T costs 2*n*d and
    PV 2*n*d per head, so 2*2*L*n*(H*d) per token. Summed over the new
    tokens n = N-T+1 .. N that is 4*L*H*d * (T*N - T*(T-1)/2); a prefill
    (T = N) gives 2*L*H*d*N*(N+1), a decode step (T = 1) gives 4*L*H*d*N.
    GQA does not change this (every query head still does its own dot
    products); it only shrinks the K/V that is stored and read.

    causal=False counts the full T x N score matrix, masked afterwards: what
    a naive `softmax(QK^T + mask) V` executes, and what the seeds' 4*L*N^2*d is.
    """
    if causal:
        pairs = new_tokens * context - new_tokens * (new_tokens - 1) // 2
        shape = "causal: sum of keys seen = T*N - T*(T-1)/2"
    else:
        pairs = new_tokens * context
        shape = "full T x N scores, then masked: T*N"
    value = 4 * cfg.num_layers * cfg.q_size * pairs
    formula = (
        f"4*L*(H*d)*pairs, {shape} = 4*{cfg.num_layers}*{cfg.q_size}*{num(pairs)} (T={num(new_tokens)},"
        f" N={num(context)}) = {num(value)}"
    )
    return Quantity(value, "FLOP", formula)


# ---------------------------------------------------------------- the KV cache


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, mha: bool = False) -> Quantity:
    """K and V of every layer and KV head: 2 * L * Hkv * d * bytes (mha=True: as if Hkv = H)."""
    heads = cfg.num_heads if mha else cfg.num_kv_heads
    value = 2 * cfg.num_layers * heads * cfg.head_dim * dtype_bytes
    kind = "MHA, Hkv = H" if mha else f"GQA, {cfg.group_size} query heads per KV head"
    formula = f"2*L*Hkv*d*bytes ({kind}) = 2*{cfg.num_layers}*{heads}*{cfg.head_dim}*{dtype_bytes} = {num(value)}"
    return Quantity(value, "B", formula)


def kv_bytes(cfg: ModelConfig, dtype_bytes: int, tokens: int, mha: bool = False) -> Quantity:
    """KV-cache bytes for `tokens` tokens (one sequence of that length, or several adding up to it)."""
    per = kv_bytes_per_token(cfg, dtype_bytes, mha)
    value = per.value * tokens
    return Quantity(value, "B", f"tokens * KV/token = {num(tokens)} * {num(per.value)} = {num(value)}")


# ---------------------------------------------------------------- the seeds' shortcuts (plain numbers)


def seeds_linear_flops(layers: int, hidden: int, tokens: int, coefficient: float = 11) -> Quantity:
    """Seeds ch.5: 2 * L * (11 * N * d^2): 4 attention + 3 SwiGLU matmuls, folded into ~11 d^2 per block."""
    value = 2 * layers * coefficient * tokens * hidden**2
    formula = f"2*L*({num(coefficient)}*N*d^2) = 2*{layers}*{num(coefficient)}*{num(tokens)}*{hidden}^2 = {num(value)}"
    return Quantity(value, "FLOP", formula)


def seeds_params_flops(params: float, tokens: int) -> Quantity:
    """Seeds ch.8: 2 * N * P, every parameter one multiply-add per token."""
    value = 2 * tokens * params
    return Quantity(value, "FLOP", f"2*N*P = 2*{num(tokens)}*{num(params)} = {num(value)}")


def seeds_attention_flops(layers: int, hidden: int, queries: int, keys: int) -> Quantity:
    """Seeds ch.8: 4 * L * N_q * N_k * d (QK^T and PV over the full score matrix, no causal halving)."""
    value = 4 * layers * queries * keys * hidden
    formula = f"4*L*Nq*Nk*d = 4*{layers}*{num(queries)}*{num(keys)}*{hidden} = {num(value)}"
    return Quantity(value, "FLOP", formula)


def seeds_kv_bytes_per_token(layers: int, hidden: int, dtype_bytes: int) -> Quantity:
    """Seeds ch.6: K and V of width d in every layer (MHA): d * 2 (K, V) * bytes * L."""
    value = 2 * layers * hidden * dtype_bytes
    formula = f"L*(d*2*bytes) = {layers}*({hidden}*2*{dtype_bytes}) = {num(value)}"
    return Quantity(value, "B", formula)
