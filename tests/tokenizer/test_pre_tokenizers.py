"""Pre-tokenizer names: every name llama.cpp writes maps to its split rules; unknown names fail in one line."""

import dataclasses

import gguf
import pytest

from stagewise.errors import StagewiseError
from stagewise.models.tokenizer_files import tokenizer_from_gguf
from stagewise.stages.pre_tokenizers import PRE_TOKENIZER_ALIASES, PRE_TOKENIZERS, known_names
from stagewise.stages.tokenize import pre_tokenize
from stagewise.tokenizer import Tokenizer
from tests.checkpoints import CFG, hf_tiny_model, write_gguf, write_tiny_bpe_tokenizer

TEXTS = [
    "Hello, world!! 12345 it's IT'S",
    "CamelCaseWord and snake_case, URLs: https://x.org/a?b=1",
    "  indented\n\n\tcode() {\r\n    return 42;\n}",
    "naïve café, 東京 2024年, 😀 ½ ⅧⅨ",
]


def test_worked_examples():
    """By hand, from llama.cpp's regexes (llama-vocab.cpp)."""
    # "default": punctuation runs, then GPT-2, then digit runs, then groups of three ASCII digits
    assert pre_tokenize("Hello, world!! 12345", "default") == ["Hello", ",", " world", "!!", " ", "123", "45"]
    # "gpt-2" is llama.cpp's spelling of GPT-2's rules
    assert pre_tokenize("it's 2024", "gpt-2") == ["it", "'s", " 2024"]
    # Llama 3: digits in groups of up to three; "smollm" and its kin: every digit alone
    assert pre_tokenize("x 12345", "llama3") == ["x", " ", "123", "45"]
    assert pre_tokenize("x 123", "starcoder") == ["x", " ", "1", "2", "3"]
    # tekken (Mistral Nemo): a new word at each lower -> upper case change
    assert pre_tokenize("CamelCase", "tekken") == ["Camel", "Case"]


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_naive_matches_rust_for_every_rule_set(name):
    """The Python `regex` split and the Rust library's split (same regexes) give identical ids."""
    tokenizer = dataclasses.replace(Tokenizer.tiny(), pre=name)
    for text in TEXTS:
        assert tokenizer.encode(text, "naive") == tokenizer.encode(text, "fast"), (name, text)
        assert "".join(pre_tokenize(text, name)) == text


def test_every_alias_resolves():
    for alias, name in PRE_TOKENIZER_ALIASES.items():
        assert name in PRE_TOKENIZERS
        assert pre_tokenize(TEXTS[0], alias) == pre_tokenize(TEXTS[0], name)
    assert {"default", "gpt-2", "llama-bpe", "smollm"} <= set(known_names())


def test_unknown_name_is_one_line():
    with pytest.raises(StagewiseError, match=r"^unknown pre-tokenizer 'mystery'; known: a\.x-4\.0, .*, tekken$"):
        pre_tokenize("x", "mystery")


def gguf_with_pre(path, pre: str | None):
    """The tiny BPE vocabulary in a GGUF whose `tokenizer.ggml.pre` is `pre` (None: key absent)."""

    def write(w: gguf.GGUFWriter) -> None:
        tok = Tokenizer.tiny()
        w.add_tokenizer_model("gpt2")
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tok.tokens)
        w.add_token_types([3 if t in tok.special_tokens else 1 for t in tok.tokens])
        w.add_token_merges([f"{a} {b}" for a, b in tok.merges])

    return write_gguf(path, hf_tiny_model(seed=2), write_tokenizer=write)


@pytest.mark.parametrize("pre,expected", [("gpt-2", "gpt2"), ("llama-bpe", "llama-bpe"), (None, "default")])
def test_gguf_names(tmp_path, pre, expected):
    """llama.cpp's spelling loads; a GGUF without the key gets llama.cpp's fallback, "default"."""
    tokenizer = tokenizer_from_gguf(gguf_with_pre(tmp_path / "t.gguf", pre))
    assert tokenizer.pre == expected
    assert tokenizer.ignore_merges == (pre == "llama-bpe")


def test_gguf_unknown_name(tmp_path):
    with pytest.raises(StagewiseError, match="unknown pre-tokenizer 'mystery-bpe'; known: "):
        tokenizer_from_gguf(gguf_with_pre(tmp_path / "t.gguf", "mystery-bpe"))


def test_tiny_gguf_writer_still_writes_smollm(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", hf_tiny_model(seed=2), write_tokenizer=write_tiny_bpe_tokenizer)
    assert tokenizer_from_gguf(path).pre == "smollm" and CFG.vocab_size == 512
