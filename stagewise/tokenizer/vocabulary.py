"""The `Tokenizer`: a model's vocabulary, its special tokens, and text <-> ids.

Two kinds of vocabulary, named as llama.cpp's `tokenizer.ggml.model` names them:

- "gpt2": GPT-2 style byte-level BPE (SmolLM2, Llama 3): token strings in a
  byte alphabet, merges in rank order, a regex pre-tokenizer.
- "llama": SentencePiece BPE (Llama 1/2, TinyLlama, Mistral): "▁" for spaces,
  a score per piece (merges by score), `<0xNN>` byte-fallback tokens.

`Tokenizer` holds what a model ships (tokens, merges or scores, literal tokens,
bos/eos, the chat template) and turns ids back into text (`decode.py`).
Encoding is the `tokenize` stage (`stages/tokenize.py`,
`stages/tokenize_sentencepiece.py`): `encode` only picks its naive or fast path,
and the lookups the stage reads (`token_to_id`, `merge_ranks`, the Rust
tokenizer, ...) are built here on first use.

Sources: `tiny()`, a 512-token byte-level vocabulary trained on a built-in
corpus for the tiny test model (`train.py`), or a model's files, read in
`stagewise.models.tokenizer_files` (a GGUF's `tokenizer.ggml.*` metadata, a
Hugging Face directory). Chat templates are rendered in
`stagewise.models.chat_template`.
"""

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, replace

import tokenizers

from stagewise.config import PRESETS
from stagewise.errors import StagewiseError
from stagewise.stages import tokenize as tokenize_stage
from stagewise.stages.pre_tokenizers import canonical_pre_name
from stagewise.stages.tokenize_sentencepiece import SPACE_PREFIXES
from stagewise.tokenizer import sentencepiece, train
from stagewise.tokenizer.decode import IncrementalDecoder, byte_level_token_bytes, utf8_errors

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE (llama.cpp's names)
# `encode(backend=...)` -> the tokenize stage's path: pure Python, or the Rust `tokenizers` library
ENCODE_BACKENDS = {"naive": tokenize_stage.naive, "fast": tokenize_stage.triton}
# SmolLM2-Instruct's ChatML template, as its GGUF stores it (`tokenizer.chat_template`); the tiny
# vocabulary carries it too. `stagewise.models.chat_template` renders templates.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(eq=False, repr=False)
class Tokenizer:
    """A byte-level or SentencePiece BPE vocabulary and what goes with it; `encode` runs the
    tokenize stage."""

    # id -> token: byte alphabet ("Ġthe") or SentencePiece ("▁the", "<0x0A>"); specials as written
    tokens: list[str]
    merges: list[tuple[str, str]]  # BPE merges in rank order (SentencePiece: [] = from the scores)
    special_tokens: dict[str, int]  # tokens matched literally in the text before BPE -> id
    bos_id: int | None  # beginning-of-sequence id
    eos_id: int | None  # end-of-sequence id; generation stops on it
    pad_id: int | None = None  # padding id, if the model names one
    chat_template: str | None = None  # jinja2 template that renders a chat into one prompt string
    chat_template_file: str | None = None  # where the template was read, named in its errors
    # pre-tokenizer name (llama.cpp's), canonicalised to a key of `PRE_TOKENIZERS`
    pre: str = "gpt2"
    # prepend bos_id when encoding (SmolLM2: False, its template writes the markers)
    add_bos: bool = False
    ignore_merges: bool = False  # Llama 3: a piece that is already a token skips the merges
    model: str = "gpt2"  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    # llama: id -> piece score; the best-scoring pair merges first
    scores: list[float] | None = None
    # llama: id -> 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte (`sentencepiece.py`)
    token_types: list[int] | None = None
    unk_id: int | None = None  # llama: the <unk> id, for characters without byte tokens
    space_prefix: str = "sentencepiece"  # llama: where the dummy "▁" goes (SPACE_PREFIXES)
    # a model with more embedding rows than tokens: ids past the tokens have no text
    embedding_rows: int | None = None
    # More ids that end generation besides eos_id: generation_config.json's eos_token_id list
    # (Llama 3.1+: <|end_of_text|>, <|eom_id|>, <|eot_id|>), a GGUF's eot / eom token ids.
    extra_eos_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:  # the dataclass default would print all 49152 tokens
        return (
            f"Tokenizer(model={self.model!r}, vocab_size={self.vocab_size}, "
            f"merges={len(self.merges)}, pre={self.pre!r}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, add_bos={self.add_bos})"
        )

    def __post_init__(self) -> None:
        if self.model not in TOKENIZER_MODELS:
            known = ", ".join(TOKENIZER_MODELS)
            raise StagewiseError(f"tokenizer model '{self.model}' is not supported; known: {known}")
        if self.model == "llama" and (self.scores is None or self.token_types is None):
            raise StagewiseError("a SentencePiece ('llama') tokenizer needs scores and token types")
        if self.model == "llama" and self.space_prefix not in SPACE_PREFIXES:
            known = ", ".join(SPACE_PREFIXES)
            raise StagewiseError(f"unknown space prefix '{self.space_prefix}'; known: {known}")
        self.pre = canonical_pre_name(self.pre)  # llama.cpp's other spellings ("gpt-2") -> "gpt2"
        for name in ("bos_id", "eos_id", "pad_id", "unk_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < len(self.tokens):
                raise StagewiseError(
                    f"{name} {value} is outside the vocabulary of {len(self.tokens)} tokens"
                )
        self.extra_eos_ids = checked_eos_ids(self.extra_eos_ids, len(self.tokens), "extra_eos_ids")
        if self.add_bos and self.bos_id is None:
            raise StagewiseError("add_bos is set but the tokenizer has no bos token")

    @classmethod
    def tiny(cls) -> "Tokenizer":
        """The tiny model's 512-token vocabulary (trained once per process): a new Tokenizer each
        call, so setting one's `chat_template` leaves the others as they were."""
        return _tiny_tokenizer()

    @classmethod
    def synthetic(cls, vocab_size: int) -> "Tokenizer":
        """The tiny vocabulary padded to `vocab_size` with filler tokens, for random-weight models.

        A model with random weights samples any id of its vocabulary; each filler id decodes to
        its own visible text (`<|synthetic_50000|>`), so outputs stay printable. Encoding never
        produces a filler token (no merge leads to one): prompts use the tiny vocabulary.
        """
        base = _tiny_tokenizer()
        if vocab_size < base.vocab_size:
            raise StagewiseError(
                f"a synthetic vocabulary needs >= {base.vocab_size} tokens, got {vocab_size}"
            )
        fillers = [f"<|synthetic_{i}|>" for i in range(base.vocab_size, vocab_size)]
        return dataclasses.replace(base, tokens=base.tokens + fillers)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos_id and the extra end-of-sequence ids."""
        return frozenset(([] if self.eos_id is None else [self.eos_id]) + list(self.extra_eos_ids))

    # ---- derived lookups, built on first use ---------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def token_to_id(self) -> dict[str, int]:
        return {token: token_id for token_id, token in enumerate(self.tokens)}

    @functools.cached_property
    def merge_ranks(self) -> dict[tuple[str, str], int]:
        return {pair: rank for rank, pair in enumerate(self.merges)}

    @functools.cached_property
    def bpe_cache(self) -> dict[str, list[int]]:
        return {}  # pre-tokenized piece -> ids, filled by the naive stage

    @functools.cached_property
    def sp_scores(self) -> dict[str, float]:
        """llama: the pieces a merge may build (normal tokens with a finite score) -> score."""
        return sentencepiece.mergeable_scores(self.tokens, self.scores, self.token_types)

    @functools.cached_property
    def sp_space_inside_pieces(self) -> bool:
        """llama: does some mergeable piece hold "▁" after another character ("a▁b", "end▁")?"""
        return sentencepiece.space_inside_pieces(self.sp_scores)

    @functools.cached_property
    def sp_pieces(self) -> dict[str, int]:
        """llama: normal pieces -> id (a merged symbol outside this map falls back to bytes)."""
        return sentencepiece.normal_pieces(self.tokens, self.token_types)

    @functools.cached_property
    def rust(self) -> tokenizers.Tokenizer:
        return tokenize_stage.build_rust_tokenizer(self)  # the fast path's engine

    @functools.cached_property
    def plain_text(self) -> "Tokenizer":
        """The same vocabulary reading every character as text: no control tokens, no bos (for
        user content)."""
        return replace(self, special_tokens={}, add_bos=False)

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """id -> the bytes the token stands for (special tokens: their UTF-8 text)."""
        if self.model == "llama":
            return sentencepiece.token_bytes(self.tokens, self.token_types)
        return byte_level_token_bytes(self.tokens, set(self.special_tokens.values()))

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """Ids `skip_special_tokens` drops: the literal tokens (SentencePiece: control and unknown
        only, its user-defined tokens are text, as transformers treats them)."""
        if self.model == "llama":
            skipped = (sentencepiece.CONTROL, sentencepiece.UNKNOWN)
            return frozenset(
                i for i in self.special_tokens.values() if self.token_types[i] in skipped
            )
        return frozenset(self.special_tokens.values())

    # ---- text <-> ids --------------------------------------------------------------------

    def encode(
        self, text: str, backend: str = "naive", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`: backend "naive" (pure Python) or "fast" (Rust `tokenizers`).

        `add_special_tokens=False`: no bos even if the model adds one (text from a chat template).
        """
        if backend not in ENCODE_BACKENDS:
            raise StagewiseError(f"unknown tokenizer backend '{backend}'; use naive or fast")
        path = ENCODE_BACKENDS[backend]
        return path(text=text, tokenizer=self, add_special_tokens=add_special_tokens).tolist()

    @property
    def utf8_errors(self) -> str:
        """How invalid UTF-8 reads: byte-level BPE one U+FFFD per broken sequence (as the Rust
        library), SentencePiece one per byte (as sentencepiece)."""
        return utf8_errors(per_byte=self.model == "llama")

    @property
    def strips_leading_space(self) -> bool:
        """SentencePiece decoders drop the dummy prefix: one space at the start of the text."""
        return self.model == "llama" and self.space_prefix != "none"

    def decode(
        self, ids: Iterable[int], skip_special_tokens: bool = False, continuation: bool = False
    ) -> str:
        """Text of `ids`: join the tokens' bytes, decode UTF-8 (broken bytes become U+FFFD), drop
        a dummy prefix.

        `continuation`: the ids continue a text (a generated output after its prompt), so a
        leading SentencePiece space is a real space between the prompt's last word and the
        output's first, kept as vLLM keeps it (it decodes the output after the prompt's last
        tokens and subtracts their text).
        """
        text = self.bytes_of(ids, skip_special_tokens).decode("utf-8", errors=self.utf8_errors)
        strip = self.strips_leading_space and not continuation
        return text[1:] if strip and text.startswith(" ") else text

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A streaming decoder: ids in one at a time, text out once it is final."""
        return IncrementalDecoder(
            bytes_of=functools.partial(self.bytes_of, skip_special_tokens=skip_special_tokens),
            errors=self.utf8_errors,
            strips_leading_space=self.strips_leading_space,
        )

    def bytes_of(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The bytes `ids` stand for, joined (UTF-8 that may be broken or cut mid-character)."""
        skipped = self.skipped_ids if skip_special_tokens else frozenset()
        table = self.token_bytes
        out = []
        for token_id in ids:
            token_id = int(token_id)
            if not 0 <= token_id < len(table):
                if self.embedding_rows and len(table) <= token_id < self.embedding_rows:
                    continue  # a padding row of the model's table: an id with no text
                raise StagewiseError(
                    f"token id {token_id} is outside the vocabulary of {len(table)} tokens"
                )
            if token_id not in skipped:
                out.append(table[token_id])
        return b"".join(out)


def checked_eos_ids(ids, vocab_size: int, where: str) -> tuple[int, ...]:
    """A list of end-of-sequence ids: ints inside the vocabulary, else one line naming `where`."""
    if not isinstance(ids, list | tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise StagewiseError(f"{where} must be an int or a list of ints, got {ids!r}")
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise StagewiseError(
            f"{where}: {outside[0]} is outside the vocabulary of {vocab_size} tokens"
        )
    return tuple(ids)


TINY_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@functools.cache
def _tiny_vocabulary() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(tokens, merges) trained on the built-in corpus: the slow part, done once, immutable."""
    tokens, merges = train.train_vocabulary(
        train.TINY_CORPUS, list(TINY_SPECIALS), PRESETS["tiny"].vocab_size
    )
    return tuple(tokens), tuple(merges)


def _tiny_tokenizer() -> Tokenizer:
    """The tiny vocabulary with SmolLM2's special-token ids, pre-tokenizer and chat template."""
    specials = list(TINY_SPECIALS)
    tokens, merges = _tiny_vocabulary()
    return Tokenizer(
        tokens=list(tokens),
        merges=list(merges),
        special_tokens={token: token_id for token_id, token in enumerate(specials)},
        bos_id=1,
        eos_id=2,
        pad_id=2,
        chat_template=CHATML_TEMPLATE,
        pre="smollm",
        add_bos=False,
    )
