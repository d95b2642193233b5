"""The weights of a Llama model, laid out the way the stages consume them.

Every projection has the shape [in, out] so the code reads `x @ w`, and the
projections that read the same input are concatenated: W_q|W_k|W_v into one
`w_qkv` and W_gate|W_up into one `w_gate_up` (one GEMM each instead of three
and two). The LM head is [hidden, vocab] too.

Shape is not layout. Where the numbers sit in memory depends on the device
(`LlamaWeights.to`):

- CPU: "out-major", each matrix stored [out, in] row-major (as in the model
  files) and seen through a transposed [in, out] view, because the CPU BLAS
  streams weights fastest in that orientation for decode-sized batches
  (`tuning/gemm_forms.py`; the measurements: benchmarks/README.md). With tied embeddings the LM head
  is simply the embedding table seen transposed: no second copy.
- GPU: "in-major", each matrix contiguous [in, out] (and a separate LM head
  copy), the layout the Triton GEMM's tiles were written for.
"""

from dataclasses import dataclass

import torch

from stagewise.config import ModelConfig
from stagewise.quant.packed_weight import PackedWeight, is_packed


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]: RMSNorm before attention
    # the four projections: tensors, or PackedWeight when kept quantized (quant/packed_weight.py)
    w_qkv: "torch.Tensor | PackedWeight"  # [hidden, (H + 2*Hkv) * d]: fused Q, K, V projection
    w_o: "torch.Tensor | PackedWeight"  # [H * d, hidden]: attention output projection
    ffn_norm: torch.Tensor  # [hidden]: RMSNorm before the FFN
    w_gate_up: "torch.Tensor | PackedWeight"  # [hidden, 2 * inter]: fused gate and up projections
    w_down: "torch.Tensor | PackedWeight"  # [inter, hidden]: down projection


@dataclass
class LlamaWeights:
    embed: "torch.Tensor | PackedWeight"  # [vocab, hidden]: token embedding table (packed: by rows)
    layers: list[LayerWeights]  # one entry per transformer block
    final_norm: torch.Tensor  # [hidden]: RMSNorm after the last block
    lm_head: "torch.Tensor | PackedWeight"  # [hidden, vocab]: output matrix (embed^T when tied)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LlamaWeights":
        """Move and cast every tensor, in the layout the device's GEMMs read fastest (see above)."""
        out_major = torch.device(device).type == "cpu"

        def move(t: "torch.Tensor | PackedWeight") -> "torch.Tensor | PackedWeight":
            if is_packed(t):
                return t.to(device)  # codes and scales as they are: no float dtype to cast
            t = t.to(device=device, dtype=dtype)
            if t.dim() == 2 and out_major:
                return t.t().contiguous().t()  # [in, out] view of a row-major [out, in] matrix
            return t.contiguous()

        layers = [
            LayerWeights(**{k: move(v) for k, v in vars(layer).items()}) for layer in self.layers
        ]
        if is_packed(self.embed):  # a packed table [vocab, hidden]: its rows are gathered
            embed = self.embed.to(device)
            lm_head = embed if self.tied() else move(self.lm_head)  # one object when tied
        else:
            # [vocab, hidden]: rows are gathered
            embed = self.embed.to(device=device, dtype=dtype).contiguous()
            lm_head = embed.t() if self.tied() and out_major else move(self.lm_head)
        return LlamaWeights(
            embed=embed, layers=layers, final_norm=move(self.final_norm), lm_head=lm_head
        )

    def tied(self) -> bool:
        """True when the LM head is a view of the embedding table's memory (tied embeddings)."""
        if is_packed(self.embed) or is_packed(self.lm_head):
            return self.lm_head is self.embed  # a packed table serves as the head itself
        same_device = self.lm_head.device == self.embed.device and self.embed.device.type != "meta"
        return same_device and self.lm_head.data_ptr() == self.embed.data_ptr()

    def num_bytes(self) -> int:
        """Bytes of all weight tensors held in memory (a tied LM head shares the table's memory).

        Packed weights count their codes and scales; `prepared_bytes` counts what tiers built.
        """
        table = 0 if self.tied() else tensor_bytes(self.embed)
        return table + self.decode_bytes() - self._embed_row_bytes()

    def packed(self) -> list:
        """Every distinct packed weight (a tied table once)."""
        found = [self.embed, self.lm_head, *(t for lw in self.layers for t in vars(lw).values())]
        unique = {id(t): t for t in found if is_packed(t)}
        return list(unique.values())

    def prepared_bytes(self) -> int:
        """Bytes the tiers built from packed weights once (e.g. the torch tier's int4pack form)."""
        return sum(w.prepared_bytes() for w in self.packed())

    def held_bytes(self) -> int:
        """Bytes in memory: `num_bytes`, less the codes a packed weight released (its torch form
        holds them), plus the forms the tiers built (`PackedWeight.held_bytes`)."""
        return self.num_bytes() + sum(w.held_bytes() - w.nbytes for w in self.packed())

    def decode_bytes(self) -> int:
        """Bytes one decode step of one token reads: every layer, the final norm and the LM head.

        The embedding table is not read whole — one row per token — so it is left out: with tied
        embeddings this is the parameter count minus the table's duplicate, times the element size.
        """
        tensors = [
            self.final_norm,
            self.lm_head,
            *(t for layer in self.layers for t in vars(layer).values()),
        ]
        return sum(tensor_bytes(t) for t in tensors) + self._embed_row_bytes()

    def _embed_row_bytes(self) -> int:
        if is_packed(self.embed):
            return self.embed.row_bytes()  # one token's codes and scales
        return self.embed.shape[1] * self.embed.element_size()  # one row of the table


def tensor_bytes(t: "torch.Tensor | PackedWeight") -> int:
    """Bytes a weight holds: numel x element size, or a packed weight's codes and scales."""
    return t.nbytes if is_packed(t) else t.numel() * t.element_size()


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "attn_norm": (hidden,),
        "w_qkv": (hidden, config.qkv_size),
        "w_o": (config.q_size, hidden),
        "ffn_norm": (hidden,),
        "w_gate_up": (hidden, 2 * inter),
        "w_down": (inter, hidden),
    }


def empty_weights(
    config: ModelConfig, device: str = "meta", dtype: torch.dtype = torch.bfloat16
) -> LlamaWeights:
    """Weights with the right shapes and no data (meta device): the shape-only presets."""
    layers = [
        LayerWeights(
            **{
                k: torch.empty(s, device=device, dtype=dtype)
                for k, s in _layer_shapes(config).items()
            }
        )
        for _ in range(config.num_layers)
    ]
    embed = torch.empty(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
    lm_head = torch.empty(config.hidden_size, config.vocab_size, device=device, dtype=dtype)
    final_norm = torch.empty(config.hidden_size, device=device, dtype=dtype)
    return LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def random_weights(config: ModelConfig, seed: int = 0) -> LlamaWeights:
    """Seeded random float32 weights scaled like a trained model (the `tiny` preset)."""
    gen = torch.Generator().manual_seed(seed)

    def init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:  # norm weights hover around 1
            return 1.0 + 0.1 * torch.randn(shape, generator=gen)
        return torch.randn(shape, generator=gen) / shape[0] ** 0.5  # fan-in scaling

    layers = [
        LayerWeights(**{k: init(k, s) for k, s in _layer_shapes(config).items()})
        for _ in range(config.num_layers)
    ]
    # Rows of norm ~1, so tied logits h . e have std ~1: a spread-out distribution worth sampling
    # from.
    embed = (
        torch.randn(config.vocab_size, config.hidden_size, generator=gen) / config.hidden_size**0.5
    )
    untied = torch.randn(embed.shape, generator=gen) / config.hidden_size**0.5
    # [hidden, vocab] view (tied: shares memory)
    lm_head = (embed if config.tie_word_embeddings else untied).t()
    final_norm = init("final_norm", (config.hidden_size,))
    return LlamaWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def synthetic_weights(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> LlamaWeights:
    """Seeded random weights drawn directly on `device` in `dtype`, scaled like `random_weights`.

    For benchmarking real shapes without a checkpoint: Llama-3-8B's 16 GB of bf16 weights are
    drawn on the GPU in well under a second, never passing through host memory in float32.
    The numbers differ from `random_weights` (another generator), the statistics are the same.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def init(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        if len(shape) == 1:  # norm weights hover around 1
            return t.mul_(0.1).add_(1.0)
        return t.mul_(shape[0] ** -0.5)  # fan-in scaling

    layers = [
        LayerWeights(**{k: init(s) for k, s in _layer_shapes(config).items()})
        for _ in range(config.num_layers)
    ]
    # Rows of norm ~1, as in `random_weights`: tied logits h . e have std ~1.
    embed = torch.randn(
        config.vocab_size, config.hidden_size, generator=gen, device=device, dtype=dtype
    )
    embed.mul_(config.hidden_size**-0.5)
    lm_head = (
        embed.t() if config.tie_word_embeddings else init((config.hidden_size, config.vocab_size))
    )
    weights = LlamaWeights(
        embed=embed, layers=layers, final_norm=init((config.hidden_size,)), lm_head=lm_head
    )
    return weights.to(device, dtype)  # the device's layout (a no-op on a GPU)
