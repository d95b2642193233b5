"""Megatron-style sharding: which slice of every matrix rank r of N holds.

Names: N = tensor_parallel_size, r = rank, H/Hkv = query/KV heads, d = head_dim.

    w_qkv      [hidden, (H + 2*Hkv) * d]  column-parallel by heads:
               rank r keeps the columns of its H/N query heads and of its KV heads
               -> [hidden, (H/N + 2*Hkv_r) * d]
    w_o        [H * d, hidden]            row-parallel: the rows of its query heads
               -> [H/N * d, hidden]; x_r @ w_o_r is a partial sum -> all-reduce
    w_gate_up  [hidden, 2 * inter]        column-parallel: its slice of gate, its slice of up
               -> [hidden, 2 * inter/N]  (still "gate | up": silu_and_mul splits it in two)
    w_down     [inter, hidden]            row-parallel: the rows of its slice -> [inter/N, hidden] -> all-reduce
    embed      [vocab, hidden]            vocabulary-parallel: rows [r*V/N, (r+1)*V/N) -> [V/N, hidden]
    lm_head    [hidden, vocab]            vocabulary-parallel: the same columns -> [hidden, V/N] -> gather
    norms      [hidden]                   replicated (every rank holds the whole residual stream)

KV heads: with N <= Hkv each rank owns Hkv/N of them. With N > Hkv there are
not enough to go round, so each KV head is *replicated* on N/Hkv ranks (as
vLLM does): rank r keeps KV head r // (N/Hkv) — the one its query heads read.
Either way the GQA group stays inside a rank and attention needs no collective.

The vocabulary is padded up to a multiple of N with zero rows (their logits
are cut off after the gather), so every rank's slice has the same shape.
"""

from dataclasses import dataclass, replace

import torch

from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError
from stagewise.models.weights import LayerWeights, LlamaWeights
from stagewise.quant.packed_weight import (
    PackedWeight,
    PackedWeightError,
    cat_out_features,
    is_packed,
)


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank `rank` of `world_size` holds (ranges of heads, FFN columns, vocabulary rows)."""

    rank: int  # r
    world_size: int  # N
    q_heads: range  # the query heads of this rank: H/N of them
    kv_heads: range  # its KV heads: Hkv/N of them, or the one replicated head when N > Hkv
    inter: range  # its FFN columns: inter/N of them
    vocab: range  # its vocabulary rows, padded: [r*V_r, (r+1)*V_r) with V_r = ceil(V/N)
    vocab_size: int  # the real vocabulary V (rows past it are padding)


def valid_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Every N that splits the heads, the KV heads (or replicates them) and the FFN evenly."""
    return [n for n in range(1, cfg.num_heads + 1) if _splits(cfg, n)]


def _splits(cfg: ModelConfig, n: int) -> bool:
    kv_ok = cfg.num_kv_heads % n == 0 or n % cfg.num_kv_heads == 0
    return cfg.num_heads % n == 0 and kv_ok and cfg.intermediate_size % n == 0


def check_tp_size(cfg: ModelConfig, n: int) -> None:
    """A one-line error naming the valid N when `n` cannot split this model."""
    if not _splits(cfg, n):
        valid = ", ".join(str(v) for v in valid_tp_sizes(cfg))
        raise StagewiseError(
            f"tensor_parallel_size={n} cannot split {cfg.name}: {cfg.num_heads} query heads, {cfg.num_kv_heads} KV "
            f"heads and {cfg.intermediate_size} FFN columns split evenly only for N in {valid}"
        )


def shard_plan(cfg: ModelConfig, rank: int, n: int) -> ShardPlan:
    check_tp_size(cfg, n)
    h_r = cfg.num_heads // n  # query heads per rank
    if n <= cfg.num_kv_heads:
        kv_r = cfg.num_kv_heads // n
        kv = range(rank * kv_r, (rank + 1) * kv_r)
    else:  # fewer KV heads than ranks: each is replicated on n / Hkv ranks
        head = rank // (n // cfg.num_kv_heads)
        kv = range(head, head + 1)
    inter_r = cfg.intermediate_size // n
    vocab_r = -(-cfg.vocab_size // n)  # ceil: the last slice is padded with zero rows
    return ShardPlan(
        rank=rank,
        world_size=n,
        q_heads=range(rank * h_r, (rank + 1) * h_r),
        kv_heads=kv,
        inter=range(rank * inter_r, (rank + 1) * inter_r),
        vocab=range(rank * vocab_r, (rank + 1) * vocab_r),
        vocab_size=cfg.vocab_size,
    )


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The sizes one rank computes with: its heads, its FFN slice, its vocabulary slice."""
    return replace(
        cfg,
        num_heads=len(plan.q_heads),  # H/N
        num_kv_heads=len(plan.kv_heads),  # Hkv/N, or 1 (replicated)
        intermediate_size=len(plan.inter),  # inter/N
        vocab_size=len(plan.vocab),  # ceil(V/N)
    )


def _cols(w: torch.Tensor, r: range, width: int = 1) -> torch.Tensor:
    return w[:, r.start * width : r.stop * width]


def _rows(w: torch.Tensor, r: range, width: int = 1) -> torch.Tensor:
    return w[r.start * width : r.stop * width]


def _vocab_rows(table: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """table [V, hidden] -> [V/N, hidden]: this rank's rows, zero rows past the real vocabulary."""
    rows = table[plan.vocab.start : min(plan.vocab.stop, plan.vocab_size)]
    pad = len(plan.vocab) - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(pad, table.shape[1])]) if pad else rows


def _packed_vocab_rows(table: PackedWeight, plan: ShardPlan) -> PackedWeight:
    """A packed table's rows of this rank; padding rows get zero codes and scales (the value 0)."""
    rows = table.out_features(slice(plan.vocab.start, min(plan.vocab.stop, plan.vocab_size)))
    pad = len(plan.vocab) - rows.shape[1]
    if not pad:
        return rows
    zeros = table.out_features(slice(0, 1))._with(lambda t, _: t.new_zeros(pad, t.shape[1]))
    return cat_out_features([rows, zeros])


def _shard_packed_layer(lw: LayerWeights, cfg: ModelConfig, plan: ShardPlan) -> LayerWeights:
    """The same slices of packed weights: columns are whole output rows of codes (exact); the
    row-parallel w_o and w_down are cut along K, which must fall between groups of 32."""
    d, inter = cfg.head_dim, cfg.intermediate_size

    def span(r: range, width: int, offset: int = 0) -> torch.Tensor:
        return torch.arange(offset + r.start * width, offset + r.stop * width)

    qkv = torch.cat(
        [
            span(plan.q_heads, d),
            span(plan.kv_heads, d, cfg.q_size),
            span(plan.kv_heads, d, cfg.q_size + cfg.kv_size),
        ]
    )
    gate_up = torch.cat([span(plan.inter, 1), span(plan.inter, 1, inter)])

    def rows(w, r: range, width: int = 1):
        if not is_packed(w):
            return _rows(w, r, width)
        try:
            return w.in_features(r.start * width, r.stop * width)
        except PackedWeightError as exc:
            raise StagewiseError(
                f"tensor_parallel_size={plan.world_size}: {exc}; load with quantization='none'"
            ) from None

    def cols(w, index: torch.Tensor, full):
        return w.out_features(index) if is_packed(w) else full()

    return LayerWeights(
        attn_norm=lw.attn_norm,
        w_qkv=cols(lw.w_qkv, qkv, lambda: lw.w_qkv[:, qkv]),  # [hidden, (H/N + 2*Hkv_r) * d]
        w_o=rows(lw.w_o, plan.q_heads, d),  # [H/N * d, hidden]
        ffn_norm=lw.ffn_norm,
        w_gate_up=cols(lw.w_gate_up, gate_up, lambda: lw.w_gate_up[:, gate_up]),
        w_down=rows(lw.w_down, plan.inter),  # [inter/N, hidden]
    )


def shard_layer(lw: LayerWeights, cfg: ModelConfig, plan: ShardPlan) -> LayerWeights:
    if any(is_packed(w) for w in vars(lw).values()):
        return _shard_packed_layer(lw, cfg, plan)
    d, inter = cfg.head_dim, cfg.intermediate_size
    q, k, v = lw.w_qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=1)  # column blocks of W_q | W_k | W_v
    w_qkv = torch.cat([_cols(q, plan.q_heads, d), _cols(k, plan.kv_heads, d), _cols(v, plan.kv_heads, d)], dim=1)
    # w_qkv [hidden, (H + 2*Hkv) * d] -> [hidden, (H/N + 2*Hkv_r) * d]
    gate, up = lw.w_gate_up[:, :inter], lw.w_gate_up[:, inter:]
    w_gate_up = torch.cat([_cols(gate, plan.inter), _cols(up, plan.inter)], dim=1)  # -> [hidden, 2 * inter/N]
    return LayerWeights(
        attn_norm=lw.attn_norm,  # [hidden], replicated
        w_qkv=w_qkv,
        w_o=_rows(lw.w_o, plan.q_heads, d),  # [H * d, hidden] -> [H/N * d, hidden]
        ffn_norm=lw.ffn_norm,  # [hidden], replicated
        w_gate_up=w_gate_up,
        w_down=_rows(lw.w_down, plan.inter),  # [inter, hidden] -> [inter/N, hidden]
    )


def shard_weights(
    w: LlamaWeights, cfg: ModelConfig, plan: ShardPlan, device: torch.device, dtype: torch.dtype
) -> LlamaWeights:
    """Rank `plan.rank`'s copy of every weight, in `device`'s layout (`LlamaWeights.to`)."""
    if is_packed(w.embed):  # a packed table: its rows, and the head is the same object when tied
        embed = _packed_vocab_rows(w.embed, plan)
        lm_head = embed if w.tied() else _packed_or_rows(w.lm_head, plan)
        layers = [shard_layer(lw, cfg, plan) for lw in w.layers]
        local = LlamaWeights(embed=embed, layers=layers, final_norm=w.final_norm, lm_head=lm_head)
        return _copied(local.to(device, dtype))
    embed = _vocab_rows(w.embed, plan).contiguous()  # [V, hidden] -> [V/N, hidden]
    if w.tied():
        lm_head = embed.t()  # [hidden, V/N]: still the same memory as this rank's table
    else:
        lm_head = _vocab_rows(w.lm_head.t(), plan).t()  # [hidden, V] -> [hidden, V/N]
    layers = [shard_layer(lw, cfg, plan) for lw in w.layers]
    local = LlamaWeights(embed=embed, layers=layers, final_norm=w.final_norm, lm_head=lm_head)
    # .to() lays every matrix out as the device's GEMMs read it; a copy, so no slice keeps the whole tensor alive
    return _copied(local.to(device, dtype))


def _packed_or_rows(head, plan: ShardPlan):
    """An untied LM head [hidden, V]: its vocabulary columns (packed: rows of its storage)."""
    if is_packed(head):
        return _packed_vocab_rows(head, plan)
    return _vocab_rows(head.t(), plan).t()


def _copied(w: LlamaWeights) -> LlamaWeights:
    """Make every tensor own its memory (a slice that is already in layout would share the full matrix)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        if is_packed(t):
            return t  # every packed slice above is already a copy of its rows
        if t.dim() == 2 and t.stride(0) == 1:  # an [in, out] view of an out-major matrix: copy that way round
            return t.t().clone().t()
        return t.clone()

    embed = own(w.embed)
    lm_head = (embed if is_packed(embed) else embed.t()) if w.tied() else own(w.lm_head)
    layers = [LayerWeights(**{k: own(v) for k, v in vars(lw).items()}) for lw in w.layers]
    return LlamaWeights(embed=embed, layers=layers, final_norm=own(w.final_norm), lm_head=lm_head)
