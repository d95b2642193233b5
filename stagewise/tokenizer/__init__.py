"""Tokenizers: a model's vocabulary, and text <-> token ids.

    vocabulary.py     `Tokenizer`: tokens, merges or scores, special tokens, encode, decode,
                      stop ids, `Tokenizer.tiny()`
    train.py          byte-level BPE training (the tiny vocabulary, `TINY_CORPUS`)
    sentencepiece.py  SentencePiece token types and the tables built from them
    decode.py         ids -> bytes -> text, at once or streaming (`IncrementalDecoder`)

Encoding itself is the `tokenize` stage (`stagewise.stages.tokenize`, one layer
down); reading a model's tokenizer files and rendering chat templates happen in
`stagewise.models` (`tokenizer_files`, `chat_template`), one layer up.
"""

from stagewise.tokenizer.vocabulary import Tokenizer

__all__ = ["Tokenizer"]
