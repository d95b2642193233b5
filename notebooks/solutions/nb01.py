"""Solutions to the exercises of notebook 01 (tokenize)."""

from collections import Counter
from itertools import pairwise

from stagewise.stages.tokenize import bytes_to_unicode, pre_tokenize


def my_bpe_merge(symbols: list[str], merge_ranks: dict) -> list[str]:
    symbols = list(symbols)
    while len(symbols) > 1:
        ranked = [(merge_ranks[p], i) for i, p in enumerate(pairwise(symbols)) if p in merge_ranks]
        if not ranked:
            break
        best = symbols[min(ranked)[1]], symbols[min(ranked)[1] + 1]
        merged, i = [], 0
        while i < len(symbols):  # fuse every occurrence of the best pair, left to right
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def my_piece_to_ids(piece: str, tokenizer) -> list[int]:
    byte_map = bytes_to_unicode()
    letters = [byte_map[b] for b in piece.encode("utf-8")]
    letters = [c for c in letters if c in tokenizer.token_to_id]  # bytes with no token of their own are dropped
    return [tokenizer.token_to_id[s] for s in my_bpe_merge(letters, tokenizer.merge_ranks)]


def my_first_merge(corpus: str) -> tuple[str, str]:
    byte_map = bytes_to_unicode()
    counts = Counter("".join(byte_map[b] for b in piece.encode("utf-8")) for piece in pre_tokenize(corpus, "smollm"))
    pairs = Counter()
    for word, count in counts.items():
        for pair in pairwise(word):
            pairs[pair] += count
    return min(pairs, key=lambda pair: (-pairs[pair], pair))  # most frequent; ties: the smaller pair


SOLUTIONS = {"01.bpe_merge": my_bpe_merge, "01.piece_to_ids": my_piece_to_ids, "01.first_merge": my_first_merge}
