"""Notebook 14's checks (`stagewise.exercises.quant_checks`): the solutions pass, plausible wrong answers
FAIL with a readable message, and the reference is llama.cpp's (`gguf`), not the package's own code."""

import functools
import importlib.util
from pathlib import Path

import torch

from stagewise.exercises import result

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "nb14.py"


@functools.cache
def solutions() -> dict:
    spec = importlib.util.spec_from_file_location("solutions_nb14", SOLUTIONS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOLUTIONS


def _scale(block: torch.Tensor) -> torch.Tensor:
    return block[:2].view(torch.float16).to(torch.float32)


WRONG = {
    "14.dequant_q4_0": {
        "no offset": lambda b: _scale(b) * torch.cat([b[2:] & 15, b[2:] >> 4]).float(),
        "nibbles interleaved": lambda b: _scale(b) * (torch.stack([b[2:] & 15, b[2:] >> 4], 1).flatten().float() - 8),
        "high nibble first": lambda b: _scale(b) * (torch.cat([b[2:] >> 4, b[2:] & 15]).float() - 8),
        "scale read big-endian": lambda b: (
            b[:2].flip(0).contiguous().view(torch.float16).float() * (torch.cat([b[2:] & 15, b[2:] >> 4]).float() - 8)
        ),
        "float16 result": lambda b: solutions()["14.dequant_q4_0"](b).half(),
    },
    "14.bytes_per_weight": {
        "codes only": lambda bits, group, has_min: bits / 8,
        "scale forgotten for the minimum": lambda bits, group, has_min: (group * bits / 8 + 2) / group,
        "bits, not bytes": lambda bits, group, has_min: (group * bits + 16 + 16 * has_min) / group,
    },
}


def test_solutions_pass():
    for name, fn in solutions().items():
        outcome = result(name, fn)
        assert outcome.passed, outcome.line()


def test_plausible_wrong_answers_fail():
    for name, bugs in WRONG.items():
        for why, fn in bugs.items():
            outcome = result(name, fn)
            assert outcome.status == "fail", f"{why}: {outcome.line()}"
            assert name in outcome.line() and "\n" not in outcome.line()


def test_stub_is_not_yet():
    def stub(*args):
        raise NotImplementedError

    for name in WRONG:
        assert result(name, stub).status == "not yet"
