"""A small byte-level BPE trainer, for the `tiny` model's vocabulary.

Training is the mirror image of encoding (the `tokenize` stage, `stages/tokenize.py`):

1. Pre-tokenize the corpus with the same regexes the encoder will use, spell
   every piece in the byte alphabet (" the" -> "Ġthe") and count how often
   each piece occurs. Merges never cross piece boundaries, so the corpus is
   just a bag of pieces with counts.
2. Start every piece as a list of single characters (bytes).
3. Count every adjacent pair over all pieces, weighted by the piece count.
   The most frequent pair becomes the next merge (ties: the pair that sorts
   first, so training is deterministic). Fuse it in every piece, left to
   right, exactly as the encoder will.
4. Repeat until the vocabulary has the size we want.

The merge list is therefore in rank order: an encoder that always applies
the lowest-rank pair first replays training on new text.

This is the textbook algorithm: it recounts all pairs after every merge,
O(num_merges * corpus pieces). Real trainers update the counts incrementally;
for a few hundred merges on a few kilobytes it takes well under a second.
"""

from collections import Counter
from itertools import pairwise

from stagewise.errors import StagewiseError
from stagewise.stages.tokenize import bytes_to_unicode, pre_tokenize

# The built-in training text of the tiny vocabulary: plain English with some digits,
# contractions and punctuation, so the tiny model's merges look like a real model's.
TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog did not mind; it was a warm day and "
    "the sun was out.\n"
    "A language model reads text as a list of tokens. Each token is a number that stands for a "
    "piece of a word.\n"
    "Before the model can read anything, the text has to be cut into those pieces. That is the "
    "tokenizer's job.\n"
    "The tokenizer we use here is called byte pair encoding. It starts from single bytes and "
    "learns which pairs\n"
    "of pieces appear together most often, then it joins them into a new piece. After enough "
    "rounds, common words\n"
    'such as "the", "and" and "of" become single tokens, while rare words are spelled with '
    "several smaller ones.\n"
    "Once upon a time there was a small town by the sea. In the town there lived an old baker "
    "and his daughter.\n"
    "Every morning the baker got up at 4 o'clock and made bread, and every evening his daughter "
    "sold the last\n"
    "loaves in the market. People in the town said that it was the best bread in the world, and "
    "they were right.\n"
    'One day a stranger came to the market and asked for a loaf. "I don\'t have any money," he '
    'said, "but I can\n'
    'tell you a story." The daughter thought about it, and then she gave him the bread. He sat '
    "down and told her\n"
    "about the cities he had seen, the mountains he had climbed and the rivers he had crossed on "
    "his long walk.\n"
    "When he was done, the sun had gone down and the market was empty. She went home and told "
    "her father\n"
    'everything. The baker laughed and said, "Then you were paid well. A good story is worth '
    'more than bread."\n'
    "How does a computer add 12 and 30? It turns both numbers into bits, adds them, and gets 42 "
    "in the end.\n"
    "In 2024 people wrote about 3.5 million new pages every hour, and a model may read many of "
    "them in training.\n"
    "We'll see that the model doesn't know what a word is; it only sees numbers, and it learns "
    "what comes next.\n"
    "You're going to find that the attention layer lets each token look back at the tokens that "
    "came before it.\n"
    "The key and value vectors of those tokens are kept in a cache, so the model never has to "
    "compute them twice.\n"
    "This is why the first step, the prefill, is slow and heavy, while every later step only "
    "adds one new token.\n"
    "The teacher wrote the shapes of the tensors on the board, and the students followed them "
    "through each layer.\n"
    "They're learning how the numbers flow from the embedding table, through the norm and the "
    "attention heads,\n"
    "into the feed forward network, and out of the last layer as one score for every token in "
    "the vocabulary.\n"
    "Then the sampler picks the next token, the text grows by one piece, and the whole process "
    "starts again.\n"
    "It's a simple loop, but it has made machines that can write letters, answer questions and "
    "translate books.\n"
)


def train_bpe(corpus: str, num_new_tokens: int, pre: str = "smollm") -> list[tuple[str, str]]:
    """Learn merges on `corpus` until they have made `num_new_tokens` distinct new tokens.

    Returns the merges in rank order, each a pair of byte-alphabet strings ("Ġ", "t").
    """
    byte_map = bytes_to_unicode()
    spelled = (
        "".join(byte_map[b] for b in piece.encode("utf-8")) for piece in pre_tokenize(corpus, pre)
    )
    piece_counts = Counter(spelled)  # "Ġthe" -> how often the piece " the" occurs
    # "Ġthe" -> ("Ġ","t","h","e")
    words = {tuple(piece): count for piece, count in piece_counts.items()}
    known = set(byte_map.values())
    merges: list[tuple[str, str]] = []
    while len(known) - 256 < num_new_tokens:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in pairwise(symbols):
                pair_counts[pair] += count
        if not pair_counts:
            learned = len(known) - 256
            raise StagewiseError(
                f"corpus too small: only {learned} of {num_new_tokens} new tokens learned"
            )
        # most frequent, then sorted
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        merges.append(best)
        known.add(best[0] + best[1])
        words = {merge_pair(symbols, best): count for symbols, count in words.items()}
    return merges


def train_vocabulary(
    corpus: str, special_tokens: list[str], vocab_size: int, pre: str = "smollm"
) -> tuple[list[str], list[tuple[str, str]]]:
    """A vocabulary of `vocab_size` tokens: special tokens, the 256 bytes, then learned merges.

    Returns (tokens, merges); token ids are list positions, so byte b has id
    len(special_tokens) + b.
    """
    byte_tokens = [bytes_to_unicode()[byte] for byte in range(256)]
    tokens = special_tokens + byte_tokens
    merges = train_bpe(corpus, vocab_size - len(tokens), pre)
    for left, right in merges:
        if left + right not in tokens:  # a merge may re-create a token another merge already made
            tokens.append(left + right)
    return tokens, merges


def merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """Fuse every occurrence of `pair` in `symbols`, left to right, without overlaps."""
    fused, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            fused.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            fused.append(symbols[i])
            i += 1
    return tuple(fused)
