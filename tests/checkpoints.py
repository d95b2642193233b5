"""Tiny checkpoints the tests write themselves: a Hugging Face Llama directory and a GGUF file.

Both hold the same random weights (a transformers `LlamaForCausalLM` with the
tiny preset's sizes) and the tiny tokenizer. The GGUF applies llama.cpp's
Q/K row permutation and stores one tensor as Q8_0, so loading it exercises the
same code paths as the real SmolLM2 file.
"""

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stagewise.config import PRESETS, ModelConfig
from stagewise.models.tokenizer_files import tokenizer_to_hf_dir
from stagewise.tokenizer import Tokenizer
from tests.kquant_blocks import BYTES as K_QUANT_BYTES
from tests.kquant_blocks import quantize_k

CFG = PRESETS["tiny"]


def hf_tiny_model(
    seed: int = 0,
    tie: bool = True,
    rope_scaling: dict | None = None,
    vocab_size: int = CFG.vocab_size,
    cfg: ModelConfig = CFG,
) -> LlamaForCausalLM:
    """`rope_scaling`: config.json's dict ({"rope_type": "llama3", ...}), None for plain RoPE;
    `cfg`: other sizes than the tiny preset's (e.g. hidden 256, a whole K-quant block per row)."""
    CFG = cfg  # noqa: N806 (the preset's name, read below)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads,
        num_key_value_heads=CFG.num_kv_heads,
        head_dim=CFG.head_dim,
        rope_theta=CFG.rope_theta,
        rms_norm_eps=CFG.rms_norm_eps,
        max_position_embeddings=CFG.max_position_embeddings,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_scaling=rope_scaling,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # trained-model scales, so attention and every norm visibly matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model


def round_embedding_to_q8_0(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Replace the embedding by its Q8_0 round trip, so a GGUF storing it as Q8_0 holds exactly these values."""
    qtype = gguf.GGMLQuantizationType.Q8_0
    emb = model.model.embed_tokens.weight
    with torch.no_grad():
        rounded = gguf.quants.dequantize(gguf.quants.quantize(emb.numpy(), qtype), qtype)
        emb.copy_(torch.from_numpy(np.array(rounded)))
    return model


def write_hf_dir(path: Path, model: LlamaForCausalLM) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_to_hf_dir(Tokenizer.tiny(), path)
    return path


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to W_q / W_k rows (the loader must undo it)."""
    out_f = w.shape[0]
    return w.reshape(num_heads, 2, out_f // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_bpe_tokenizer(w: gguf.GGUFWriter) -> None:
    """The tiny byte-level BPE vocabulary as llama.cpp writes a "gpt2" tokenizer."""
    tok = Tokenizer.tiny()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok.pre)
    w.add_token_list(tok.tokens)
    w.add_token_types([3 if t in tok.special_tokens else 1 for t in tok.tokens])
    w.add_token_merges([f"{a} {b}" for a, b in tok.merges])
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_chat_template(tok.chat_template)


def write_gguf(
    path: Path,
    model: LlamaForCausalLM,
    arch: str = "llama",
    write_tokenizer=write_tiny_bpe_tokenizer,
    rope_freqs: np.ndarray | None = None,
    extra=None,
    projection_type: "gguf.GGMLQuantizationType | Callable | None" = None,
    cfg: ModelConfig = CFG,
) -> Path:
    """`write_tokenizer(writer)` adds the tokenizer.ggml.* keys; `rope_freqs` is llama.cpp's llama3 tensor;
    `extra(writer)` adds more keys or tensors (files a Llama loader must refuse); `projection_type`
    (e.g. Q4_1) stores the seven projections of every layer quantized, as SmolLM2's file does; a
    function of the GGUF tensor name -> type (or None: float32) picks per tensor (e.g. Q4_K only
    where the row is a multiple of 256); `cfg`: the sizes `model` was built with (`hf_tiny_model`)."""
    CFG = cfg  # noqa: N806 (the preset's name, read below)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(CFG.num_layers)
    w.add_context_length(CFG.max_position_embeddings)
    w.add_embedding_length(CFG.hidden_size)
    w.add_feed_forward_length(CFG.intermediate_size)
    w.add_head_count(CFG.num_heads)
    w.add_head_count_kv(CFG.num_kv_heads)
    w.add_rope_freq_base(CFG.rope_theta)
    w.add_layer_norm_rms_eps(CFG.rms_norm_eps)
    w.add_rope_dimension_count(CFG.head_dim)
    write_tokenizer(w)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if extra is not None:
        extra(w)
    # token_embd as Q8_0 (like SmolLM2's file), everything else float32
    q8 = gguf.quants.quantize(sd["model.embed_tokens.weight"], gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not model.config.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])

    def add_projection(name: str, array: np.ndarray) -> None:
        qtype = projection_type(name) if callable(projection_type) else projection_type
        if qtype is None:
            w.add_tensor(name, array)
        elif qtype.name in K_QUANT_BYTES:  # gguf has no K-quant quantizer: tests/kquant_blocks.py
            q = quantize_k(np.ascontiguousarray(array), qtype.name)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            q = gguf.quants.quantize(np.ascontiguousarray(array), qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    for i in range(CFG.num_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        add_projection(b + "attn_q.weight", llama_cpp_permute(sd[p + "self_attn.q_proj.weight"], CFG.num_heads))
        add_projection(b + "attn_k.weight", llama_cpp_permute(sd[p + "self_attn.k_proj.weight"], CFG.num_kv_heads))
        add_projection(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        add_projection(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add_projection(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        add_projection(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        add_projection(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
