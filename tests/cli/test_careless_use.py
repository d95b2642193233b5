"""Careless use gets one line and exit 2, before anything is loaded or written: an output that names
the model it reads, a --record path that cannot be written (checked at start, not at shutdown), an
infinite --drain-timeout, RANK=abc, a misspelt group size, a JSON list as --speculative-config, a
draft_quantization nobody checked; and a corrupt K-quant file says so without numpy's warnings."""

import os
import warnings

import pytest

from stagewise.errors import StagewiseError
from stagewise.serve import server as serve_server
from stagewise.serve.limits import binds_every_interface
from tests.checkpoints import hf_tiny_model, write_gguf, write_hf_dir
from tests.cli.test_cli_bad_input import invoke


@pytest.fixture
def model_files(tmp_path, monkeypatch):
    """A tiny GGUF and a tiny Hugging Face folder in the working folder."""
    monkeypatch.chdir(tmp_path)
    model = hf_tiny_model(seed=1)
    write_gguf(tmp_path / "m.gguf", model)
    write_hf_dir(tmp_path / "hf", model)
    os.symlink("m.gguf", tmp_path / "link.json")
    return tmp_path


@pytest.fixture
def no_server(monkeypatch):
    """`serve` must stop before its server runs: one that starts fails the test instead of blocking it."""

    def started(*args, **kwargs):
        raise AssertionError("the server started: the option was not checked at start")

    monkeypatch.setattr(serve_server, "run", started)


def _files(folder) -> dict:
    return {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["trace", "hi", "--model", "m.gguf", "--out", "m.gguf"], "--out m.gguf is a file of the model being read"),
        (["trace", "hi", "--model", "m.gguf", "--out", "link.json"], "--out link.json is a file of the model"),
        (["trace", "hi", "--model", "hf", "--out", "hf/config.json"], "--out hf/config.json is a file of the model"),
        (["serve", "--model", "m.gguf", "--port", "0", "--record", "m.gguf"], "--record m.gguf is a file of the model"),
        (["serve", "--model", "m.gguf", "--port", "0", "--record", "missing/run.json"], "folder missing does not"),
        (["serve", "--model", "tiny", "--port", "0", "--drain-timeout", "inf"], "--drain-timeout must be a finite"),
        (["serve", "--model", "tiny", "--port", "0", "--drain-timeout", "nan"], "--drain-timeout must be a finite"),
        (["serve", "--model", "tiny", "--port", "0", "--max-stop-strings", "0"], "--max-stop-strings must be"),
        (["serve", "--model", "tiny", "--port", "0", "--header-timeout", "inf"], "--header-timeout must be"),
        (["serve", "--model", "tiny", "--port", "0", "--allowed-hosts", "a/b"], "--allowed-hosts takes host names"),
        (["generate", "hi", "--model", "hf", "--quantization", "int4:g064"], "group size is written g32, g64"),
        (["generate", "hi", "--model", "hf", "--quantization", "int4:g\u0666\u0664"], "group size is written g32"),
        (["generate", "hi", "--model", "tiny", "--speculative-config", "[1,2]"], "--speculative-config must be a JSON"),
        (
            [
                "generate",
                "hi",
                "--model",
                "tiny",
                "--speculative-config",
                '{"method": "draft", "model": "tiny", "draft_quantization": "int3"}',
            ],  # fmt: skip
            "speculative_config.draft_quantization: unknown quantization 'int3'",
        ),
    ],
)
def test_careless_options_are_one_line_exit_2_and_touch_nothing(
    argv, words, model_files, no_server, monkeypatch, capsys
):
    before = _files(model_files)
    code, out, err = invoke(argv, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert _files(model_files) == before


def test_a_rank_that_is_not_a_number_is_one_line(monkeypatch, capsys):
    for name, value in (("RANK", "abc"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511")):
        monkeypatch.setenv(name, value)
    code, _, err = invoke(["generate", "hi", "--model", "tiny", "--tp", "2"], monkeypatch, capsys)
    assert code == 2 and err.strip() == "error: RANK must be a whole number >= 0 (torchrun sets it), got 'abc'"


@pytest.mark.parametrize("host", ["0", "0.0.0.0", "::", "::0", "[::]", "0000::"])
def test_every_spelling_of_every_interface_is_seen(host):
    """serve warns when the socket it bound listens everywhere: judged on the bound address, not the spelling."""
    sock = serve_server.bind(host, 0)
    try:
        assert binds_every_interface(sock.getsockname()[0])
    finally:
        sock.close()
    with serve_server.bind("127.0.0.1", 0) as local:
        assert not binds_every_interface(local.getsockname()[0])


def test_a_corrupt_k_quant_file_is_refused_without_numpy_warnings(tmp_path):
    import numpy as np

    from stagewise.models.registry import load_model
    from tests.models.test_kquant_model import write_k_gguf

    path, _ = write_k_gguf(tmp_path, "Q4_K")
    import gguf

    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name.endswith("ffn_down.weight"))
    data = bytearray(path.read_bytes())
    noise = np.random.default_rng(0).integers(0, 256, int(tensor.n_bytes), dtype=np.uint8)
    data[tensor.data_offset : tensor.data_offset + int(tensor.n_bytes)] = noise.tobytes()
    path.write_bytes(bytes(data))
    for quantization in ("auto", "none"):  # kept packed, or dequantized by gguf's numpy code
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a RuntimeWarning ("invalid value in multiply") fails here
            with pytest.raises(StagewiseError, match="ffn_down.weight.*(NaN|infinite)"):
                load_model(str(path), quantization=quantization)
