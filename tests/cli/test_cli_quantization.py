"""`--quantization`: the GGUF's packed weights (auto, the default) or floats (none); a bad value is
one line and exit 2."""

import sys

import pytest

from stagewise import cli


def invoke(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["stagewise", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
        raise SystemExit(0)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


def test_bad_quantization_is_one_line(monkeypatch, capsys):
    code, _, err = invoke(["generate", "hi", "--quantization", "int3"], monkeypatch, capsys)
    assert code == 2 and "unknown quantization 'int3'" in err and "Traceback" not in err


def test_generate_runs_with_none(monkeypatch, capsys):
    argv = ["generate", "hi", "--model", "tiny", "--max-tokens", "2", "--quantization", "none"]
    code, out, err = invoke(argv, monkeypatch, capsys)
    assert code == 0 and out, err
