"""The tokenizer's data, loaded from the model's own files, and decoding.

Two kinds of vocabulary, named as llama.cpp's `tokenizer.ggml.model` names them:

- "gpt2": GPT-2 style byte-level BPE (SmolLM2, Llama 3): token strings in a
  byte alphabet, merges in rank order, a regex pre-tokenizer.
- "llama": SentencePiece BPE (Llama 1/2, TinyLlama, Mistral): "▁" for spaces,
  a score per piece (merges by score), `<0xNN>` byte-fallback tokens.

`Tokenizer` holds what a model ships (tokens, merges or scores, literal tokens,
bos/eos, the chat template) and turns ids back into text. Encoding is the
`tokenize` stage (`stages/tokenize.py`, `stages/tokenize_sentencepiece.py`):
`encode` only picks its naive or optimized path.

Sources: a GGUF file (llama.cpp's `tokenizer.ggml.*` metadata), a Hugging
Face directory (`tokenizer.json` + `tokenizer_config.json`, or only a
SentencePiece `tokenizer.model`), or `tiny()`, a 512-token byte-level
vocabulary trained on a built-in corpus for the tiny test model.
"""

import dataclasses
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import tokenizers

from stagewise.config import PRESETS
from stagewise.errors import StagewiseError
from stagewise.models import bpe_train, sentencepiece_files
from stagewise.models.chat_template import CHATML_TEMPLATE, render_chat_template
from stagewise.models.files import read_json_object
from stagewise.models.incremental_decoder import IncrementalDecoder
from stagewise.stages import tokenize as tokenize_stage
from stagewise.stages import tokenize_sentencepiece as sp_stage
from stagewise.stages.pre_tokenizers import IGNORE_MERGES, canonical_pre_name

TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE (llama.cpp's names)
GGUF_CONTROL, GGUF_USER_DEFINED = (
    3,
    4,
)  # llama.cpp token types that are matched literally, before BPE
# `encode(backend=...)` -> stage path; "optimized" and "triton" are the names the rest of the package uses.
ENCODE_BACKENDS = {
    "naive": tokenize_stage.naive,
    "fast": tokenize_stage.optimized,
    "optimized": tokenize_stage.optimized,
    "triton": tokenize_stage.optimized,
}


@dataclass(eq=False, repr=False)
class Tokenizer:
    """A byte-level or SentencePiece BPE vocabulary and what goes with it; `encode` runs the tokenize stage."""

    tokens: list[
        str
    ]  # id -> token: byte alphabet ("Ġthe") or SentencePiece ("▁the", "<0x0A>"); specials as written
    merges: list[
        tuple[str, str]
    ]  # BPE merges in rank order (SentencePiece: [] = derived from the scores)
    special_tokens: dict[str, int]  # tokens matched literally in the text before BPE -> id
    bos_id: int | None  # beginning-of-sequence id
    eos_id: int | None  # end-of-sequence id; generation stops on it
    pad_id: int | None = None  # padding id, if the model names one
    chat_template: str | None = None  # jinja2 template that renders a chat into one prompt string
    pre: str = (
        "gpt2"  # pre-tokenizer name (llama.cpp's), canonicalised to a key of `PRE_TOKENIZERS`
    )
    add_bos: bool = (
        False  # prepend bos_id when encoding (SmolLM2: False, its template writes the markers)
    )
    ignore_merges: bool = False  # Llama 3: a piece that is already a token skips the merges
    model: str = (
        "gpt2"  # "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE); see TOKENIZER_MODELS
    )
    scores: list[float] | None = (
        None  # llama: id -> piece score; the best-scoring pair merges first
    )
    token_types: list[int] | None = (
        None  # llama: id -> 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte
    )
    unk_id: int | None = None  # llama: the <unk> id, for characters without byte tokens
    space_prefix: str = "sentencepiece"  # llama: where the dummy "▁" goes (sp_stage.SPACE_PREFIXES)
    embedding_rows: int | None = (
        None  # a model with more embedding rows than tokens: ids past the tokens have no text
    )
    # More ids that end generation besides eos_id: generation_config.json's eos_token_id list (Llama 3.1+:
    # <|end_of_text|>, <|eom_id|>, <|eot_id|>), a GGUF's tokenizer.ggml.eot_token_id / eom_token_id.
    extra_eos_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:  # the dataclass default would print all 49152 tokens
        return (
            f"Tokenizer(model={self.model!r}, vocab_size={self.vocab_size}, merges={len(self.merges)}, "
            f"pre={self.pre!r}, bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )

    def __post_init__(self) -> None:
        if self.model not in TOKENIZER_MODELS:
            raise StagewiseError(
                f"tokenizer model '{self.model}' is not supported; known: {', '.join(TOKENIZER_MODELS)}"
            )
        if self.model == "llama" and (self.scores is None or self.token_types is None):
            raise StagewiseError("a SentencePiece ('llama') tokenizer needs scores and token types")
        if self.model == "llama" and self.space_prefix not in sp_stage.SPACE_PREFIXES:
            raise StagewiseError(
                f"unknown space prefix '{self.space_prefix}'; known: {', '.join(sp_stage.SPACE_PREFIXES)}"
            )
        self.pre = canonical_pre_name(
            self.pre
        )  # llama.cpp's other spellings ("gpt-2") -> ours ("gpt2")
        for name in ("bos_id", "eos_id", "pad_id", "unk_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < len(self.tokens):
                raise StagewiseError(
                    f"{name} {value} is outside the vocabulary of {len(self.tokens)} tokens"
                )
        self.extra_eos_ids = checked_eos_ids(self.extra_eos_ids, len(self.tokens), "extra_eos_ids")
        if self.add_bos and self.bos_id is None:
            raise StagewiseError("add_bos is set but the tokenizer has no bos token")

    # ---- sources -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Read llama.cpp's `tokenizer.ggml.*` fields of a GGUF file (parsing it takes ~2 s)."""
        from stagewise.models.gguf_loader import open_gguf

        return cls.from_gguf_reader(open_gguf(path), name=Path(path).name)

    @classmethod
    def from_gguf_reader(cls, reader: gguf.GGUFReader, name: str = "GGUF") -> "Tokenizer":
        """The same, from an already open reader (a weight loader can share its reader)."""
        fields = reader.fields

        def read(key: str, default=None):
            return fields[key].contents() if key in fields else default

        model = read("tokenizer.ggml.model")
        end_ids = (read(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom"))
        common = {
            "bos_id": read("tokenizer.ggml.bos_token_id"),
            "eos_id": read("tokenizer.ggml.eos_token_id"),
            "pad_id": read("tokenizer.ggml.padding_token_id"),
            "chat_template": read("tokenizer.chat_template"),
            # llama.cpp ends generation on these too (end of turn, end of message: Llama 3's <|eot_id|>, <|eom_id|>)
            "extra_eos_ids": tuple(i for i in end_ids if i is not None),
        }
        if model == "llama":
            return cls(model="llama", **common, **sentencepiece_files.from_gguf_fields(read, name))
        if model != "gpt2":
            known = ", ".join(TOKENIZER_MODELS)
            raise StagewiseError(
                f"{name}: tokenizer model '{model}' is not supported; known: {known}"
            )
        tokens = read("tokenizer.ggml.tokens")
        token_types = read("tokenizer.ggml.token_type", [])
        literal_types = (GGUF_CONTROL, GGUF_USER_DEFINED)
        special = {tokens[i]: i for i, kind in enumerate(token_types) if kind in literal_types}
        pre = read("tokenizer.ggml.pre", "default")  # llama.cpp's fallback when the key is missing
        return cls(
            tokens=tokens,
            merges=[tuple(merge.split(" ", 1)) for merge in read("tokenizer.ggml.merges", [])],
            special_tokens=special,
            **common,
            pre=pre,
            add_bos=bool(read("tokenizer.ggml.add_bos_token", False)),
            ignore_merges=pre in IGNORE_MERGES,  # llama.cpp does the same (Llama 3, tekken, ...)
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """Read `tokenizer.json` (byte-level or SentencePiece BPE; else `tokenizer.model`) and its config."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            if (path / "tokenizer.model").is_file():
                fields = sentencepiece_files.read_model_proto(path / "tokenizer.model")
                return cls._sentencepiece(path, fields).with_generation_config(path)
            raise StagewiseError(f"no tokenizer.json or tokenizer.model in {path}")
        spec = read_json_object(tokenizer_file)
        try:
            tokenizer = cls._from_tokenizer_json(path, tokenizer_file, spec)
        except StagewiseError:
            raise
        except (
            KeyError,
            TypeError,
            AttributeError,
            ValueError,
            IndexError,
        ) as exc:  # a field of the wrong shape
            raise StagewiseError(
                f"{tokenizer_file}: not a tokenizer file this loader understands ({exc!r})"
            ) from None
        return tokenizer.with_generation_config(path)

    def with_generation_config(self, path: Path) -> "Tokenizer":
        """Add `generation_config.json`'s end-of-sequence ids (an int or a list), as transformers and vLLM stop on
        every one of them: Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>."""
        config_file = path / "generation_config.json"
        if not config_file.is_file():
            return self
        listed = read_json_object(config_file).get("eos_token_id")
        listed = [listed] if isinstance(listed, int) and not isinstance(listed, bool) else listed
        if listed is None:
            return self
        ids = checked_eos_ids(listed, len(self.tokens), f"{config_file}: eos_token_id")
        self.extra_eos_ids = tuple(
            dict.fromkeys((*self.extra_eos_ids, *(i for i in ids if i != self.eos_id)))
        )
        return self

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos_id and the extra end-of-sequence ids."""
        return frozenset(([] if self.eos_id is None else [self.eos_id]) + list(self.extra_eos_ids))

    @classmethod
    def _from_tokenizer_json(cls, path: Path, tokenizer_file: Path, spec: dict) -> "Tokenizer":
        if sentencepiece_files.is_sentencepiece_json(spec):
            return cls._sentencepiece(
                path, sentencepiece_files.from_tokenizer_json(spec, str(tokenizer_file))
            )
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
            kind = f"{model.get('type')} model, {(spec.get('decoder') or {}).get('type')} decoder"
            raise StagewiseError(
                f"{tokenizer_file}: {kind}; only GPT-2 style byte-level BPE is supported"
            )
        if spec.get("normalizer"):
            raise StagewiseError(
                f"{tokenizer_file}: a normalizer is not supported by byte-level BPE here"
            )
        pre = tokenize_stage.pre_name_from_hf(spec.get("pre_tokenizer"))

        by_id = {token_id: token for token, token_id in model["vocab"].items()}
        added = {entry["content"]: entry["id"] for entry in spec.get("added_tokens", [])}
        by_id.update({token_id: token for token, token_id in added.items()})
        if sorted(by_id) != list(range(len(by_id))):
            raise StagewiseError(f"{tokenizer_file}: token ids are not contiguous from 0")
        merges = [
            tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
            for m in model.get("merges", [])
        ]

        tokens = [by_id[i] for i in range(len(by_id))]
        lookup = {token: i for i, token in enumerate(tokens)}
        config, template = _read_hf_config(path)
        # A Llama 3 style file says "add bos" through its post-processor rather than the config.
        bos_from_post = _bos_from_post_processor(spec.get("post_processor"))
        names = {key: config.get(f"{key}_token") for key in ("bos", "eos", "pad")}
        names = {
            key: value.get("content") if isinstance(value, dict) else value
            for key, value in names.items()
        }
        check_named_tokens(
            {k: names[k] for k in ("bos", "eos")}, lookup, path / "tokenizer_config.json"
        )
        return cls(
            tokens=tokens,
            merges=merges,
            special_tokens=added,
            bos_id=lookup.get(names["bos"] or bos_from_post),
            eos_id=lookup.get(names["eos"]),
            pad_id=lookup.get(names["pad"]),
            chat_template=template,
            pre=pre,
            add_bos=bool(config.get("add_bos_token", bos_from_post is not None)),
            ignore_merges=bool(model.get("ignore_merges", False)),
        )

    @classmethod
    def _sentencepiece(cls, path: Path, fields: dict) -> "Tokenizer":
        """A SentencePiece vocabulary plus tokenizer_config.json (bos/eos names, add_bos, chat template)."""
        config, template = _read_hf_config(path)
        lookup = {token: i for i, token in enumerate(fields["tokens"])}
        for key in ("bos", "eos", "pad", "unk"):
            value = config.get(f"{key}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if value in lookup:
                fields[f"{key}_id"] = lookup[value]
        fields.setdefault("bos_id", lookup.get("<s>"))
        fields.setdefault("eos_id", lookup.get("</s>"))
        # tokenizer.json's post-processor decides; else the config; else True, Llama 2's default.
        add_bos = (
            bool(fields.pop("add_bos", config.get("add_bos_token", True)))
            and fields["bos_id"] is not None
        )
        return cls(model="llama", chat_template=template, add_bos=add_bos, **fields)

    @classmethod
    def tiny(cls) -> "Tokenizer":
        """The tiny model's 512-token vocabulary (trained once per process, then cached)."""
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

    def save_hf_dir(self, path: str | Path) -> Path:
        """Write `tokenizer.json` (from the Rust tokenizer) and `tokenizer_config.json` into `path` (and
        `generation_config.json` when there are more end-of-sequence ids than eos)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.rust.save(str(path / "tokenizer.json"))

        def name(token_id: int | None) -> str | None:
            return self.tokens[token_id] if token_id is not None else None

        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name(self.bos_id),
            "eos_token": name(self.eos_id),
            "pad_token": name(self.pad_id),
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        config_text = json.dumps(config, indent=2, ensure_ascii=False)
        (path / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
        if self.extra_eos_ids:  # where transformers keeps the other end-of-sequence ids
            eos = (
                [self.eos_id, *self.extra_eos_ids]
                if self.eos_id is not None
                else list(self.extra_eos_ids)
            )
            (path / "generation_config.json").write_text(
                json.dumps({"eos_token_id": eos}, indent=2)
            )
        return path

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
        normal = sp_stage.NORMAL
        pairs = zip(self.tokens, self.scores, self.token_types, strict=True)
        return {
            token: score
            for token, score, kind in pairs
            if kind == normal and score != float("-inf")
        }

    @functools.cached_property
    def sp_space_inside_pieces(self) -> bool:
        """llama: does some mergeable piece hold "▁" after another character ("a▁b", "end▁")?"""
        return any(sp_stage.SPACE in piece.lstrip(sp_stage.SPACE) for piece in self.sp_scores)

    @functools.cached_property
    def sp_pieces(self) -> dict[str, int]:
        """llama: normal pieces -> id (a merged symbol outside this map falls back to bytes)."""
        return {
            token: i
            for i, (token, kind) in enumerate(zip(self.tokens, self.token_types))
            if kind == sp_stage.NORMAL
        }

    @functools.cached_property
    def rust(self) -> tokenizers.Tokenizer:
        return tokenize_stage.build_rust_tokenizer(self)  # the optimized path's engine

    @functools.cached_property
    def plain_text(self) -> "Tokenizer":
        """The same vocabulary reading every character as text: no control tokens, no bos (for user content)."""
        return replace(self, special_tokens={}, add_bos=False)

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """id -> the bytes the token stands for (special tokens: their UTF-8 text)."""
        if self.model == "llama":
            return sp_stage.token_bytes(self.tokens, self.token_types)
        byte_of = {char: byte for byte, char in tokenize_stage.bytes_to_unicode().items()}
        special_ids = set(self.special_tokens.values())
        return [
            token.encode("utf-8")
            if token_id in special_ids
            else b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in token)
            for token_id, token in enumerate(self.tokens)
        ]

    # ---- text <-> ids --------------------------------------------------------------------

    def encode(
        self, text: str, backend: str = "naive", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`: backend "naive" (pure Python) or "fast" (Rust; also "optimized", "triton").

        `add_special_tokens=False`: no bos even if the model adds one (text from a chat template).
        """
        if backend not in ENCODE_BACKENDS:
            raise StagewiseError(f"unknown tokenizer backend '{backend}'; use naive or fast")
        return ENCODE_BACKENDS[backend](
            text=text, tokenizer=self, add_special_tokens=add_special_tokens
        ).tolist()

    @property
    def _utf8_errors(self) -> str:
        """How invalid UTF-8 reads: byte-level BPE one U+FFFD per broken sequence (as the Rust
        library), SentencePiece one per byte (as sentencepiece)."""
        return sp_stage.PER_BYTE_ERRORS if self.model == "llama" else "replace"

    @property
    def strips_leading_space(self) -> bool:
        """SentencePiece decoders drop the dummy prefix: one space at the start of the text."""
        return self.model == "llama" and self.space_prefix != "none"

    def decode(
        self, ids: Iterable[int], skip_special_tokens: bool = False, continuation: bool = False
    ) -> str:
        """Text of `ids`: join the tokens' bytes, decode UTF-8 (broken bytes become U+FFFD), drop a dummy prefix.

        `continuation`: the ids continue a text (a generated output after its prompt), so a leading
        SentencePiece space is a real space between the prompt's last word and the output's first, kept
        as vLLM keeps it (it decodes the output after the prompt's last tokens and subtracts their text).
        """
        text = self._bytes_of(ids, skip_special_tokens).decode("utf-8", errors=self._utf8_errors)
        strip = self.strips_leading_space and not continuation
        return text[1:] if strip and text.startswith(" ") else text

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)

    @functools.cached_property
    def skipped_ids(self) -> frozenset[int]:
        """Ids `skip_special_tokens` drops: the literal tokens (SentencePiece: control and unknown only,
        its user-defined tokens are text, as transformers treats them)."""
        if self.model == "llama":
            skipped = (sp_stage.CONTROL, sp_stage.UNKNOWN)
            return frozenset(
                i for i in self.special_tokens.values() if self.token_types[i] in skipped
            )
        return frozenset(self.special_tokens.values())

    def _bytes_of(self, ids: Iterable[int], skip_special_tokens: bool) -> bytes:
        special_ids = self.skipped_ids if skip_special_tokens else frozenset()
        table = self.token_bytes
        out = []
        for token_id in ids:
            token_id = int(token_id)
            if not 0 <= token_id < len(table):
                if self.embedding_rows and len(table) <= token_id < self.embedding_rows:
                    continue  # a padding row of the model's table: a real id with no text (as transformers)
                raise StagewiseError(
                    f"token id {token_id} is outside the vocabulary of {len(table)} tokens"
                )
            if token_id not in special_ids:
                out.append(table[token_id])
        return b"".join(out)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a chat ([{"role": ..., "content": ...}]) into one prompt string with the model's template.

        Rendered like transformers' `apply_chat_template(..., tokenize=False)`.
        """
        if not self.chat_template:
            raise StagewiseError("this model has no chat template; pass a plain prompt instead")
        special = {
            f"{name}_token": self.tokens[token_id]
            for name, token_id in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id))
            if token_id is not None
        }
        return render_chat_template(self.chat_template, messages, add_generation_prompt, special)

    def chat_segments(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]]:
        """The rendered chat as (text, is_template) pieces: the template's own text, and each message's content.

        Only the template's pieces may hold control tokens (`<|im_start|>`, Llama 3's headers);
        content is tokenized as plain text, so a user cannot forge a system turn by typing
        the markers. The template is rendered with a placeholder in place of each content
        and cut there; a template that trims content (Llama 3's `| trim`) is followed.
        A template whose markers are plain text (Llama 2's `[INST]`) cannot be protected
        this way: the model sees the same tokens either way.
        """
        holders = [
            f"\ue000{i}\ue001" for i in range(len(messages))
        ]  # private-use code points: no template edits them
        rendered = self.apply_chat_template(
            [{**m, "content": h} for m, h in zip(messages, holders)], add_generation_prompt
        )
        real = self.apply_chat_template(messages, add_generation_prompt)
        pieces, order, rest = [], [], rendered
        for _ in messages:
            cut = min(((rest.find(h), i) for i, h in enumerate(holders) if h in rest), default=None)
            if cut is None:
                break
            at, i = cut
            pieces.append(rest[:at])
            order.append(i)
            rest = rest[at + len(holders[i]) :]
        pieces.append(rest)
        for shape in (lambda c: c, str.strip):  # content as given, or trimmed by the template
            contents = [shape(messages[i]["content"]) for i in order]
            segments = [(pieces[0], True)]
            for content, piece in zip(contents, pieces[1:]):
                segments += [(content, False), (piece, True)]
            if "".join(text for text, _ in segments) == real:
                return [(text, is_template) for text, is_template in segments if text]
        raise StagewiseError(
            "this chat template rewrites message content, so user text cannot be kept apart from its "
            "control tokens; pass special_tokens=True to trust the prompt"
        )


def _read_hf_config(path: Path) -> tuple[dict, str | None]:
    """`tokenizer_config.json` (or {}) and the chat template, wherever transformers saved it."""
    config_file = path / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    template = config.get("chat_template")
    template_file = path / "chat_template.jinja"  # newer transformers write the template here
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return config, template


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


def check_named_tokens(names: dict, lookup: dict, where: Path) -> None:
    """A bos/eos token named by the config must be in the vocabulary (else EOS would never stop a run)."""
    for key, name in names.items():
        if name is not None and name not in lookup:
            raise StagewiseError(f"{where}: {key}_token {name!r} is not in the vocabulary")


def _bos_from_post_processor(post: dict | None) -> str | None:
    """The token a `TemplateProcessing` post-processor puts first for a single sequence, if any."""
    if not post or post.get("type") != "TemplateProcessing" or not post.get("single"):
        return None
    first = post["single"][0]
    return first["SpecialToken"]["id"] if "SpecialToken" in first else None


@functools.cache
def _tiny_tokenizer() -> Tokenizer:
    """The tiny vocabulary with SmolLM2's special-token ids, pre-tokenizer and chat template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens, merges = bpe_train.train_vocabulary(
        bpe_train.TINY_CORPUS, specials, PRESETS["tiny"].vocab_size
    )
    return Tokenizer(
        tokens=tokens,
        merges=merges,
        special_tokens={token: token_id for token_id, token in enumerate(specials)},
        bos_id=1,
        eos_id=2,
        pad_id=2,
        chat_template=CHATML_TEMPLATE,
        pre="smollm",
        add_bos=False,
    )
