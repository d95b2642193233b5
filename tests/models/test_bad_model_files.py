"""Broken model files and out-of-range settings: one clear `StagewiseError` naming what is wrong, never a raw
KeyError / ZeroDivisionError from deep inside, never a model that loads and then generates garbage."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.errors import StagewiseError
from stagewise.models.gguf_loader import config_from_gguf
from stagewise.models.registry import load_model
from stagewise.sampling_params import FLOAT32_TINY, PENALIZED_LOGIT_MAX
from stagewise.stages.sampling import SamplingTensors, processed_probs
from tests.checkpoints import CFG, hf_tiny_model, round_embedding_to_q8_0, write_gguf, write_hf_dir


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A good tiny Hugging Face checkpoint; each test edits a copy."""
    return write_hf_dir(tmp_path_factory.mktemp("good") / "hf", hf_tiny_model(seed=5))


def edited_copy(src, dst, file: str, edit) -> str:
    """Copy the checkpoint folder, then replace `file`'s text with `edit(parsed JSON or text)`."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / file
    text = path.read_text()
    try:
        new = edit(json.loads(text))
        path.write_text(new if isinstance(new, str) else json.dumps(new))
    except json.JSONDecodeError:
        path.write_text(edit(text))
    return str(dst)


def with_config(**changes):
    def edit(cfg):
        cfg.update(changes)
        return cfg

    return edit


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_scaling": {"rope_type": "linear"}}, "config.json: RoPE scaling 'linear' lacks 'factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"rope_scaling": "linear"}, "config.json: rope_scaling must be a JSON object"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "abc"}}, "factor must be a number, got 'abc'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "config.json: .*factor must be a finite number > 0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "factor must be a finite number > 0, got -2"),
        ({"rope_parameters": "x"}, "must be a JSON object"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0.0}}, "factor must be a finite number > 0"),
        ({"max_position_embeddings": 10**12}, "max_position_embeddings must be at most 16,777,216"),
        ({"num_key_value_heads": 0}, "num_kv_heads must be an int >= 1, got 0"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "rope_theta must be a finite"),
        ({"rope_parameters": None, "rope_theta": float("inf")}, "rope_theta must be a finite number > 0, got inf"),
    ],
    ids=[
        "no-factor",
        "llama3-missing",
        "str",
        "factor-str",
        "factor-0",
        "factor-neg",
        "params-str",
        "params-0",
        "max-pos",
        "kv-heads-0",
        "theta-inf",
        "top-level-theta-inf",
    ],
)
def test_bad_config_json(hf_dir, tmp_path, changes, message):
    if "rope_scaling" in changes:  # the older spelling; transformers >= 5 writes rope_parameters
        changes = {"rope_parameters": None, **changes}
    path = edited_copy(hf_dir, tmp_path / "m", "config.json", with_config(**changes))
    with pytest.raises(StagewiseError, match=message):
        load_model(path)


@pytest.mark.parametrize(
    ("file", "edit", "message"),
    [
        ("tokenizer.json", lambda text: "{bad json", r"tokenizer.json is not valid JSON"),
        ("tokenizer.json", lambda spec: [], r"tokenizer.json must hold a JSON object, got list"),
        ("tokenizer.json", lambda spec: {**spec, "model": {"type": "BPE", "vocab": 5}}, "tokenizer.json: not a"),
        ("tokenizer_config.json", lambda text: "{bad json", r"tokenizer_config.json is not valid JSON"),
        ("tokenizer_config.json", lambda cfg: {**cfg, "eos_token": "NOT_A_TOKEN"}, "eos_token 'NOT_A_TOKEN' is not"),
    ],
    ids=["tok-json", "tok-list", "tok-vocab-int", "tokcfg-json", "eos-unknown"],
)
def test_bad_tokenizer_files(hf_dir, tmp_path, file, edit, message):
    path = edited_copy(hf_dir, tmp_path / "m", file, edit)
    with pytest.raises(StagewiseError, match=message):
        load_model(path)


def rewrite_tensor(folder, name: str, change) -> None:
    from safetensors.torch import load_file, save_file

    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors[name] = change(tensors[name])
    save_file(tensors, shard)


@pytest.mark.parametrize(
    ("change", "dtype", "message"),
    [
        (lambda t: t.clone().index_fill_(0, torch.tensor([3]), float("nan")), torch.float32, "holds NaN"),
        (lambda t: (t * 100).to(torch.int8), torch.float32, "is torch.int8; quantized weights are not supported"),
        (lambda t: t.clone().index_fill_(0, torch.tensor([0]), 1e5), torch.float16, "infinite in torch.float16"),
    ],
    ids=["nan", "int8", "fp16-overflow"],
)
def test_bad_weights_in_safetensors(hf_dir, tmp_path, change, dtype, message):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(hf_dir, folder)
    rewrite_tensor(folder, "model.layers.0.mlp.up_proj.weight", change)
    with pytest.raises(StagewiseError, match=message):
        load_model(str(folder), dtype=dtype)


def test_nan_in_a_gguf_tensor(tmp_path):
    model = round_embedding_to_q8_0(hf_tiny_model(seed=2))
    with torch.no_grad():
        model.model.norm.weight[1] = float("nan")
    path = write_gguf(tmp_path / "nan.gguf", model)
    with pytest.raises(StagewiseError, match="'output_norm.weight' holds NaN"):
        load_model(str(path))


def test_a_tokenizer_larger_than_the_embedding_table(tmp_path):
    """Every token id needs an embedding row; the reverse (padded rows beyond the tokens) is allowed."""
    small = write_hf_dir(tmp_path / "small", hf_tiny_model(vocab_size=CFG.vocab_size - 8))
    with pytest.raises(StagewiseError, match=f"tokenizer has {CFG.vocab_size} tokens, more than the model's"):
        load_model(str(small))
    padded = load_model(str(write_hf_dir(tmp_path / "padded", hf_tiny_model(vocab_size=CFG.vocab_size + 64))))
    assert padded.config.vocab_size == CFG.vocab_size + 64
    tok = padded.tokenizer
    assert tok.decode([5, CFG.vocab_size + 3, 6]) == tok.decode([5, 6])  # a padding row: a real id, no text
    with pytest.raises(StagewiseError, match="outside the vocabulary"):
        tok.decode([CFG.vocab_size + 64])  # past the model's table too


def fake_gguf(**metadata):
    """Just enough of a GGUFReader for `config_from_gguf`: fields with .contents(), and no tensors."""
    fields = {"general.architecture": "llama", "tokenizer.ggml.tokens": ["a"] * 64, **metadata}
    wrapped = {k: SimpleNamespace(contents=lambda v=v: v) for k, v in fields.items() if v is not None}
    return SimpleNamespace(fields=wrapped, tensors=[])


GOOD_GGUF = {
    "llama.embedding_length": 64,
    "llama.attention.head_count": 4,
    "llama.feed_forward_length": 96,
    "llama.block_count": 2,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"llama.attention.head_count": 0}, "num_heads must be an int >= 1, got 0"),
        ({"llama.embedding_length": "abc"}, "llama.embedding_length must be int, got 'abc'"),
        ({"llama.block_count": None}, "lacks llama.block_count"),
        ({"tokenizer.ggml.tokens": None}, "lacks both llama.vocab_size and tokenizer.ggml.tokens"),
        ({"llama.rope.freq_base": "x"}, "llama.rope.freq_base must be float, got 'x'"),
        ({"llama.context_length": 2.5}, "llama.context_length must be int, got 2.5"),
    ],
    ids=["heads-0", "hidden-str", "no-layers", "no-tokens", "theta-str", "ctx-float"],
)
def test_bad_gguf_metadata(changes, message):
    assert config_from_gguf(fake_gguf(**GOOD_GGUF), "m.gguf").hidden_size == 64  # the good one loads
    with pytest.raises(StagewiseError, match=message):
        config_from_gguf(fake_gguf(**{**GOOD_GGUF, **changes}), "m.gguf")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 10**400}, r"temperature must be a finite number in \[0, 3.40282e\+38\], got 1000"),
        ({"temperature": 1e39}, "temperature must be a finite number"),
        ({"repetition_penalty": 1e-300}, r"repetition_penalty must be a finite number in \[1.17549e-38"),
        ({"repetition_penalty": 1e39}, "repetition_penalty must be a finite number"),
        ({"top_p": 10**400}, "top_p must be a finite number"),
    ],
)
def test_sampling_values_beyond_float32(kwargs, message):
    with pytest.raises(StagewiseError, match=message) as info:
        SamplingParams(**kwargs)
    assert len(str(info.value)) < 120  # a 400-digit number is not printed whole


@pytest.mark.parametrize("penalty", [FLOAT32_TINY, 3e38])
@pytest.mark.parametrize("temperature", [1e-5, 0.7])  # sampling temperatures (the smallest drawn one), not tolerances
def test_extreme_penalties_give_a_distribution(penalty, temperature):
    """A penalty at float32's edges pushes seen logits past float32; the clamp keeps the softmax finite."""
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 50, generator=gen)  # [B, V]
    params = [SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=1)] * 3
    positive, negative = (logits[0] > 0).nonzero()[:3, 0].tolist(), (logits[0] < 0).nonzero()[:2, 0].tolist()
    seen = torch.zeros(3, 50, dtype=torch.bool)
    seen[0, positive + negative] = True
    seen[1, 5] = True
    seen[2] = True  # every token seen
    sampling = SamplingTensors.from_params(params, seen, [0, 0, 0], [1, 1, 1], "cpu")
    probs = processed_probs(logits, sampling)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    if penalty == FLOAT32_TINY:  # seen positive logits -> +1e33: the draw is among them, evenly
        expected = torch.zeros(50)
        expected[positive] = 1 / len(positive)
        torch.testing.assert_close(probs[0], expected)
    assert PENALIZED_LOGIT_MAX / 1e-5 < torch.finfo(torch.float32).max


@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_engine_samples_with_extreme_penalties(backend):
    llm = LLM("tiny", backend=backend)
    for penalty in (FLOAT32_TINY, 3e38):
        params = SamplingParams(max_tokens=3, temperature=0.7, repetition_penalty=penalty, seed=3)  # a draw, not a tol
        out = llm.generate(["hi hi hello"], params)[0]
        assert len(out.token_ids) >= 1 and all(0 <= t < 512 for t in out.token_ids)


@pytest.mark.parametrize("dtype", [torch.int8, torch.complex64, torch.float8_e4m3fn])
def test_llm_refuses_dtypes_the_stages_cannot_compute_in(dtype):
    with pytest.raises(StagewiseError, match="dtype must be one of torch.float32"):
        LLM("tiny", dtype=dtype)


def test_fake_gguf_reader_shape():
    """The fake reader above answers like gguf's: a missing key is absent, not None-valued."""
    reader = fake_gguf(**GOOD_GGUF)
    assert "llama.vocab_size" not in reader.fields
    assert np.asarray(reader.fields["tokenizer.ggml.tokens"].contents()).shape == (64,)
