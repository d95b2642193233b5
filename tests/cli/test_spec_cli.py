"""`--speculative ngram:k` / `--speculative-config JSON` on generate: same greedy text, the
acceptance line under --stats, one-line errors for bad values."""

import pytest

from stagewise import StagewiseError
from stagewise.cli.options import speculative_arg
from tests.cli.test_cli import run


def test_generate_with_speculation_prints_the_same_text_and_its_acceptance():
    prompt = "one two three one two three one two three one two"
    plain = run("generate", prompt, "--model", "tiny", "--max-tokens", "16", "--ignore-eos")
    spec = run(
        "generate", prompt, "--model", "tiny", "--max-tokens", "16", "--ignore-eos",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
        "--stats",
    )  # fmt: skip
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "speculative decoding:" in spec.stderr and "kept per verify step" in spec.stderr


@pytest.mark.parametrize(
    ("config", "shorthand", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', None, "num_speculative_tokens"),
        (None, "eagle:3", "--speculative expects"),
        ("{not json", None, "not valid JSON"),
        ('{"method": "ngram"}', "ngram:2", "not both"),
    ],
)
def test_bad_speculative_options_are_one_line(config, shorthand, message):
    with pytest.raises(StagewiseError, match=message):
        speculative_arg(config, shorthand)


def test_trace_refuses_speculation_outside_paged_mode_in_one_line():
    res = run("trace", "hi", "--model", "tiny", "--mode", "kv", "--speculative", "ngram:2")
    assert res.returncode == 2 and "speculative_config needs mode='paged'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
