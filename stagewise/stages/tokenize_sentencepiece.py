"""Tokenize, SentencePiece flavour: text -> token ids the way Llama 1/2, TinyLlama and Mistral do.

Shapes: a Python string -> int64 `[num_tokens]` (the same stage as `tokenize.py`; the
`tokenize` stage hands a tokenizer with `model == "llama"` to the functions here).

SentencePiece BPE differs from GPT-2's byte-level BPE in four ways, and the
naive path below does each of them in plain Python:

1. Literal tokens first. Control tokens (`<s>`, `</s>`), the unknown token
   `<unk>` and user-defined tokens are matched in the raw text (longest match
   wins) and become their own id, exactly as in byte-level BPE.
2. Spaces become a visible character, "▁" (U+2581), and every text chunk
   gets a "dummy prefix" "▁", so "Hello world" is spelled "▁Hello▁world" and
   the first word looks like every other word. There is no regex
   pre-tokenizer: the chunk is one sequence of characters (training usually
   keeps "▁" at the start of pieces, which lets the naive path below merge
   word by word: `split_words`). Where the "▁" goes is `SPACE_PREFIXES`
   (sentencepiece and llama.cpp: before every text chunk; Hugging Face's
   Metaspace: not when the chunk already starts with a space, and with
   "first" only at the start of the input).
3. Merge by score, not by a merge list. Start from single characters; among
   all adjacent pairs whose concatenation is a vocabulary piece, merge the one
   whose piece has the highest score (the leftmost on a tie), one pair at a
   time, until no adjacent pair forms a piece.
4. Byte fallback. A symbol that is not a piece (a character never seen in
   training: "Ž", an emoji, ...) is written as its UTF-8 bytes, one `<0xNN>`
   token per byte (`<unk>` only if the vocabulary lacks byte tokens).

The stage reads the vocabulary through `SentencePieceVocabulary` (the pieces,
their scores, the literal tokens); `stagewise.tokenizer.Tokenizer` is one, and
decoding ("▁" -> " ", `<0xNN>` runs -> bytes, the dummy prefix dropped) lives
there too (`tokenizer/sentencepiece.py`, `tokenizer/decode.py`).

The `triton` tier (Rust) builds a Rust `tokenizers` BPE model with `byte_fallback`
from the same vocabulary. Rust BPE needs a merge list, so `merges_from_scores`
writes one (every split of every piece into two pieces, ordered by the piece's
score, as transformers' converter does). One difference remains by design: when
two *different* pairs form pieces of *equal* score, sentencepiece merges the
leftmost and Rust the lower-ranked; real vocabularies give every piece its own
score, so this does not arise there.
"""

from typing import Protocol

import regex
import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from stagewise.errors import StagewiseError
from stagewise.stages.pre_tokenizers import split_special_tokens

SPACE = "\u2581"  # "▁", SentencePiece's visible space
# Where the dummy-prefix "▁" goes:
SPACE_PREFIXES = {
    "sentencepiece": "before every text chunk (sentencepiece, llama.cpp, HF's legacy Prepend)",
    "metaspace-always": "before every text chunk not already starting with a space (HF Metaspace)",
    "metaspace-first": "before the first chunk, unless it starts with a space (Metaspace 'first')",
    "none": "never (add_space_prefix = false)",
}


class SentencePieceVocabulary(Protocol):
    """What this stage reads from a tokenizer; `stagewise.tokenizer.Tokenizer` is one."""

    tokens: list[str]  # id -> piece: "▁the", "<0x0A>", "<s>"
    # a tokenizer.json's merge list, or [] (the Rust path derives one)
    merges: list[tuple[str, str]]
    special_tokens: dict[str, int]  # literal tokens, matched in the text before BPE -> id
    bos_id: int | None  # beginning-of-sequence id
    add_bos: bool  # prepend bos_id when encoding
    unk_id: int | None  # <unk>, for characters without byte tokens
    space_prefix: str  # where the dummy "▁" goes: a key of SPACE_PREFIXES
    token_to_id: dict[str, int]  # token -> id
    sp_scores: dict[str, float]  # the pieces a merge may build -> score (higher merges first)
    sp_pieces: dict[str, int]  # normal pieces -> id (a symbol outside falls back to bytes)
    sp_space_inside_pieces: bool  # does some piece hold "▁" after another character?
    bpe_cache: dict[str, list[int]]  # word -> ids, filled by `naive`
    rust: tokenizers.Tokenizer  # what `triton` runs, built once by `build_rust_tokenizer`


def byte_token(byte: int) -> str:
    """The fallback token of one byte: 0x0A -> "<0x0A>"."""
    return f"<0x{byte:02X}>"


def byte_value(token: str) -> int | None:
    """Inverse of `byte_token` ("<0x0A>" -> 10), None for any other token."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def add_space_prefix(chunk: str, scheme: str, at_input_start: bool) -> str:
    """Spell one text chunk the SentencePiece way: dummy prefix, then every " " -> "▁"."""
    if scheme not in SPACE_PREFIXES:
        raise StagewiseError(f"unknown space prefix '{scheme}'; known: {', '.join(SPACE_PREFIXES)}")
    prefix = scheme == "sentencepiece" or (
        scheme.startswith("metaspace")
        and not chunk.startswith(" ")
        and (scheme.endswith("always") or at_input_start)
    )
    return (" " + chunk if prefix else chunk).replace(" ", SPACE)  # "Hello world" -> "▁Hello▁world"


def merge_by_score(symbols: list[str], scores: dict[str, float]) -> list[str]:
    """SentencePiece BPE on one chunk: merge the adjacent pair that forms the best piece, repeat.

    O(n^2) in the chunk length, written for reading; the Rust path does it with a priority queue.
    """
    symbols = list(symbols)
    while True:
        best, best_score = None, None
        for i in range(len(symbols) - 1):
            score = scores.get(symbols[i] + symbols[i + 1])  # None: the pair forms no piece
            # ">" rather than ">=": the leftmost pair wins a tie
            if score is not None and (best_score is None or score > best_score):
                best, best_score = i, score
        if best is None:
            return symbols
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]  # "▁", "t" -> "▁t"


def split_words(spelled: str, space_inside_pieces: bool) -> list[str]:
    """Cut "▁the▁cat" into "▁the", "▁cat" when no merge can cross the cut (a shortcut, not a rule).

    Merging is one pass over the whole chunk, O(n^2) here. But if no vocabulary piece holds
    "▁" after another character (sentencepiece's default `split_by_whitespace` training never
    makes one), no merge can join the "t" of "▁the" to the "▁" of "▁cat", so each word merges
    on its own, to the same result, and words repeat (cached). Otherwise: one word.
    """
    if space_inside_pieces:
        return [spelled]
    return [word for word in regex.split(f"(?<=[^{SPACE}])(?={SPACE})", spelled) if word]


def symbols_to_ids(symbols: list[str], tokenizer: SentencePieceVocabulary) -> list[int]:
    """Merged symbols -> ids; a symbol that is no piece falls back to one `<0xNN>` per byte."""
    pieces, ids = tokenizer.sp_pieces, []
    for symbol in symbols:
        if symbol in pieces:
            ids.append(pieces[symbol])
            continue
        byte_ids = [tokenizer.token_to_id.get(byte_token(byte)) for byte in symbol.encode("utf-8")]
        if None not in byte_ids:
            ids.extend(byte_ids)  # "Ž" -> b"\xc5\xbd" -> <0xC5>, <0xBD>
        elif tokenizer.unk_id is None:
            raise StagewiseError(f"cannot encode {symbol!r}: no byte tokens and no unknown token")
        elif not ids or ids[-1] != tokenizer.unk_id:  # a run of unknown characters is one <unk>
            ids.append(tokenizer.unk_id)
    return ids


def naive(
    text: str, tokenizer: SentencePieceVocabulary, add_special_tokens: bool = True
) -> torch.Tensor:
    """Pure Python: literal tokens, "▁" and the dummy prefix, merge by score, byte fallback."""
    ids = [tokenizer.bos_id] if tokenizer.add_bos and add_special_tokens else []
    at_input_start = True
    # the same literal-token split as byte-level BPE
    for chunk, is_literal in split_special_tokens(text, tokenizer.special_tokens):
        if is_literal:
            ids.append(tokenizer.special_tokens[chunk])
        else:
            spelled = add_space_prefix(chunk, tokenizer.space_prefix, at_input_start)
            for word in split_words(spelled, tokenizer.sp_space_inside_pieces):
                cache = tokenizer.bpe_cache
                if word not in cache:
                    cache[word] = symbols_to_ids(
                        merge_by_score(list(word), tokenizer.sp_scores), tokenizer
                    )
                ids.extend(cache[word])
        at_input_start = False
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens]


def merges_from_scores(tokenizer: SentencePieceVocabulary) -> list[tuple[str, str]]:
    """A merge list equivalent to score order: every way to split each piece into two pieces.

    Ordered by the merged piece's score (highest first), then the shorter left part first,
    as transformers' `generate_merges` orders them.
    """
    scores = tokenizer.sp_scores
    candidates = []
    for piece, score in scores.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in tokenizer.sp_pieces and right in tokenizer.sp_pieces:
                candidates.append((-score, len(left), len(right), left, right))
    candidates.sort(key=lambda c: c[:3])  # stable: ties keep vocabulary order
    return [(left, right) for *_, left, right in candidates]


def build_rust_tokenizer(tokenizer: SentencePieceVocabulary) -> tokenizers.Tokenizer:
    """Rust `tokenizers`: BPE with byte fallback over the same vocabulary, "▁", literal tokens."""
    vocab = {token: token_id for token_id, token in enumerate(tokenizer.tokens)}
    merges = list(tokenizer.merges) or merges_from_scores(tokenizer)
    unk = tokenizer.tokens[tokenizer.unk_id] if tokenizer.unk_id is not None else None
    rust = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    scheme = tokenizer.space_prefix
    if scheme == "sentencepiece":
        rust.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    elif scheme == "none":
        rust.normalizer = normalizers.Replace(" ", SPACE)
    else:
        prepend = scheme.removeprefix("metaspace-")
        rust.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme=prepend, split=False
        )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    rust.decoder = decoders.Sequence(
        steps + ([decoders.Strip(" ", 1, 0)] if scheme != "none" else [])
    )
    literal = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    rust.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, _ in literal]
    )
    if tokenizer.add_bos:
        bos = tokenizer.tokens[tokenizer.bos_id]
        rust.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
    return rust


def triton(
    text: str, tokenizer: SentencePieceVocabulary, add_special_tokens: bool = True
) -> torch.Tensor:
    """The Rust `tokenizers` library, built once from the same vocabulary."""
    ids = tokenizer.rust.encode(text, add_special_tokens=add_special_tokens).ids
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens]
