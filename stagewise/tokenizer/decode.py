"""Streaming detokenization: ids in one at a time, text out as soon as it is final."""

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagewise.models.tokenizer import Tokenizer


class IncrementalDecoder:
    """Streaming detokenizer: feed ids one at a time, get the text each one completes.

    A token can end in the middle of a multi-byte UTF-8 character (an emoji is
    often split over several byte tokens); those bytes are held back until the
    character is complete. Python's incremental UTF-8 decoder does that and
    replaces invalid bytes the same way `bytes.decode` does (SentencePiece's
    `<0xNN>` tokens are such bytes too). A SentencePiece decoder also drops one
    leading space, so the first character that comes out is checked once. The
    pieces (plus `finish()`) concatenate to exactly `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=tokenizer._utf8_errors)
        self._at_start = (
            tokenizer.strips_leading_space
        )  # the first character may be the dummy prefix

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is incomplete)."""
        return self._strip(
            self._utf8.decode(self.tokenizer._bytes_of([token_id], self.skip_special_tokens))
        )

    def finish(self) -> str:
        """End of stream: flush held-back bytes (an unfinished character becomes U+FFFD)."""
        return self._strip(self._utf8.decode(b"", final=True))

    def _strip(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            return text[1:] if text.startswith(" ") else text
        return text
