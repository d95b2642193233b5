"""SentencePiece vocabularies: the token types, and the tables encoding and decoding read.

A SentencePiece model gives every piece a type, numbered as in sentencepiece's
model proto and llama.cpp's GGUF `tokenizer.ggml.token_type`. Normal pieces
are what merges build; unknown, control and user-defined tokens are matched
literally in the text before BPE; byte pieces (`<0x0A>`) are the fallback for
a character no piece spells. Encoding is the `tokenize` stage
(`stages/tokenize_sentencepiece.py`); the file readers are in
`stagewise.models.sentencepiece_files`.
"""

from collections.abc import Iterable

from stagewise.stages.tokenize_sentencepiece import SPACE, byte_value

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
LITERAL_TYPES = (UNKNOWN, CONTROL, USER_DEFINED)  # matched in the raw text before BPE (llama.cpp)


def literal_tokens(tokens: list[str], types: list[int]) -> dict[str, int]:
    """The tokens matched literally before BPE -> id."""
    pairs = enumerate(zip(tokens, types, strict=True))
    return {token: i for i, (token, kind) in pairs if kind in LITERAL_TYPES}


def mergeable_scores(tokens: list[str], scores: list[float], types: list[int]) -> dict[str, float]:
    """The pieces a merge may build (normal tokens with a finite score) -> score."""
    triples = zip(tokens, scores, types, strict=True)
    return {t: score for t, score, kind in triples if kind == NORMAL and score != float("-inf")}


def normal_pieces(tokens: list[str], types: list[int]) -> dict[str, int]:
    """Normal pieces -> id (a merged symbol outside this map falls back to bytes)."""
    return {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}


def space_inside_pieces(pieces: Iterable[str]) -> bool:
    """Does some piece hold "▁" after another character ("a▁b", "end▁")?"""
    return any(SPACE in piece.lstrip(SPACE) for piece in pieces)


def token_bytes(tokens: list[str], token_types: list[int]) -> list[bytes]:
    """id -> the bytes it decodes to: `<0xNN>` -> one byte, any other token -> its text with
    "▁" -> " "."""
    out = []
    for token, kind in zip(tokens, token_types, strict=True):
        value = byte_value(token) if kind == BYTE else None
        text = token.replace(SPACE, " ").encode("utf-8")
        out.append(bytes([value]) if value is not None else text)
    return out
