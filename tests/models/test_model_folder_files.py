"""A Hugging Face model folder is read as one unit: no tensor stored twice across its shards, no file that
resolves outside it, no JSON nested past Python's recursion limit - each one line naming the file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from stagewise.errors import StagewiseError
from stagewise.models.hf_loader import config_from_hf, load_hf_dir
from stagewise.models.registry import load_model
from stagewise.models.tokenizer_files import tokenizer_from_hf_dir
from tests.checkpoints import hf_tiny_model, write_hf_dir


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A good tiny checkpoint; each test edits a copy."""
    return write_hf_dir(tmp_path_factory.mktemp("good") / "hf", hf_tiny_model(seed=3))


@pytest.fixture
def model(good, tmp_path):
    return shutil.copytree(good, tmp_path / "model")


def test_a_tensor_stored_in_two_shards_is_refused_naming_both(model):
    """A stale shard beside the real one: before, the later file silently won and the output changed."""
    _, weights = load_hf_dir(model)
    save_file({"model.norm.weight": weights.final_norm * 2}, model / "model-extra.safetensors")
    with pytest.raises(StagewiseError) as err:
        load_hf_dir(model)
    message = str(err.value)
    assert "tensor 'model.norm.weight' is stored twice, in model-extra.safetensors and model.safetensors" in message
    assert "\n" not in message


def test_tensors_split_across_shards_still_load(good, model):
    from safetensors.torch import load_file

    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    (model / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[::2]}, model / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, model / "model-00002-of-00002.safetensors")
    _, split = load_hf_dir(model)
    _, whole = load_hf_dir(good)
    assert torch.equal(split.final_norm, whole.final_norm) and torch.equal(split.embed, whole.embed)


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "tokenizer.json", "config.json"])
def test_a_file_linked_outside_the_folder_is_refused(model, tmp_path, name):
    """A chat template linked to another local file was read, and printed by trace."""
    outside = tmp_path / "elsewhere.txt"
    outside.write_text((model / name).read_text() if (model / name).exists() else "{{ 'secret' }}")
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(outside)
    read = config_from_hf if name == "config.json" else tokenizer_from_hf_dir
    with pytest.raises(StagewiseError, match=rf"^{model / name} points outside the model folder, to {outside};"):
        read(model)


def test_a_shard_linked_outside_the_folder_is_refused(model, tmp_path):
    shard = model / "model.safetensors"
    moved = shutil.move(shard, tmp_path / "weights.safetensors")
    shard.symlink_to(moved)
    with pytest.raises(StagewiseError, match=r"model.safetensors points outside the model folder"):
        load_hf_dir(model)


def test_links_inside_the_folder_and_a_linked_folder_are_fine(model, tmp_path):
    (model / "sub").mkdir()
    shutil.move(model / "tokenizer.json", model / "sub" / "tokenizer.json")
    (model / "tokenizer.json").symlink_to("sub/tokenizer.json")
    link = tmp_path / "link-to-model"
    link.symlink_to(model, target_is_directory=True)
    loaded = load_model(str(link), device="cpu")
    assert loaded.tokenizer.vocab_size == tokenizer_from_hf_dir(model).vocab_size


def test_the_hugging_face_hub_cache_layout_loads(good, tmp_path):
    """models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>: every file is a link out of the
    snapshot folder, into the same model's blobs."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(good.iterdir())):
        shutil.copy(file, blobs / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    _, weights = load_hf_dir(snapshot)
    assert torch.equal(weights.final_norm, load_hf_dir(good)[1].final_norm)
    tokenizer_from_hf_dir(snapshot)


def deep_json(levels: int) -> str:
    return '{"model_type": "llama", "x": ' + "[" * levels + "]" * levels + "}"


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_deeply_nested_json_is_one_line_naming_the_file(model, name):
    """100000 nested lists raised Python's RecursionError from inside the JSON decoder."""
    (model / name).write_text(deep_json(100_000))
    read = config_from_hf if name == "config.json" else tokenizer_from_hf_dir
    with pytest.raises(StagewiseError, match=rf"^{model / name}: JSON nested too deeply") as err:
        read(model)
    assert "\n" not in str(err.value)


def test_moderately_nested_json_is_read(model):
    config = json.loads((model / "config.json").read_text())
    config["notes"] = json.loads("[" * 200 + "]" * 200)
    (model / "config.json").write_text(json.dumps(config))
    assert config_from_hf(model).num_layers == 2
