"""Turn a growing list of token ids into streamed text, honouring stop strings.

Byte-level BPE tokens are byte sequences: one emoji can span several tokens,
and a stop string can span several tokens too. `TextStream` decodes the whole
output each time (simple and exact), emits only text that can no longer
change — complete UTF-8 characters, and nothing that could still turn out to
be the start of a stop string — and cuts the output at the first stop string,
which is not included in the returned text (as in vLLM).
"""

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 tail decodes to


@dataclass
class TextStream:
    decode: object  # callable: list[int] -> str (special tokens skipped)
    stop: tuple[str, ...] = ()  # stop strings
    text: str = ""  # the output text so far, cut at a stop string once one is found
    emitted: int = 0  # characters of `text` already handed out
    stopped_by: str | None = None  # the stop string that ended the output, if any
    _ids: list[int] = field(default_factory=list)

    def push(self, token_id: int, final: bool = False) -> str:
        """Add one token; return the newly settled text (possibly empty)."""
        self._ids.append(token_id)
        text = self.decode(self._ids)
        if not final and text.endswith(REPLACEMENT):
            text = text.rstrip(REPLACEMENT)  # an incomplete character: wait for its other bytes
        hit = self._find_stop(text)
        if hit is not None:
            cut, self.stopped_by = hit
            text = text[:cut]
        self.text = text
        return self._settle(final or self.stopped_by is not None)

    def finish(self) -> str:
        """Release everything held back (the request ended)."""
        return self._settle(final=True)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in the text. When two complete on the same token ("x" + "ab"
        with stop ("b", "a")), the earlier one in the text wins ("a": text "x"); vLLM tries them in
        list order ("b": "xa")."""
        best = None
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _settle(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop:
            end -= self._held_back(end)  # a tail that may still become a stop string
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self, end: int) -> int:
        """Characters at the end of text[emitted:end] that are a prefix of some stop string.

        For each stop string, only the places where its first character occurs in the last
        len(stop) - 1 characters are tried (str.find, in C), the leftmost first: the cost per
        token is about the total length of the stop strings, not that times their count.
        """
        held = 0
        for s in self.stop:
            window = min(len(s) - 1, end - self.emitted)
            i = self.text.find(s[0], end - window, end) if window > held else -1
            while i != -1 and end - i > held:
                if s.startswith(self.text[i:end]):
                    held = end - i
                    break
                i = self.text.find(s[0], i + 1, end)
        return held
