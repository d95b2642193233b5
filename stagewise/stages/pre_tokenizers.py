"""The pre-tokenizer regexes of byte-level BPE models, under the names llama.cpp writes in a GGUF.

A GGUF names its split rules in `tokenizer.ggml.pre` (llama.cpp's converter
picks the name by hashing how the model's own tokenizer splits a test text;
`llama-vocab.cpp` maps each name to regexes). `PRE_TOKENIZERS` holds the
rules, under one canonical name each; `PRE_TOKENIZER_ALIASES` maps every other
name llama.cpp uses for the same rules (e.g. "gpt-2" is our "gpt2", "llama3"
is "llama-bpe"). Each regex cuts every piece the previous one produced,
keeping matches and the gaps between them alike (llama.cpp's
`unicode_regex_split`, and `tokenizers`' `Split(..., "isolated")`), so a
trailing `|\\s+` alternative some spellings carry changes nothing.

The regexes are the Hugging Face `tokenizer.json` originals where llama.cpp
rewrote them for its own regex engine (`(?i:'s|...)` instead of `'[sS]|...`).

Before any regex runs, `split_special_tokens` cuts the literal tokens (`<|im_start|>`,
`<s>`) out of the text: the first split rule of byte-level and SentencePiece BPE alike.
"""

import functools

import regex

from stagewise.errors import StagewiseError

# Every digit alone (SmolLM2, StarCoder): "2024" -> "2", "0", "2", "4".
DIGITS_PATTERN = r"\p{N}"
# GPT-2's pre-tokenizer: English contractions, letters, numbers, other symbols, whitespace.
# `\s+(?!\S)` leaves the last space of a run to start the next word (" x" stays together).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3 ("llama-bpe"): case-insensitive contractions, numbers in groups of up to three digits.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 / StableLM 2 / Megrez: as Llama 3, but every digit alone.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's "tekken" (Mistral Nemo, Pixtral): words split at lower -> upper case changes, digits
# alone.
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Canonical name -> regexes applied one after the other.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (GPT2_PATTERN,),
    "smollm": (DIGITS_PATTERN, GPT2_PATTERN),
    "llama-bpe": (LLAMA3_PATTERN,),
    # llama.cpp's fallback for a GGUF without `tokenizer.ggml.pre`: punctuation runs, then GPT-2,
    # then digit runs, then groups of three ASCII digits.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PATTERN, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "qwen2": (QWEN2_PATTERN,),
    "tekken": (TEKKEN_PATTERN,),
    # DeepSeek Coder (a Llama-architecture model): newlines, letter runs, punctuation runs, CJK,
    # digits.
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
}

# Every other name llama.cpp gives the same rules (llama-vocab.cpp), for Llama-family GGUFs and
# their kin.
PRE_TOKENIZER_ALIASES: dict[str, str] = {
    **dict.fromkeys(
        ["gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "mellum", "a.x-4.0", "exaone4"],
        "gpt2",
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], "smollm"
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"], "llama-bpe"
    ),
    **dict.fromkeys(["smaug-bpe", "dbrx"], "llama-bpe"),
    **dict.fromkeys(["stablelm2", "deepseek-r1-qwen", "megrez", "kormo"], "qwen2"),
}
# Names whose tokenizer lets a piece that is already a token skip the merges (llama.cpp:
# ignore_merges).
IGNORE_MERGES = frozenset(
    [
        "llama-bpe",
        "llama3",
        "llama-v3",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "tekken",
    ]
)


def known_names() -> list[str]:
    return sorted([*PRE_TOKENIZERS, *PRE_TOKENIZER_ALIASES])


def canonical_pre_name(name: str) -> str:
    """llama.cpp's name -> the key of PRE_TOKENIZERS with the same rules, or a one-line error."""
    if name in PRE_TOKENIZERS:
        return name
    if name in PRE_TOKENIZER_ALIASES:
        return PRE_TOKENIZER_ALIASES[name]
    raise StagewiseError(f"unknown pre-tokenizer '{name}'; known: {', '.join(known_names())}")


@functools.cache
def _special_regex(tokens_longest_first: tuple[str, ...]) -> regex.Pattern:
    """One alternation of the escaped tokens; listing longer ones first makes the longest win."""
    return regex.compile("|".join(regex.escape(token) for token in tokens_longest_first))


def split_special_tokens(text: str, special_tokens: dict[str, int]) -> list[tuple[str, bool]]:
    """Cut `text` into (chunk, is_special) around literal special tokens, leftmost-longest first.

    "x<a><a><b>y" with tokens "<a>", "<a><b>" -> ("x", False), ("<a>", True), ("<a><b>", True),
    ("y", False). Only the chunks that are not special go through the regexes and the merges.
    """
    if not special_tokens:
        return [(text, False)] if text else []
    pattern = _special_regex(tuple(sorted(special_tokens, key=len, reverse=True)))
    chunks, start = [], 0
    for match in pattern.finditer(text):
        if match.start() > start:
            chunks.append((text[start : match.start()], False))
        chunks.append((match.group(), True))
        start = match.end()
    if start < len(text):
        chunks.append((text[start:], False))
    return chunks
