"""Tokenize: text -> token ids, with GPT-2 style byte-level BPE (SentencePiece: `tokenize_sentencepiece.py`).

Shapes: a Python string -> int64 `[num_tokens]`.

How byte-level BPE turns text into ids, step by step (the naive path below
does exactly these steps, in Python):

1. Special tokens first. Control tokens such as `<|im_start|>` are matched
   literally in the raw text (longest match wins) and become their own id;
   only the text between them goes through BPE. Otherwise a user could never
   type the chat markers, and the model could never see them.
2. Pre-tokenize. A regex cuts each remaining chunk into "pieces" (roughly
   words with their leading space, runs of digits or punctuation, runs of
   whitespace). Merges never cross a piece boundary, so " the" is one piece
   and merges into one token no matter what comes next. Each model family
   has its own regex list (`PRE_TOKENIZERS`, under llama.cpp's names); SmolLM2 ("smollm") first splits
   every digit on its own (`\\p{N}`), then applies the GPT-2 pattern.
3. Bytes -> printable unicode. Each piece is encoded to UTF-8 and every byte
   is spelled as one printable character (`bytes_to_unicode`: printable
   Latin-1 bytes stand for themselves, the rest are shifted above U+0100, so
   a space becomes "Ġ" and a newline "Ċ"). The vocabulary is written in this
   alphabet, so the 256 byte tokens cover every possible input and there is
   no "unknown" token. (A vocabulary may leave out bytes it never saw:
   SmolLM2 has no token for 0x06 or 0xFF. Like the Rust library, we drop
   such bytes.)
4. Merge by rank. Starting from single characters, repeatedly find the
   adjacent pair whose merge was learned earliest (lowest rank in `merges`)
   and fuse it everywhere in the piece, until no adjacent pair is a merge.
5. Look the resulting token strings up in the vocabulary.

The optimized path builds a Rust `tokenizers.Tokenizer` from the very same
vocabulary, merges, pre-tokenizer regexes and special tokens (once, cached on
the `Tokenizer`), so it must return identical ids. What changes is only the
speed: compiled regexes and a priority-queue merge loop in Rust, with no
Python object per character. One caveat: Python's `regex` knows the ~17k
letters and digits Unicode assigned after version 14.0, the Rust library's
regex engine (Oniguruma) does not, so text with such brand-new characters
can be cut into different pieces by the two paths.
"""

import functools
from itertools import pairwise
from typing import TYPE_CHECKING

import regex
import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from stagewise.config import ModelConfig
from stagewise.errors import StagewiseError
from stagewise.stages import tokenize_sentencepiece
from stagewise.stages.base import Stage
from stagewise.stages.pre_tokenizers import (  # the split rules, under llama.cpp's names
    DIGITS_PATTERN,
    GPT2_PATTERN,
    LLAMA3_PATTERN,  # noqa: F401  (re-exported)
    PRE_TOKENIZERS,
    canonical_pre_name,
)

if TYPE_CHECKING:  # the tokenizer module imports this one; no import cycle at run time
    from stagewise.models.tokenizer import Tokenizer


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of GPT-2 byte-level BPE (256 entries).

    Printable bytes ("!".."~", "¡".."¬", "®".."ÿ") stand for themselves; the 68
    others (control bytes, space, ...) get the characters U+0100, U+0101, ... in
    byte order, so space (0x20) is "Ġ" (U+0120) and newline (0x0A) is "Ċ".
    """
    ranges = [("!", "~"), ("¡", "¬"), ("®", "ÿ")]
    printable = [byte for first, last in ranges for byte in range(ord(first), ord(last) + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


@functools.cache
def _special_regex(tokens_longest_first: tuple[str, ...]) -> regex.Pattern:
    """One alternation of the escaped tokens; listing longer ones first makes the longest win."""
    return regex.compile("|".join(regex.escape(token) for token in tokens_longest_first))


@functools.cache
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


def split_special_tokens(text: str, special_tokens: dict[str, int]) -> list[tuple[str, bool]]:
    """Cut `text` into (chunk, is_special) around literal special tokens, leftmost-longest first."""
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


def pre_tokenize(text: str, pre: str) -> list[str]:
    """Cut text into pieces with the model's regexes; the pieces concatenate back to `text`."""
    pre = canonical_pre_name(pre)  # "gpt-2" -> "gpt2"; an unknown name is a one-line error
    pieces = [text] if text else []
    for pattern in PRE_TOKENIZERS[pre]:
        compiled = _compiled(pattern)
        cut = []
        for piece in pieces:
            start = 0
            for match in compiled.finditer(piece):
                if match.start() > start:  # a gap the regex skipped is a piece of its own
                    cut.append(piece[start : match.start()])
                if match.end() > match.start():
                    cut.append(match.group())
                start = match.end()
            if start < len(piece):
                cut.append(piece[start:])
        pieces = cut
    return pieces


def bpe_merge(symbols: list[str], merge_ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply merges to one piece: fuse the lowest-rank adjacent pair everywhere, repeat."""
    while len(symbols) > 1:
        pairs = list(pairwise(symbols))
        best = min(pairs, key=lambda pair: merge_ranks.get(pair, len(merge_ranks)))
        if best not in merge_ranks:
            break  # no adjacent pair was ever merged in training: done
        fused, i = [], 0
        while i < len(symbols):  # left to right, so "a a a" with merge (a, a) gives "aa a"
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                fused.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                fused.append(symbols[i])
                i += 1
        symbols = fused
    return symbols


def piece_to_ids(piece: str, tokenizer: "Tokenizer") -> list[int]:
    """Byte-level map one pre-tokenized piece, merge it, and look the tokens up (cached per piece)."""
    cache = tokenizer.bpe_cache
    if piece in cache:
        return cache[piece]
    byte_map = bytes_to_unicode()
    spelled = "".join(byte_map[byte] for byte in piece.encode("utf-8"))  # " the" -> "Ġthe"
    vocab = tokenizer.token_to_id
    if tokenizer.ignore_merges and spelled in vocab:  # Llama 3: a whole piece in the vocab wins
        symbols = [spelled]
    else:
        # A byte with no token of its own is dropped before merging, as Rust tokenizers (no unk token)
        # and transformers do: SmolLM2 lacks 21 of the 256 (0x06, 0xFF, ...), so "\x06" encodes to [].
        symbols = bpe_merge([char for char in spelled if char in vocab], tokenizer.merge_ranks)
    missing = [symbol for symbol in symbols if symbol not in vocab]
    if missing:
        raise StagewiseError(
            f"tokenizer vocabulary lacks {missing[0]!r}; the merges and tokens disagree"
        )
    cache[piece] = [vocab[symbol] for symbol in symbols]
    return cache[piece]


def naive(text: str, tokenizer: "Tokenizer", add_special_tokens: bool = True) -> torch.Tensor:
    """Pure-Python byte-level BPE: special tokens, pre-tokenize, byte map, merge by rank, look up.

    `add_special_tokens=False` leaves out the bos a model adds, for text that already carries its
    markers (a rendered chat template, as transformers' `apply_chat_template(tokenize=True)`).
    """
    if tokenizer.model == "llama":  # SentencePiece BPE: ▁, merge by score, byte fallback
        return tokenize_sentencepiece.naive(text, tokenizer, add_special_tokens)
    ids = [tokenizer.bos_id] if tokenizer.add_bos and add_special_tokens else []
    for chunk, is_special in split_special_tokens(text, tokenizer.special_tokens):
        if is_special:
            ids.append(tokenizer.special_tokens[chunk])
            continue
        for piece in pre_tokenize(chunk, tokenizer.pre):
            ids.extend(piece_to_ids(piece, tokenizer))
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens]


def rust_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer equivalent to `PRE_TOKENIZERS[pre]` (as HF's own files spell it)."""
    patterns = list(PRE_TOKENIZERS[canonical_pre_name(pre)])
    gpt2_last = patterns[-1] == GPT2_PATTERN  # ByteLevel(use_regex=True) runs exactly this pattern
    if gpt2_last:
        patterns.pop()
    steps = [
        pre_tokenizers.Digits(individual_digits=True)
        if pattern == DIGITS_PATTERN
        else pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
        for pattern in patterns
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_last))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def pre_name_from_hf(pre_json: dict | None) -> str:
    """Inverse of `rust_pre_tokenizer`: the name of a tokenizer.json `pre_tokenizer`, or an error."""
    if not pre_json:
        raise StagewiseError(
            "tokenizer.json has no pre-tokenizer; only byte-level BPE is supported"
        )
    steps = pre_json["pretokenizers"] if pre_json.get("type") == "Sequence" else [pre_json]
    patterns, byte_level = [], False
    for step in steps:
        kind = step.get("type")
        if kind == "Digits" and step.get("individual_digits"):
            patterns.append(DIGITS_PATTERN)
        elif (
            kind == "Split"
            and "Regex" in step.get("pattern", {})
            and step.get("behavior") == "Isolated"
        ):
            patterns.append(step["pattern"]["Regex"])
        elif kind == "ByteLevel" and not step.get("add_prefix_space", False):
            byte_level = True
            if step.get("use_regex", True):
                patterns.append(GPT2_PATTERN)
        else:
            raise StagewiseError(
                f"unsupported pre-tokenizer step {step}; need GPT-2 style byte-level BPE"
            )
    if not byte_level:
        raise StagewiseError("tokenizer.json has no ByteLevel pre-tokenizer; need byte-level BPE")
    for name, known in PRE_TOKENIZERS.items():
        if tuple(patterns) == known:
            return name
    raise StagewiseError(
        f"unsupported pre-tokenizer regexes {patterns}; known: {', '.join(PRE_TOKENIZERS)}"
    )


def build_rust_tokenizer(tokenizer: "Tokenizer") -> tokenizers.Tokenizer:
    """A Rust `tokenizers.Tokenizer` with the same vocab, merges, pre-tokenizer and special tokens."""
    if tokenizer.model == "llama":
        return tokenize_sentencepiece.build_rust_tokenizer(tokenizer)
    vocab = {token: token_id for token_id, token in enumerate(tokenizer.tokens)}
    bpe = models.BPE(
        vocab=vocab, merges=list(tokenizer.merges), ignore_merges=tokenizer.ignore_merges
    )
    rust = tokenizers.Tokenizer(bpe)
    rust.pre_tokenizer = rust_pre_tokenizer(tokenizer.pre)
    rust.decoder = decoders.ByteLevel()
    by_id = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    rust.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, _ in by_id]
    )
    if tokenizer.add_bos:
        bos = tokenizer.tokens[tokenizer.bos_id]
        rust.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
    return rust


def optimized(text: str, tokenizer: "Tokenizer", add_special_tokens: bool = True) -> torch.Tensor:
    """The Rust `tokenizers` library, built once from the same vocabulary and merges."""
    ids = tokenizer.rust.encode(
        text, add_special_tokens=add_special_tokens
    ).ids  # bos only if the model adds it
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens]


def example_inputs(
    config: ModelConfig, num_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict:
    """English text of about `num_tokens` tokens under the tiny tokenizer (device and dtype unused)."""
    from stagewise.models.bpe_train import TINY_CORPUS
    from stagewise.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.tiny()
    chars_per_token = len(TINY_CORPUS) / len(tokenizer.encode(TINY_CORPUS))
    num_chars = max(1, round(num_tokens * chars_per_token))
    text = (TINY_CORPUS * (num_chars // len(TINY_CORPUS) + 1))[:num_chars]
    return {"text": text, "tokenizer": tokenizer}


STAGE = Stage(
    name="tokenize",
    summary="byte-level BPE: special tokens, regex pre-tokenizer, byte map, merges by rank -> token ids",
    shapes="text -> [num_tokens]",
    naive=naive,
    triton=optimized,
    triton_kind="rust tokenizers",
    example_inputs=example_inputs,
    outputs=("ids",),
    axes={"ids": "num_tokens"},
)
