"""Old home of the BPE trainer (one release): it lives in `stagewise.tokenizer.train` now."""

from stagewise.tokenizer.train import TINY_CORPUS, merge_pair, train_bpe, train_vocabulary

__all__ = ["TINY_CORPUS", "merge_pair", "train_bpe", "train_vocabulary"]
