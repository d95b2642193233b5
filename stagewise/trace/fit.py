"""Tables that fit the terminal: fewer columns per table, never a cut number.

A Rich `Table` squeezed into a narrow terminal (a projector at 80 columns) first
wraps its cells, then cuts them with an ellipsis: `1.41e…`, `compute-…`. For a
table of numbers that is the one thing it must not do. `FitTable` decides at
render time, from the width it is given:

- every number column is at least as wide as its widest cell, so a number is
  never wrapped or cut (long headers wrap onto two lines instead);
- text columns (`wrap=True`) may wrap, down to their `min_width` or their longest
  piece: a line breaks at a space, or after a `/` or `-` inside a long word
  (`position-` / `dependent`), never in the middle of a word;
- when all columns cannot fit side by side, the table is split into several
  tables that share the key columns (the first `keys`): fewer columns, same rows.

Every cell is a `Text`, never markup: `[num_tokens]` would otherwise be read as
a style tag and vanish.

    FitTable("One step", [Col("step"), Col("FLOPs", "right"), Col("note", wrap=True)], rows, keys=1)
"""

import re
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Col:
    header: str
    justify: str = "left"  # "left" or "right" (numbers)
    wrap: bool = False  # text that may wrap onto several lines; a number column never wraps
    min_width: int = 12  # narrowest a wrapping column may get


def _cell_text(cell) -> Text:
    return cell if isinstance(cell, Text) else Text(str(cell))


def _widest_line(text: Text) -> int:
    return max((len(line) for line in text.plain.split("\n")), default=0)


# A piece a line may end after: a run of non-spaces up to and including a `/` or `-` that another
# non-space follows, or up to the next space; with the spaces after it.
_PIECE = re.compile(r"[^\s]+?(?:[/-](?=[^\s/-])|(?=\s)|$)\s*|\s+")


def _pieces(line: str) -> list[str]:
    return _PIECE.findall(line)


def _longest_piece(text: Text) -> int:
    return max((len(p.rstrip()) for line in text.plain.split("\n") for p in _pieces(line)), default=0)


def _wrap(text: Text, width: int) -> Text:
    """`text` with line breaks so that no line is wider than `width`, broken between pieces (see
    `_PIECE`); a piece wider than `width` alone is cut only then (a column is never narrower than its
    longest piece, so that does not happen in a FitTable). Styles are kept."""
    lines = []
    for line in text.split("\n", allow_blank=True):
        offsets, used, pos = [], 0, 0
        for piece in _pieces(line.plain):
            size = len(piece.rstrip())
            if used and used + size > width:
                offsets.append(pos)
                used = 0
            while size > width:  # one piece wider than the column: cut it (the only mid-word break)
                pos += width
                offsets.append(pos)
                size -= width
                piece = piece[width:]
            used += len(piece)
            pos += len(piece)
        lines.extend(part.rstrip() or part for part in line.divide(offsets)) if offsets else lines.append(line)
    return Text("\n").join(lines)


def _need(col: Col, cells: list[Text]) -> int:
    """Narrowest width of a column: the widest cell of a number column; for text, `min_width`, but
    never below its longest piece (a word is not cut)."""
    longest_word = max((len(w) for w in col.header.split()), default=1)
    widest = max((_widest_line(c) for c in cells), default=0)
    if col.wrap:
        return max(longest_word, min(col.min_width, widest), max((_longest_piece(c) for c in cells), default=0))
    return max(longest_word, widest)


def table_width(needs: list[int]) -> int:
    """Width of a boxed table with padding 1: each column adds its borders and padding (3), plus one edge."""
    return sum(needs) + 3 * len(needs) + 1


class FitTable:
    """A table of `rows` (lists of str or Text) that splits its columns to fit the width it renders at."""

    def __init__(self, title: str | None, cols: list[Col], rows: list[list], keys: int = 1, caption=None):
        self.title, self.cols, self.keys, self.caption = title, cols, keys, caption
        self.rows = [[_cell_text(c) for c in row] for row in rows]

    def groups(self, width: int) -> list[list[int]]:
        """Column indices of each table: the key columns, then as many others as fit beside them."""
        needs = [_need(col, [row[i] for row in self.rows]) for i, col in enumerate(self.cols)]
        keys = list(range(min(self.keys, len(self.cols))))
        groups: list[list[int]] = []
        current: list[int] = []
        for i in range(len(keys), len(self.cols)):
            if current and table_width([needs[j] for j in keys + current + [i]]) > width:
                groups.append(current)
                current = []
            current.append(i)
        if current or not groups:
            groups.append(current)
        return [keys + group for group in groups]

    def widths(self, group: list[int], width: int) -> dict[int, int]:
        """Column widths of one table: numbers at their need, text columns share what is left (water-filling:
        the narrowest text column gets its natural width first). Rich's own squeezing could cut a number."""
        needs = {i: _need(self.cols[i], [row[i] for row in self.rows]) for i in group}
        texts = [i for i in group if self.cols[i].wrap]
        natural = {i: max(needs[i], len(self.cols[i].header), *(_widest_line(r[i]) for r in self.rows)) for i in texts}
        spare = width - table_width(list(needs.values()))
        for n, i in enumerate(sorted(texts, key=lambda i: natural[i])):
            share = max(0, spare // (len(texts) - n))
            extra = min(natural[i] - needs[i], share)
            needs[i] += extra
            spare -= extra
        return needs

    def tables(self, width: int) -> list[Table]:
        groups = self.groups(width)
        out = []
        for n, group in enumerate(groups):
            title = None if self.title is None else Text(self.title if n == 0 else f"{self.title} (continued)")
            last = n == len(groups) - 1
            caption = self.caption if last else None
            table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
            widths = self.widths(group, width)
            for i in group:
                col = self.cols[i]
                # fixed widths: a number column is exactly as wide as its widest cell and never wraps (its
                # header may); a text column wraps at its width
                header = Text(col.header, no_wrap=False)
                table.add_column(header, justify=col.justify, overflow="fold", width=widths[i], no_wrap=not col.wrap)
            for row in self.rows:  # text columns wrapped here, between pieces (Rich would cut words)
                table.add_row(*(_wrap(row[i], widths[i]) if self.cols[i].wrap else row[i] for i in group))
            out.append(table)
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.tables(options.max_width)
