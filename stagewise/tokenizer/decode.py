"""Ids -> text: every token's bytes, joined and read as UTF-8, at once or one id at a time.

A token stands for bytes, not characters: a byte-level token spells its bytes
in GPT-2's printable alphabet ("Ġ" is the space byte), a SentencePiece
`<0xNN>` token is one byte. So decoding joins the bytes of all ids, then reads
UTF-8; a byte sequence that is no character becomes U+FFFD. Streaming
(`IncrementalDecoder`) must hold back the bytes of a character cut in two by a
token boundary (an emoji is often four byte tokens) until it is complete.
"""

import codecs
import functools
from collections.abc import Callable

from stagewise.stages.tokenize import bytes_to_unicode

PER_BYTE_ERRORS = "stagewise-per-byte"  # decode error handler: one U+FFFD per invalid byte


def _one_replacement_per_byte(err: UnicodeDecodeError) -> tuple[str, int]:
    return "\ufffd" * (err.end - err.start), err.end


@functools.cache
def _register_per_byte_errors() -> str:
    codecs.register_error(PER_BYTE_ERRORS, _one_replacement_per_byte)
    return PER_BYTE_ERRORS


def utf8_errors(per_byte: bool) -> str:
    """The `errors=` of `bytes.decode`: "replace" writes one U+FFFD per broken sequence (as the
    Rust library), the per-byte handler one per invalid byte (as sentencepiece); it is
    registered with `codecs` on first use."""
    return _register_per_byte_errors() if per_byte else "replace"


def byte_level_token_bytes(tokens: list[str], special_ids: set[int]) -> list[bytes]:
    """id -> bytes of a byte-level vocabulary: "Ġthe" -> b" the"; a special token is its text."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    return [
        token.encode("utf-8")
        if token_id in special_ids
        else b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in token)
        for token_id, token in enumerate(tokens)
    ]


class IncrementalDecoder:
    """Streaming detokenizer: feed ids one at a time, get the text each one completes.

    A token can end in the middle of a multi-byte UTF-8 character (an emoji is
    often split over several byte tokens); those bytes are held back until the
    character is complete. Python's incremental UTF-8 decoder does that and
    replaces invalid bytes the same way `bytes.decode` does (SentencePiece's
    `<0xNN>` tokens are such bytes too). A SentencePiece decoder also drops one
    leading space, so the first character that comes out is checked once. The
    pieces (plus `finish()`) concatenate to exactly `tokenizer.decode(all_ids)`;
    `Tokenizer.incremental_decoder()` builds one.
    """

    def __init__(
        self, bytes_of: Callable[[list[int]], bytes], errors: str, strips_leading_space: bool
    ) -> None:
        self.bytes_of = bytes_of  # ids -> their bytes (the tokenizer's, skipping what it skips)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=errors)
        self._at_start = strips_leading_space  # the first character may be the dummy prefix

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is incomplete)."""
        return self._strip(self._utf8.decode(self.bytes_of([token_id])))

    def finish(self) -> str:
        """End of stream: flush held-back bytes (an unfinished character becomes U+FFFD)."""
        return self._strip(self._utf8.decode(b"", final=True))

    def _strip(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            return text[1:] if text.startswith(" ") else text
        return text
