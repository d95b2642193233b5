"""Tokenize: text -> token ids, with GPT-2 style byte-level BPE (SentencePiece: its own file).

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
   has its own regex list (`PRE_TOKENIZERS`, under llama.cpp's names);
   SmolLM2 ("smollm") first splits every digit on its own (`\\p{N}`), then
   applies the GPT-2 pattern.
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

The stage reads the vocabulary through `BytePairVocabulary` (tokens, merges,
pre-tokenizer name, special tokens, bos handling, and the lookups built from
them); `stagewise.tokenizer.Tokenizer` is one, and `example_inputs` builds a
smaller one by hand (`ByteLevelVocabulary`: the 256 bytes and six merges).

The `triton` tier (for tokenize: Rust, not Triton) builds a Rust
`tokenizers.Tokenizer` from the very same vocabulary, merges, pre-tokenizer
regexes and special tokens (once, cached on the vocabulary), so it must return
identical ids. What changes is only the speed: compiled regexes and a
priority-queue merge loop in Rust, with no Python object per character.
One caveat: Python's `regex` knows the ~17k letters and digits Unicode
assigned after version 14.0, the Rust library's regex engine (Oniguruma)
does not, so text with such brand-new characters can be cut into different
pieces by the two paths.
"""

import functools
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

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
    PRE_TOKENIZERS,
    canonical_pre_name,
    split_special_tokens,
)


class BytePairVocabulary(Protocol):
    """What this stage reads from a tokenizer; `stagewise.tokenizer.Tokenizer` is one.

    A SentencePiece vocabulary (`model == "llama"`) is handed to `tokenize_sentencepiece`, which
    reads the fields of its own `SentencePieceVocabulary`.
    """

    model: str  # "gpt2" (byte-level BPE, this file) or "llama" (SentencePiece)
    tokens: list[str]  # id -> token in the byte alphabet ("Ġthe"); special tokens as written
    merges: list[tuple[str, str]]  # BPE merges in rank order
    special_tokens: dict[str, int]  # tokens matched literally in the text before BPE -> id
    pre: str  # pre-tokenizer name, a key of PRE_TOKENIZERS (or one of its aliases)
    bos_id: int | None  # beginning-of-sequence id
    add_bos: bool  # prepend bos_id when encoding
    ignore_merges: bool  # Llama 3: a piece that is already a token skips the merges
    token_to_id: dict[str, int]  # token -> id
    merge_ranks: dict[tuple[str, str], int]  # merge -> rank (its position in `merges`)
    bpe_cache: dict[str, list[int]]  # pre-tokenized piece -> ids, filled by `naive`
    rust: tokenizers.Tokenizer  # what `triton` runs, built once by `build_rust_tokenizer`


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
def _compiled(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


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


def piece_to_ids(piece: str, tokenizer: BytePairVocabulary) -> list[int]:
    """Byte-level map one pre-tokenized piece, merge it, look the tokens up (cached per piece)."""
    cache = tokenizer.bpe_cache
    if piece in cache:
        return cache[piece]
    byte_map = bytes_to_unicode()
    spelled = "".join(byte_map[byte] for byte in piece.encode("utf-8"))  # " the" -> "Ġthe"
    vocab = tokenizer.token_to_id
    if tokenizer.ignore_merges and spelled in vocab:  # Llama 3: a whole piece in the vocab wins
        symbols = [spelled]
    else:
        # A byte with no token of its own is dropped before merging, as Rust tokenizers (no unk
        # token) and transformers do: SmolLM2 lacks 21 of the 256 (0x06, 0xFF, ...), so "\x06"
        # encodes to [].
        symbols = bpe_merge([char for char in spelled if char in vocab], tokenizer.merge_ranks)
    missing = [symbol for symbol in symbols if symbol not in vocab]
    if missing:
        raise StagewiseError(
            f"tokenizer vocabulary lacks {missing[0]!r}; the merges and tokens disagree"
        )
    cache[piece] = [vocab[symbol] for symbol in symbols]
    return cache[piece]


def naive(
    text: str, tokenizer: BytePairVocabulary, add_special_tokens: bool = True
) -> torch.Tensor:
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
    """The `tokenizers` pre-tokenizer equal to `PRE_TOKENIZERS[pre]`, as HF's own files spell it."""
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


def build_rust_tokenizer(tokenizer: BytePairVocabulary) -> tokenizers.Tokenizer:
    """A Rust `tokenizers.Tokenizer` with the same vocab, merges, pre-tokenizer, special tokens."""
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


def triton(
    text: str, tokenizer: BytePairVocabulary, add_special_tokens: bool = True
) -> torch.Tensor:
    """The Rust `tokenizers` library, built once from the same vocabulary and merges."""
    encoding = tokenizer.rust.encode(text, add_special_tokens=add_special_tokens)  # bos if added
    ids = encoding.ids
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens]


@dataclass(frozen=True, eq=False)
class ByteLevelVocabulary:
    """The smallest `BytePairVocabulary`: tokens, merges and specials, and the lookups the stage
    builds from them on first use (a worked example; the models' vocabularies are
    `stagewise.tokenizer.Tokenizer`)."""

    tokens: list[str]  # id -> token in the byte alphabet
    merges: list[tuple[str, str]]  # BPE merges in rank order
    special_tokens: dict[str, int]  # literal tokens -> id
    pre: str = "gpt2"  # pre-tokenizer name
    bos_id: int | None = None  # beginning-of-sequence id
    add_bos: bool = False  # prepend bos_id when encoding
    ignore_merges: bool = False  # a piece that is already a token skips the merges
    model: str = "gpt2"  # byte-level BPE

    @functools.cached_property
    def token_to_id(self) -> dict[str, int]:
        return {token: token_id for token_id, token in enumerate(self.tokens)}

    @functools.cached_property
    def merge_ranks(self) -> dict[tuple[str, str], int]:
        return {pair: rank for rank, pair in enumerate(self.merges)}

    @functools.cached_property
    def bpe_cache(self) -> dict[str, list[int]]:
        return {}

    @functools.cached_property
    def rust(self) -> tokenizers.Tokenizer:
        return build_rust_tokenizer(self)


# The worked example: " the" is Ġ t h e -> (Ġ,t) rank 0 -> Ġt h e -> (h,e) rank 1 -> Ġt he ->
# (Ġt,he) rank 2 -> Ġthe. " cat" is Ġ c a t -> (a,t) rank 3 first, as (Ġ,c) has rank 4 -> Ġ c at
# -> Ġc at -> (Ġc,at) rank 5 -> Ġcat. "The" only merges (h,e): T he; " saw" no pair: Ġ s a w.
# Byte b is token b, merge r makes token 256 + r, so EXAMPLE_TEXT is
# [84, 257, 261, 32, 115, 97, 119, 258, 261, 46, 262].
EXAMPLE_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at")]
EXAMPLE_TEXT = "The cat saw the cat.<|endoftext|>"


def example_vocabulary() -> ByteLevelVocabulary:
    """256 byte tokens, the six merges of EXAMPLE_MERGES (ids 256..261), `<|endoftext|>` (262)."""
    byte_tokens = [bytes_to_unicode()[byte] for byte in range(256)]
    merged = [left + right for left, right in EXAMPLE_MERGES]
    end = "<|endoftext|>"
    return ByteLevelVocabulary(
        tokens=[*byte_tokens, *merged, end],
        merges=EXAMPLE_MERGES,
        special_tokens={end: len(byte_tokens) + len(merged)},
    )


def example_inputs(
    config: ModelConfig, num_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict:
    """EXAMPLE_TEXT, repeated to about `num_tokens` tokens, and its vocabulary (config, device and
    dtype unused: a vocabulary is not a tensor)."""
    vocabulary = example_vocabulary()
    per_copy = len(naive(EXAMPLE_TEXT, vocabulary))  # 11: T he Ġcat Ġ s a w Ġthe Ġcat . <|end..|>
    text = EXAMPLE_TEXT * max(1, round(num_tokens / per_copy))
    return {"text": text, "tokenizer": vocabulary}


STAGE = Stage(
    name="tokenize",
    summary="byte-level BPE: special tokens, regex pre-tokenizer, byte map, merges by rank -> ids",
    shapes="text -> [num_tokens]",
    naive=naive,
    triton=triton,
    triton_kind="rust tokenizers",
    example_inputs=example_inputs,
    outputs=("ids",),
    axes={"ids": "num_tokens"},
)
