"""config.json options that change a Llama's arithmetic: read as transformers reads them, or refused.

Two kinds of mistakes give fluent text from the wrong model without a word:
- the RoPE numbers spelled in two places (`rope_scaling` and `rope_parameters`, a `rope_theta` inside the
  RoPE dict and at the top level, `original_max_position_embeddings` inside and outside it): stagewise
  must take the one transformers takes, checked here against transformers on the same folder;
- options stagewise does not implement (biases, another activation, a sliding window) or weight files
  holding tensors the forward pass would not use: refused with one line that names the option.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from stagewise.errors import StagewiseError
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from tests.checkpoints import CFG, hf_tiny_model, write_gguf, write_hf_dir

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
IDS = [(7 * i + 3) % CFG.vocab_size for i in range(48)]  # positions well past an original length of 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("math") / "hf", hf_tiny_model(seed=11, tie=False))


def edited(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def stagewise_logits(path: str) -> torch.Tensor:
    model = load_model(path, dtype=torch.float32)
    batch = ForwardBatch.from_sequences([IDS], [0], "cpu")
    return LlamaModel(model, StageOps("naive")).forward(batch, NoKVCache(batch.cu_seqlens_q))[0]  # [vocab]


@torch.no_grad()
def transformers_logits(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([IDS])).logits[0, -1]  # [vocab]


def rope_a(cfg):  # a rope_theta at the top level and another inside rope_parameters
    cfg["rope_theta"], cfg["rope_parameters"] = 10000.0, {"rope_type": "default", "rope_theta": 500000.0}


def rope_b(cfg):  # rope_parameters (plain) and the older rope_scaling (llama3) side by side
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg["rope_scaling"] = {**LLAMA3, "original_max_position_embeddings": 16}


def rope_c(cfg):  # llama3's pre-training length inside the dict (64) and at the top level (16)
    cfg["rope_parameters"] = {**LLAMA3, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    cfg["original_max_position_embeddings"] = 16


def rope_d(cfg):  # an older rope_scaling carrying its own rope_theta beside a top-level one
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"], cfg["rope_scaling"] = 10000.0, {"type": "linear", "factor": 4.0, "rope_theta": 500000.0}


def rope_plain(cfg):  # the reading a loader that took the other spelling would get
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    cfg.pop("rope_scaling", None)


@pytest.mark.oracle
@pytest.mark.parametrize(
    "edit", [rope_a, rope_b, rope_c, rope_d], ids=["theta-twice", "both-dicts", "orig-len", "theta-in-scaling"]
)
def test_rope_spelled_twice_is_read_as_transformers_reads_it(hf_dir, tmp_path, edit):
    path = edited(hf_dir, tmp_path / "m", edit)
    ours, theirs = stagewise_logits(path), transformers_logits(path)
    assert (ours - theirs).abs().max() < 1e-4
    plain = stagewise_logits(edited(hf_dir, tmp_path / "plain", rope_plain))
    assert (plain - theirs).abs().max() > 1e-2  # the two readings differ: the check above can fail


@pytest.mark.oracle
def test_missing_rms_norm_eps_defaults_as_in_transformers(hf_dir, tmp_path):
    from transformers import AutoConfig

    path = edited(hf_dir, tmp_path / "m", lambda cfg: cfg.pop("rms_norm_eps"))
    assert load_model(path).config.rms_norm_eps == AutoConfig.from_pretrained(path).rms_norm_eps == 1e-6


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; a Llama FFN is SwiGLU"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"attention_bias": True}, "attention_bias is true \\(biases on the q/k/v/o projections\\)"),
        ({"mlp_bias": True}, "mlp_bias is true \\(biases on the FFN projections\\)"),
        ({"model_type": "mistral", "sliding_window": 4}, "sliding_window 4 limits attention to the last 4 tokens"),
    ],
    ids=["gelu", "relu", "attention-bias", "mlp-bias", "sliding-window"],
)
def test_options_stagewise_does_not_implement_are_refused(hf_dir, tmp_path, changes, message):
    path = edited(hf_dir, tmp_path / "m", lambda cfg: cfg.update(changes))
    with pytest.raises(StagewiseError, match=f"config.json: {message}"):
        load_model(path)


@pytest.mark.parametrize(
    "changes",
    [
        {"hidden_act": "swish"},
        {"attention_bias": False, "mlp_bias": False},
        {"sliding_window": None},
        {"sliding_window": CFG.max_position_embeddings},
    ],
)
def test_options_that_change_nothing_still_load(hf_dir, tmp_path, changes):
    path = edited(hf_dir, tmp_path / "m", lambda cfg: cfg.update(changes))
    assert load_model(path).config.num_layers == CFG.num_layers


def with_extra_tensors(src, dst, tensors: dict, **config) -> str:
    """A copy of the folder with `tensors` in one more shard (and config.json updated)."""
    path = edited(src, dst, lambda cfg: cfg.update(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "extra.safetensors"))
    return path


def test_an_unused_tensor_in_the_weight_files_is_refused(hf_dir, tmp_path):
    """A bias the config does not announce, or a layer beyond num_hidden_layers, would silently be dropped."""
    bias = {"model.layers.0.self_attn.q_proj.bias": torch.ones(CFG.num_heads * CFG.head_dim)}
    with pytest.raises(StagewiseError, match="does not use: model.layers.0.self_attn.q_proj.bias$"):
        load_model(with_extra_tensors(hf_dir, tmp_path / "bias", bias))
    layer = {
        f"model.layers.{CFG.num_layers}.mlp.{n}.weight": torch.ones(2, 2)
        for n in ("down_proj", "gate_proj", "up_proj", "zz_proj")
    }
    with pytest.raises(StagewiseError, match="does not use: model.layers.2.mlp.down_proj.weight, .*\\(4 in all\\)"):
        load_model(with_extra_tensors(hf_dir, tmp_path / "layer", layer))


def test_rotary_inv_freq_buffers_of_older_files_are_skipped(hf_dir, tmp_path):
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(CFG.head_dim // 2) for i in range(2)}
    assert load_model(with_extra_tensors(hf_dir, tmp_path / "m", buffers)).config.num_layers == CFG.num_layers


def test_tied_head_must_equal_a_stored_lm_head(hf_dir, tmp_path):
    """tie_word_embeddings with a different lm_head.weight in the files: transformers 5 keeps the file's head,
    vLLM and transformers 4 tie. stagewise refuses to guess; an equal stored copy (common) loads."""
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        embed, head = f.get_tensor("model.embed_tokens.weight"), f.get_tensor("lm_head.weight")
    assert not torch.equal(embed, head)
    tied = edited(hf_dir, tmp_path / "tied", lambda cfg: cfg.update(tie_word_embeddings=True))
    with pytest.raises(StagewiseError, match="ties the LM head to the embedding .* a different lm_head.weight"):
        load_model(tied)
    same = tmp_path / "same"
    shutil.copytree(tied, same)
    from safetensors.torch import load_file

    tensors = load_file(str(same / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(same / "model.safetensors"))
    model = load_model(str(same))
    assert torch.equal(model.weights.lm_head.t(), embed)


def gguf_bias(w):
    w.add_tensor("blk.0.attn_q.bias", np.ones(CFG.num_heads * CFG.head_dim, dtype=np.float32))


def gguf_experts(w):
    w.add_expert_count(8)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (gguf_bias, "the file holds tensors a Llama of this metadata does not use: blk.0.attn_q.bias$"),
        (gguf_experts, "a mixture of 8 experts \\(llama.expert_count\\); stagewise runs dense Llama"),
    ],
    ids=["bias", "experts"],
)
def test_gguf_with_more_than_a_dense_llama_is_refused(tmp_path, extra, message):
    """llama.cpp's llama architecture also covers biases and Mixtral-style experts: never dropped silently."""
    path = write_gguf(tmp_path / "m.gguf", hf_tiny_model(seed=3), extra=extra)
    with pytest.raises(StagewiseError, match=message):
        load_model(str(path))
    assert load_model(str(write_gguf(tmp_path / "plain.gguf", hf_tiny_model(seed=3)))).config.num_layers == 2
