"""Model resolution and loading: tiny checkpoints written by the tests, and every error path."""

import json
import shutil

import pytest
import torch

from stagewise.errors import StagewiseError
from stagewise.kv.none import NoKVCache
from stagewise.models.forward_batch import ForwardBatch
from stagewise.models.llama import LlamaModel
from stagewise.models.ops import StageOps
from stagewise.models.registry import load_model
from tests.checkpoints import hf_tiny_model, round_embedding_to_q8_0, write_gguf, write_hf_dir
from tests.helpers import assert_close

PROMPTS = [[1, 200, 37, 5, 99, 300, 2], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


def all_logits(loaded) -> torch.Tensor:
    model = LlamaModel(loaded, StageOps("naive"))
    batch = ForwardBatch.from_sequences(PROMPTS, [0] * len(PROMPTS), "cpu")
    batch.last_token_index = torch.arange(batch.num_tokens)  # logits for every position
    return model.forward(batch, NoKVCache(batch.cu_seqlens_q))


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in PROMPTS])


@pytest.fixture(scope="module")
def hf_model():
    return round_embedding_to_q8_0(hf_tiny_model(seed=3))


def test_hf_dir_logits_match_transformers(tmp_path, hf_model):
    loaded = load_model(str(write_hf_dir(tmp_path / "hf", hf_model)))
    assert loaded.config.num_kv_heads == 2 and torch.equal(loaded.weights.lm_head, loaded.weights.embed.t())
    assert_close(all_logits(loaded), hf_logits(hf_model), 1e-4, 1e-4, "tiny HF dir vs transformers")


def test_untied_hf_dir(tmp_path):
    model = hf_tiny_model(seed=4, tie=False)
    loaded = load_model(str(write_hf_dir(tmp_path / "hf", model)))
    assert not torch.equal(loaded.weights.lm_head, loaded.weights.embed.t())
    assert_close(all_logits(loaded), hf_logits(model), 1e-4, 1e-4, "untied HF dir")


def test_gguf_undoes_llama_cpp_permutation(tmp_path, hf_model):
    """A GGUF with llama.cpp's Q/K permutation and a Q8_0 embedding gives transformers' logits."""
    loaded = load_model(str(write_gguf(tmp_path / "tiny.gguf", hf_model)))
    assert loaded.tokenizer.vocab_size == loaded.config.vocab_size
    # The HF model's embedding was rounded through Q8_0 first, so both hold identical weights.
    assert_close(all_logits(loaded), hf_logits(hf_model), 1e-4, 1e-4, "tiny GGUF vs transformers")


def test_gguf_without_unpermute_would_be_wrong(tmp_path, hf_model, monkeypatch):
    """The permutation matters: skipping the undo step changes the logits a lot."""
    import stagewise.models.gguf_loader as gl

    monkeypatch.setattr(gl, "unpermute_rows", lambda w, n: w)
    loaded = load_model(str(write_gguf(tmp_path / "tiny.gguf", hf_model)))
    assert (all_logits(loaded) - hf_logits(hf_model)).abs().max() > 0.5


def test_unknown_model_name():
    with pytest.raises(StagewiseError, match="unknown model 'gpt-5'"):
        load_model("gpt-5")


def test_missing_files(tmp_path):
    with pytest.raises(StagewiseError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(StagewiseError, match="no config.json"):
        load_model(str(tmp_path))


def test_truncated_and_corrupt_gguf(tmp_path, hf_model):
    good = write_gguf(tmp_path / "tiny.gguf", hf_model)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(StagewiseError, match="not a valid GGUF"):
        load_model(str(truncated))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(StagewiseError, match="not a valid GGUF"):
        load_model(str(garbage))


def test_non_llama_architecture(tmp_path, hf_model):
    path = write_gguf(tmp_path / "gpt2.gguf", hf_model, arch="gpt2")
    with pytest.raises(StagewiseError, match="architecture 'gpt2' is not supported"):
        load_model(str(path))
    d = write_hf_dir(tmp_path / "hf", hf_model)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mistral", ["MistralForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StagewiseError, match="'mistral' is not supported"):
        load_model(str(d))


def test_corrupt_safetensors(tmp_path, hf_model):
    d = write_hf_dir(tmp_path / "hf", hf_model)
    shard = next(d.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(StagewiseError, match="not a valid safetensors"):
        load_model(str(d))


def test_missing_tensor(tmp_path, hf_model):
    d = tmp_path / "hf"
    write_hf_dir(d, hf_model)
    from safetensors.torch import load_file, save_file

    shard = next(d.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.norm.weight"]
    save_file(tensors, shard)
    with pytest.raises(StagewiseError, match="model.norm.weight' is missing"):
        load_model(str(d))
    shutil.rmtree(d)


def test_shape_only_preset_lives_on_meta():
    loaded = load_model("llama-3-405b")
    assert loaded.weights.embed.device.type == "meta"
    assert loaded.config.hidden_size == 16384 and loaded.config.num_layers == 126
