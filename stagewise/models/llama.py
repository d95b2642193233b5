"""The Llama forward pass, assembled from the stages.

    input_ids [T]
      -> embedding                         [T, hidden]
      -> 30 x block:
           rmsnorm (+ residual add)        [T, hidden]
           qkv_proj                        [T, (H + 2*Hkv) * d]  -> q [T, H, d], k/v [T, Hkv, d]
           rope on q, k                    same shapes
           attention (K/V via kv.attend)   [T, H, d]
           o_proj                          [T, hidden]
           rmsnorm (+ residual add)        [T, hidden]
           ffn                             [T, hidden]
      -> final rmsnorm (+ residual add)    [T, hidden]
      -> lm_head on each sequence's last token  [num_seqs, vocab]

The batch is a flattened token batch across all scheduled sequences, never
[batch, seq, hidden] with padding. Every stage is called by its module through
`ops` (`ops(rmsnorm, layer=i, x=...)`: an editor jumps from here to the stage),
which runs the tier asked for (naive, torch or triton) and lets the tracer
watch. How K/V are kept (nowhere, a contiguous cache, a paged cache) is the
`kv` argument's business.

Tensor parallelism (`stagewise/parallel/`) changes three lines, through `tp`
(`models/parallel.py`): the embedding becomes a masked lookup + all-reduce,
o_proj and ffn end with an all-reduce, and the LM head's vocabulary slices
are gathered. With one device `tp` is `SINGLE_DEVICE` and all three are the
plain computation.

On the triton tier two pairs of stages may run as one kernel each: attn_norm
inside qkv_proj's input load for decode batches (`ops.norm_qkv`), and RoPE
inside the paged cache's KV store (`kv.rope_and_attend`). The block calls the
pair the same way whatever the tiers and the cache; `ops` and `kv` choose.
"""

import torch

from stagewise.kv.access import KVAccess
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.ops import StageOps
from stagewise.models.parallel import SINGLE_DEVICE
from stagewise.models.registry import LoadedModel
from stagewise.models.weights import LayerWeights
from stagewise.stages import ffn, lm_head, o_proj, rmsnorm
from stagewise.stages.qkv_proj import split_qkv
from stagewise.stages.rope import build_cos_sin_cache


class LlamaModel:
    def __init__(self, model: LoadedModel, ops: StageOps, tp=SINGLE_DEVICE):
        self.config = model.config
        self.weights = model.weights
        self.device = model.device
        self.dtype = model.dtype
        self.ops = ops
        self.tp = tp  # this rank's group (models/parallel.py); SINGLE_DEVICE: no collectives
        # Batch metadata (ids, positions, cu_seqlens, slot_mapping, ...) lives with the weights,
        # except for shape-only models on the meta device: there it stays on the CPU, where the
        # stages can read it.
        self.batch_device = torch.device("cpu") if self.device.type == "meta" else self.device
        cfg = self.config
        # Precomputed rotation angles: [max_position, rotary_dim], float32 (space for time).
        self.cos_sin_cache = build_cos_sin_cache(
            cfg.max_position_embeddings,
            cfg.rotary_dim,
            cfg.rope_theta,
            self.device,
            scaling=cfg.rope_scaling,
        )
        self.scale = cfg.head_dim**-0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVAccess) -> torch.Tensor:
        """-> logits [num_seqs, vocab] for the last token of each sequence."""
        cfg, w, ops, tp = self.config, self.weights, self.ops, self.tp
        h = tp.embed(ops, batch.input_ids, w.embed)  # [T] -> [T, hidden] (TP: lookup + all-reduce)
        residual = None  # the residual stream; the first rmsnorm starts it from h
        for i, lw in enumerate(w.layers):
            h, residual = self.transformer_block(i, lw, h, residual, batch, kv)  # [T, hidden]
        x, _ = ops(rmsnorm, x=h, weight=w.final_norm, eps=cfg.rms_norm_eps, residual=residual)
        if batch.last_token_index.numel() == 0:  # a step of prefill chunks only: nothing to predict
            return x.new_empty(0, cfg.vocab_size)
        # each sequence's last token: [T, hidden] -> [B, hidden] @ [hidden, vocab] -> [B, vocab]
        logits = ops(lm_head, hidden=x, last_token_index=batch.last_token_index, w_lm=w.lm_head)
        return tp.gather_vocab(logits)  # TP: [B, vocab/N] per rank -> [B, vocab] on rank 0

    def transformer_block(
        self,
        i: int,
        lw: LayerWeights,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        kv: KVAccess,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i: h [T, hidden] (+ residual) -> the block's output [T, hidden] and the residual.

        Each rmsnorm first adds the sub-block output to the residual stream (`residual`), so the
        block returns its last output unadded; the next block's (or the final) norm adds it.
        """
        cfg, ops, tp = self.config, self.ops, self.tp
        num_tokens = h.shape[0]
        eps = cfg.rms_norm_eps
        # attn_norm (+ residual add), then qkv_proj: [T, hidden] -> [T, (H+2Hkv)*d]
        qkv, residual = ops.norm_qkv(i, h, lw.attn_norm, eps, residual, w_qkv=lw.w_qkv)
        q, k, v = split_qkv(qkv, cfg)  # -> [T, H, d], [T, Hkv, d], [T, Hkv, d]
        # rope on q and k, then attention; the KV step stores k and v first (kv/)
        attn = kv.rope_and_attend(ops, i, batch.positions, q, k, v, self.cos_sin_cache, self.scale)
        attn = attn.reshape(num_tokens, cfg.q_size)  # [T, H, d] -> [T, H*d]
        h = ops(o_proj, layer=i, x=attn, w_o=lw.w_o)  # [T, H*d] -> [T, hidden]
        h = tp.all_reduce(h, layer=i)  # TP: sum of the ranks' partial o_proj outputs
        x, residual = ops(rmsnorm, layer=i, x=h, weight=lw.ffn_norm, eps=eps, residual=residual)
        h = ops(ffn, layer=i, x=x, w_gate_up=lw.w_gate_up, w_down=lw.w_down)  # -> [T, hidden]
        h = tp.all_reduce(h, layer=i)  # TP: sum of the ranks' partial down outputs
        return h, residual
