"""Every end-of-sequence id ends generation, not just the tokenizer's eos_token.

Llama 3.1 Instruct's `generation_config.json` lists three (<|end_of_text|>, <|eom_id|>, <|eot_id|>) and
llama.cpp's GGUF keeps end of turn / end of message apart from eos (`tokenizer.ggml.eot_token_id`,
`eom_token_id`); transformers, vLLM and llama.cpp stop on each. Here a tiny model's own greedy
continuation supplies the id: declared as an end-of-sequence id, the run must stop exactly there.
"""

import json
import shutil

import pytest
import torch

from stagewise import LLM, SamplingParams
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from tests.checkpoints import hf_tiny_model, write_gguf, write_hf_dir

PROMPT = "Hello there, how are you"
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("eos") / "hf", hf_tiny_model(seed=21, tie=False))


@pytest.fixture(scope="module")
def free_run(hf_dir):
    """The 8 greedy tokens with eos alone (none of them is eos), and the id at position 3 to declare."""
    out = LLM(load_model(str(hf_dir)), mode="kv").generate([PROMPT], GREEDY)[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    target = out.token_ids[3]
    assert target not in out.token_ids[:3]
    return out.token_ids, target


def with_generation_config(src, dst, eos) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 1}))
    return str(dst)


@pytest.mark.parametrize("mode", ["paged", "kv", "naive"])
def test_generation_config_eos_list_stops_the_run(hf_dir, free_run, tmp_path, mode):
    tokens, target = free_run
    model = load_model(with_generation_config(hf_dir, tmp_path / "m", [2, target]))
    assert model.tokenizer.eos_id == 2 and model.tokenizer.stop_ids == {2, target}
    out = LLM(model, mode=mode).generate([PROMPT], GREEDY)[0]
    assert out.token_ids == tokens[:4] and out.finish_reason == "stop"
    assert out.text == model.tokenizer.decode(tokens[:3], skip_special_tokens=True)  # the stop id adds no text
    ignoring = LLM(model, mode=mode).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert ignoring[0].token_ids == tokens


@pytest.mark.oracle
def test_transformers_stops_on_the_same_id(hf_dir, free_run, tmp_path):
    from transformers import AutoModelForCausalLM

    tokens, target = free_run
    path = with_generation_config(hf_dir, tmp_path / "m", [2, target])
    model = load_model(path)
    ids = model.tokenizer.encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    ours = LLM(model, mode="paged").generate([PROMPT], GREEDY)[0].token_ids
    assert ours == hf_out == tokens[:4]


def test_gguf_end_of_turn_id_stops_the_run(free_run, tmp_path):
    tokens, target = free_run
    model = hf_tiny_model(seed=21, tie=False)
    path = write_gguf(tmp_path / "m.gguf", model, extra=lambda w: w.add_eot_token_id(target))
    model = load_model(str(path))
    assert model.tokenizer.stop_ids == {model.tokenizer.eos_id, target}
    assert LLM(model).generate([PROMPT], GREEDY)[0].token_ids == tokens[:4]


@pytest.mark.parametrize(("eos", "message"), [("</s>", "must be an int or a list of ints"),
                                              ([2, 100000], "100000 is outside the vocabulary")])  # fmt: skip
def test_bad_generation_config_eos_is_one_line(hf_dir, tmp_path, eos, message):
    with pytest.raises(StagewiseError, match=f"generation_config.json: eos_token_id.*{message}"):
        load_model(with_generation_config(hf_dir, tmp_path / "m", eos))


def test_saved_tokenizer_keeps_its_end_of_sequence_ids(hf_dir, free_run, tmp_path):
    from stagewise.models.tokenizer_files import tokenizer_from_hf_dir, tokenizer_to_hf_dir

    _, target = free_run
    tok = load_model(with_generation_config(hf_dir, tmp_path / "m", [2, target])).tokenizer
    assert tokenizer_from_hf_dir(tokenizer_to_hf_dir(tok, tmp_path / "saved")).stop_ids == {2, target}
